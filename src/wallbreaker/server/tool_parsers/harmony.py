"""gpt-oss's calls: harmony messages to `functions.NAME` on the commentary channel (server/harmony.py
splits the output and writes each call in one canonical form, read here)."""
from __future__ import annotations

import re

from ..harmony import CALL_PREFIX, harmony_split
from .base import Call, ToolParser, arguments_json, loads

_CALL = re.compile(re.escape(CALL_PREFIX) + r"(\S+?) <\|constrain\|>json<\|message\|>(.*?)(?:<\|call\|>|\Z)",
                   re.DOTALL)


class HarmonyParser(ToolParser):
    name = "harmony"
    markers = (CALL_PREFIX,)
    special_markers = True

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        return super().parse(harmony_split(text).content)

    def _calls(self, text: str) -> list[Call]:
        calls = []
        for m in _CALL.finditer(text):
            args = loads(m.group(2))
            if not isinstance(args, dict):
                return []
            calls.append(Call(m.group(1), arguments_json(args)))
        return calls
