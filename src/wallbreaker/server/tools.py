"""Tool calling in chat: the tools into the prompt, the model's calls out of its text.

- The chat template receives `tools` (OpenAI's shape), assistant `tool_calls` (arguments as objects)
  and `role: tool` messages. A template that does not take tools (SmolLM2's) gets them as Hermes
  does it: a system message listing them, calls written as `<tool_call>` text, answers as
  `<tool_response>` text. One that writes calls but lists no tools (DeepSeek-V3.1's) gets the
  listing its model card gives, after the system message.
- `tool_choice: "auto"` (the default with tools) lets the model answer or call, and its own format is
  parsed into `tool_calls` (server/tool_parsers/, one file a family: Hermes / Qwen2.5, Qwen3-Coder's
  XML, Llama 3 JSON, Mistral `[TOOL_CALLS]`, DeepSeek's, gpt-oss's harmony), chosen from what the
  template writes. A call that does not parse stays text.
- `"required"` and a named function constrain the output with a grammar: a named call's output is
  its arguments (the function's parameter schema), a required one a JSON list of calls, each one of
  the tools with arguments that fit its parameters; both compact JSON.
- `"none"`: no tools in the prompt, no parsing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..text.chat_template import ChatTemplate
from ..sampling_params import StructuredOutputsParams
from .errors import bad_request
from .protocol import ChatCompletionRequest, NamedToolChoice
from .tool_parsers import Call, DeepSeekParser, ToolParser, call_from, loads, parser_for
from .tool_parsers.deepseek import deepseek_tool_listing

HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


# -- the request's plan -------------------------------------------------------------------------
@dataclass
class ToolPlan:
    choice: str  # "auto" | "required" | "named"
    tools: list[dict]  # OpenAI's shape, for the template
    parser: ToolParser
    name: str | None = None  # the function a named choice forces
    spec: StructuredOutputsParams | None = None  # the constraint a forced choice puts on the output

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def calls_from_output(self, text: str) -> tuple[str | None, list[Call]]:
        """(content, calls) of a finished output."""
        if self.choice == "named":
            return None, [Call(self.name, text)]
        if self.choice == "required":
            value = loads(text)
            calls = [call_from(v) for v in value] if isinstance(value, list) else []
            if not calls or not all(calls):  # cut short (max_tokens): what came is left as content
                return text, []
            return None, calls
        return self.parser.parse(text)


def plan_tools(body: ChatCompletionRequest, template: ChatTemplate) -> ToolPlan | None:
    """None when the request has no tools or tool_choice is "none"."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    by_name = {t.function.name: t.function for t in body.tools}
    parser = parser_for(template, tools)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in by_name:
            raise bad_request(f"tool_choice names the function '{name}', which is not among the tools",
                              param="tool_choice")
        return ToolPlan("named", tools, parser, name, _compact(_parameters(by_name[name])))
    if choice == "required":
        calls = {"anyOf": [{"type": "object", "properties": {"name": {"enum": [name]}, "arguments": _parameters(f)},
                            "required": ["name", "arguments"], "additionalProperties": False}
                           for name, f in by_name.items()]}
        schema = {"type": "array", "items": calls, "minItems": 1}
        if body.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", tools, parser, spec=_compact(schema))
    return ToolPlan("auto", tools, parser)


def _compact(schema: dict) -> StructuredOutputsParams:
    """Arguments go back as JSON text: compact, as OpenAI's are (and no whitespace to pad with)."""
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def _parameters(function) -> dict:
    return function.parameters if function.parameters is not None else {"type": "object"}


def template_messages(messages: list[dict], tools: list[dict] | None,
                      template: ChatTemplate) -> tuple[list[dict], list | None]:
    """The messages and `tools` to render. A template that takes tools gets them as they are; one that
    does not gets them the Hermes way (see the module's docstring)."""
    uses_tools = tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if template.supports_tools or not uses_tools:
        return messages, tools
    if isinstance(parser_for(template), DeepSeekParser):  # writes calls itself, lists no tools
        return _with_system(messages, deepseek_tool_listing(tools)) if tools else messages, None
    out: list[dict] = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                            "arguments": c["function"]["arguments"]},
                                                           ensure_ascii=False) + "\n</tool_call>"
                              for c in m["tool_calls"])
            text = (m.get("content") or "").strip()
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        elif m.get("role") == "tool":
            answer = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_answers"):
                out[-1]["content"] += "\n" + answer
            else:
                out.append({"role": "user", "content": answer, "_tool_answers": True})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_tool_answers", None)
    if tools:
        out = _with_system(out, HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools)))
    return out, None


def _with_system(messages: list[dict], listing: str) -> list[dict]:
    """`listing` after the system message (a new one if there is none)."""
    if messages and messages[0].get("role") == "system":
        return [{**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{listing}".lstrip()}] + messages[1:]
    return [{"role": "system", "content": listing}] + messages


# -- streaming ----------------------------------------------------------------------------------
class ToolStream:
    """One choice's streamed text under tool_choice "auto": content is passed on until the calls
    begin (text that might be the start of a marker is held), the calls are parsed at the end."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of `text` already streamed as content
        self.started = False

    def feed(self, piece: str) -> str:
        """The content to stream now."""
        self.text += piece
        if self.started:
            return ""
        start = self.parser.start(self.text)
        if start is not None:
            self.started = True
            limit = start
        else:
            limit = len(self.text) - self.parser.holdback(self.text)
        out = self.text[self.sent:limit] if limit > self.sent else ""
        self.sent = max(self.sent, limit)
        return out

    def finish(self) -> tuple[str, list[Call]]:
        """The content still to stream, and the calls."""
        content, calls = self.parser.parse(self.text)
        if not calls:
            return self.text[self.sent:], []
        return "", calls
