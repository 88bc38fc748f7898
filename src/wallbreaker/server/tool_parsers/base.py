"""What every tool-call format shares: a call, the parser's contract, and reading JSON calls."""
from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Call:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


class ToolParser(ABC):
    """Finds calls in a model's output. `start` is where the calls begin in a text (None: no call,
    or not yet); `parse` splits a whole output into content and calls. A call that does not parse
    leaves the whole output as content: never lost.

    `tools` are the request's (OpenAI's shape): a format that writes argument values as text types
    them by the function's schema, and one that reads bare JSON accepts only declared names.
    `special_markers`: the format's markers are special tokens, which the detokenizer must keep."""

    name = "base"
    markers: tuple[str, ...] = ()
    special_markers = False

    def __init__(self, tools: Sequence[dict] = ()):
        self.tools = {t["function"]["name"]: t["function"] for t in tools if t.get("function")}

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


def loads(text: str) -> Any:
    """The first JSON value in `text` (None if there is none)."""
    try:
        return json.JSONDecoder().raw_decode(text.strip())[0]
    except ValueError:
        return None


def call_from(obj: Any) -> Call | None:
    """A call from {"name": ..., "arguments" or "parameters": {...}} (arguments may be JSON text)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        parsed = loads(args)
        args = parsed if isinstance(parsed, dict) else args
    return Call(obj["name"], args if isinstance(args, str) else arguments_json(args))


def call_json(text: str) -> Call | None:
    return call_from(loads(text))


def arguments_json(args: Any) -> str:
    return json.dumps(args, ensure_ascii=False)
