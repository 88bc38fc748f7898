"""Mistral's `[TOOL_CALLS]` and then a JSON list of calls (v3), or `name[ARGS]{...}` each (v11+)."""
from __future__ import annotations

from .base import Call, ToolParser, arguments_json, call_from, loads

TOOL_CALLS = "[TOOL_CALLS]"


class MistralParser(ToolParser):
    name = "mistral"
    markers = (TOOL_CALLS,)
    special_markers = True

    def _calls(self, text: str) -> list[Call]:
        calls: list[Call] = []
        for part in text.split(TOOL_CALLS)[1:]:
            part = part.strip()
            if "[ARGS]" in part:
                name, _, args = part.partition("[ARGS]")
                value = loads(args)
                if not name.strip() or not isinstance(value, dict):
                    return []
                calls.append(Call(name.strip(), arguments_json(value)))
                continue
            value = loads(part)
            items = value if isinstance(value, list) else [value]
            for item in items:
                call = call_from(item)
                if call is None:
                    return []
                calls.append(call)
        return calls
