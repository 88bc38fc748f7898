"""Qwen3-Coder's XML calls:
`<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>`.

A value is text; it is typed by the parameter's type in the function's schema as Qwen's own
parser (qwen3coder_tool_parser.py) does: strings stay strings, integers and numbers are read as
numbers (a whole number as an integer), booleans from true/false, objects and arrays as JSON
(else a Python literal); `null` is null; a value that does not read as its type, or of an undeclared parameter, stays a string."""
from __future__ import annotations

import ast
import json
import re
from typing import Any

from .base import Call, ToolParser, arguments_json

_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)(?:</function>\s*(?:</tool_call>|$)|$)", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    markers = ("<tool_call>",)

    def _calls(self, text: str) -> list[Call]:
        calls = []
        for m in _CALL.finditer(text):
            name = m.group(1).strip()
            schema = (self.tools.get(name) or {}).get("parameters") or {}
            props = schema.get("properties") or {}
            args = {p.strip(): typed(_unwrap(v), props.get(p.strip())) for p, v in _PARAM.findall(m.group(2))}
            calls.append(Call(name, arguments_json(args)))
        return calls


def _unwrap(value: str) -> str:
    """The value between its tags, less the one newline on each side the format puts there."""
    value = value.removeprefix("\n")
    return value.removesuffix("\n")


def typed(value: str, schema: dict | None) -> Any:
    if value.lower() == "null":
        return None
    if not isinstance(schema, dict):
        return value
    kind = schema.get("type", "string")
    kind = (kind[0] if isinstance(kind, list) and kind else kind)
    kind = str(kind).strip().lower()
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return value.strip().lower() == "true"
    try:
        return json.loads(value)
    except ValueError:
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return value
