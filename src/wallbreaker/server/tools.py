"""Tool calling in chat: the tools into the prompt, the model's calls out of its text.

- The chat template receives `tools` (OpenAI's shape), assistant `tool_calls` (arguments as objects)
  and `role: tool` messages. A template that does not take tools (SmolLM2's) gets them as Hermes
  does it: a system message listing them, calls written as `<tool_call>` text, answers as
  `<tool_response>` text.
- `tool_choice: "auto"` (the default with tools) lets the model answer or call, and its own format is
  parsed into `tool_calls`: Hermes / Qwen2.5 `<tool_call>{...}</tool_call>`, Llama 3 JSON
  (`{"name": ..., "parameters": ...}`, after `<|python_tag|>` or alone) or Mistral `[TOOL_CALLS]`
  (a JSON list, or `name[ARGS]{...}`), chosen from what the template writes.
- `"required"` and a named function constrain the output with a grammar: a named call's output is
  its arguments (the function's parameter schema), a required one a JSON list of calls, each one of
  the tools with arguments that fit its parameters; both compact JSON.
- `"none"`: no tools in the prompt, no parsing.
"""
from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from ..formats.chat_template import ChatTemplate
from ..sampling_params import StructuredOutputsParams
from .errors import bad_request
from .protocol import ChatCompletionRequest, NamedToolChoice

HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


@dataclass
class Call:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


# -- parsers: the model's own way of writing calls ----------------------------------------------
class ToolParser(ABC):
    """Finds calls in a model's output. `start` is where the calls begin in a text (None: no call,
    or not yet); `parse` splits a whole output into content and calls."""

    name = "base"
    markers: tuple[str, ...] = ()

    def start(self, text: str) -> int | None:
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def holdback(self, text: str) -> int:
        """How many characters at the end of `text` might be the beginning of a marker."""
        for k in range(min(max((len(m) for m in self.markers), default=0), len(text)), 0, -1):
            if any(m.startswith(text[-k:]) for m in self.markers):
                return k
        return 0

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        start = self.start(text)
        if start is None:
            return text, []
        calls = self._calls(text[start:])
        if not calls:
            return text, []
        content = text[:start].strip()
        return content or None, calls

    @abstractmethod
    def _calls(self, text: str) -> list[Call]:
        """The calls in `text`, which begins at the first marker; [] unless every one parses."""


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def _calls(self, text: str) -> list[Call]:
        calls = [_call(m.group(1)) for m in self._CALL.finditer(text)]
        return calls if calls and all(calls) else []


class Llama3JsonParser(ToolParser):
    """Llama 3.1/3.2's JSON calls: the whole output is `{"name": ..., "parameters": {...}}` (several
    joined by `;`), perhaps after `<|python_tag|>`."""

    name = "llama3_json"
    markers = ("<|python_tag|>", "{")

    def start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith("<|python_tag|>") or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def holdback(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if not stripped or "<|python_tag|>".startswith(stripped) else 0

    def _calls(self, text: str) -> list[Call]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return []
            call = _call_from(obj)
            if call is None:
                return []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return calls


class MistralParser(ToolParser):
    """Mistral's `[TOOL_CALLS]` and then a JSON list of calls (v3), or `name[ARGS]{...}` each (v11+)."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def _calls(self, text: str) -> list[Call]:
        calls: list[Call] = []
        for part in text.split("[TOOL_CALLS]")[1:]:
            part = part.strip()
            if "[ARGS]" in part:
                name, _, args = part.partition("[ARGS]")
                call = _call(json.dumps({"name": name.strip(), "arguments": _loads(args)}))
                if call is None:
                    return []
                calls.append(call)
                continue
            value = _loads(part)
            items = value if isinstance(value, list) else [value]
            for item in items:
                call = _call_from(item)
                if call is None:
                    return []
                calls.append(call)
        return calls


def _loads(text: str) -> Any:
    try:
        return json.JSONDecoder().raw_decode(text.strip())[0]
    except ValueError:
        return None


def _call(text: str) -> Call | None:
    return _call_from(_loads(text))


def _call_from(obj: Any) -> Call | None:
    """A call from {"name": ..., "arguments" or "parameters": {...}} (arguments may be JSON text)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        parsed = _loads(args)
        args = parsed if isinstance(parsed, dict) else args
    return Call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parser_for(template: ChatTemplate) -> ToolParser:
    """The format the model writes calls in, judged from what its template writes."""
    source = template.source
    if "[TOOL_CALLS]" in source:
        return MistralParser()
    if "<tool_call>" in source or not template.supports_tools:  # no tools in the template: ours, Hermes's
        return HermesParser()
    if "<|python_tag|>" in source or "<|start_header_id|>" in source:
        return Llama3JsonParser()
    return HermesParser()


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
            value = _loads(text)
            calls = [_call_from(v) for v in value] if isinstance(value, list) else []
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
    parser = parser_for(template)
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
        listing = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{listing}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out, None


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
