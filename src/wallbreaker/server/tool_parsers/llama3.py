"""Llama 3.1/3.2's JSON calls: the whole output is `{"name": ..., "parameters": {...}}` (several
joined by `;`), perhaps after `<|python_tag|>`."""
from __future__ import annotations

import json

from .base import Call, ToolParser, call_from

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG, "{")
    special_markers = True

    def start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(PYTHON_TAG) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def holdback(self, text: str) -> int:
        stripped = text.lstrip()
        return len(text) if not stripped or PYTHON_TAG.startswith(stripped) else 0

    def _calls(self, text: str) -> list[Call]:
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        calls = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return []
            call = call_from(obj)
            if call is None:
                return []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return calls
