"""Hermes / Qwen2.5: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block a call.

Qwen2.5-Coder also writes a call as a fenced (```json ... ```) or bare JSON object, without the
tags, in every client tried; llama.cpp's Hermes parser accepts that too. Such an object is a call
only when it is all of the output and names a declared tool; anything else stays text."""
from __future__ import annotations

import json
import re

from .base import Call, ToolParser, call_from, call_json, loads

_FENCE = re.compile(r"\A```(?:json)?\s*(.*?)\s*```\Z", re.DOTALL)


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        content, calls = super().parse(text)
        if calls or not self.tools:
            return content, calls
        calls = self._untagged(text)
        return (None, calls) if calls else (text, [])

    def holdback(self, text: str) -> int:
        """With tools declared, an output that opens as JSON or a fence may be a call: all held."""
        head = text.lstrip()
        if self.tools and (not head or head.startswith(("{", "[", "```")) or "```".startswith(head)):
            return len(text)
        return super().holdback(text)

    def _calls(self, text: str) -> list[Call]:
        calls = [call_json(m.group(1)) for m in self._CALL.finditer(text)]
        return calls if calls and all(calls) else []

    def _untagged(self, text: str) -> list[Call]:
        body = text.strip()
        fenced = _FENCE.match(body)
        if fenced:
            body = fenced.group(1)
        value = loads(body)
        items = value if isinstance(value, list) else [value]
        calls = [call_from(v) for v in items]
        if not calls or not all(c is not None and c.name in self.tools for c in calls):
            return []
        return calls if _one_value(body) else []


def _one_value(body: str) -> bool:
    """Whether `body` is one JSON value and nothing else."""
    try:
        json.loads(body)
    except ValueError:
        return False
    return True
