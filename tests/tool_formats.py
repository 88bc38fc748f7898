"""The six tool-call formats as their chat templates write them (tests/data/templates/): a
conversation with tools, earlier calls and their results, and the text a model of the family
writes when it calls tools, taken from the template's own rendering of the same calls (the
assistant turn past the generation prompt, less the end-of-turn token the engine stops on)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from wallbreaker.text.chat_template import ChatTemplate

TEMPLATES = Path(__file__).parent / "data" / "templates"

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}, "days": {"type": "integer"},
                                          "metric": {"type": "boolean"}},
                                          "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone.",
                                      "parameters": {"type": "object", "properties": {
                                          "zone": {"type": "string"}, "offset": {"type": "number"}},
                                          "required": ["zone"]}}},
]
ONE_CALL = [("get_weather", {"city": "Paris", "days": 3, "metric": True})]
TWO_CALLS = [("get_weather", {"city": "Oslo", "days": 2, "metric": False}),
             ("get_time", {"zone": "CET", "offset": 1.5})]


@dataclass(frozen=True)
class Family:
    name: str
    template: str  # file in TEMPLATES
    bos: str
    eos: str
    parser: str  # the tool parser's name
    turn_end: tuple[str, ...]  # what ends a turn: the engine stops there, so an output never holds it
    one_call_a_turn: bool = False  # the template writes one call per assistant message
    system: bool = True  # Mistral's moves the system message to the last user turn: leave it out

    def chat_template(self) -> ChatTemplate:
        return ChatTemplate((TEMPLATES / self.template).read_text(), self.bos, self.eos)

    def history(self) -> list[dict]:
        """User, an assistant call, its result, and the user again: what a request sends."""
        system = [{"role": "system", "content": "You are helpful."}] if self.system else []
        return system + [
                {"role": "user", "content": "Weather in Rome?"},
                {"role": "assistant", "content": None, "tool_calls": [tool_call("get_weather", {"city": "Rome"}, 0)]},
                {"role": "tool", "tool_call_id": call_id(0), "content": "21 degrees"},
                {"role": "assistant", "content": "It is 21 degrees in Rome."},
                {"role": "user", "content": "And now?"}]

    def output(self, calls: list[tuple[str, dict]]) -> str:
        """What the model writes to make `calls`: the template's rendering of an assistant turn
        with those calls, past the prompt. A family whose template takes one call a turn writes
        several as its turns one after the other (Llama 3 JSON: joined by `; `)."""
        template, history = self.chat_template(), self.history()
        prompt = template.render(history, add_generation_prompt=True, tools=TOOLS)
        groups = [[c] for c in calls] if self.one_call_a_turn else [calls]
        pieces = []
        for i, group in enumerate(groups):
            message = {"role": "assistant", "content": None,
                       "tool_calls": [tool_call(name, args, 10 + 10 * i + j) for j, (name, args) in enumerate(group)]}
            whole = template.render(history + [message], add_generation_prompt=False, tools=TOOLS)
            base = prompt if whole.startswith(prompt) else template.render(history, add_generation_prompt=False,
                                                                           tools=TOOLS)
            assert whole.startswith(base), f"{self.name}: the call does not follow the prompt"
            pieces.append(self._cut(whole[len(base):]))
        joiner = "; " if self.parser == "llama3_json" else ""
        if self.parser == "harmony" and len(pieces) > 1:  # each later turn opens with its own <|start|>assistant
            return pieces[0] + "".join("<|call|><|start|>assistant" + p for p in pieces[1:])
        return joiner.join(pieces)

    def _cut(self, text: str) -> str:
        text = text.rstrip("\n")
        for end in self.turn_end:
            if text.endswith(end):
                return text[:-len(end)]
        raise AssertionError(f"{self.name}: the turn does not end in {self.turn_end}: {text[-40:]!r}")


def call_id(i: int) -> str:
    return f"call{i:05d}"  # 9 characters: Mistral's templates insist


def tool_call(name: str, args: dict, i: int) -> dict:
    return {"id": call_id(i), "type": "function", "function": {"name": name, "arguments": args}}


FAMILIES = {
    "qwen2.5": Family("qwen2.5", "Qwen-Qwen2.5-7B-Instruct.jinja", "", "<|im_end|>", "hermes", ("<|im_end|>",)),
    "qwen3-coder": Family("qwen3-coder", "Qwen3-Coder.jinja", "", "<|im_end|>", "qwen3_coder", ("<|im_end|>",)),
    "llama3.1": Family("llama3.1", "meta-llama-Llama-3.1-8B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>",
                       "llama3_json", ("<|eot_id|>",), one_call_a_turn=True),
    "llama3.2": Family("llama3.2", "meta-llama-Llama-3.2-3B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>",
                       "llama3_json", ("<|eot_id|>",), one_call_a_turn=True),
    "mistral": Family("mistral", "mistralai-Mistral-Nemo-Instruct-2407.jinja", "<s>", "</s>", "mistral", ("</s>",),
                      system=False),
    "deepseek-v3.1": Family("deepseek-v3.1", "deepseek-ai-DeepSeek-V3.1.jinja", "<｜begin▁of▁sentence｜>",
                            "<｜end▁of▁sentence｜>", "deepseek", ("<｜end▁of▁sentence｜>",)),
    "gpt-oss": Family("gpt-oss", "openai-gpt-oss-120b.jinja", "<|startoftext|>", "<|return|>", "harmony",
                      ("<|call|>",), one_call_a_turn=True),
}


def calls_of(message_calls: list[dict]) -> list[tuple[str, dict]]:
    """(name, arguments) of OpenAI-shaped tool calls, arguments read from their JSON."""
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message_calls]
