"""Fields a request carries that this server does not act on: accepted, and named once in the log.

Clients add fields with every release (Claude Code's `context_management`, Codex's
`client_metadata`), and a server that refuses what it does not know breaks each of them in turn.
So a field no handler reads is ignored, never a 400, and logged at INFO the first time this process
sees it on that route, so an operator can tell what was left aside. A field whose meaning the
server cannot honour and that would change the answer (`n` > 1 where an API has no choices, an
image for a text-only model) is refused by the handler that reads it, with a 400 naming it.
docs/clients.md lists what each client sends and what becomes of it.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, model_validator

from .errors import bad_request

logger = logging.getLogger("wallbreaker.server")
_seen: set[tuple[str, str]] = set()
_lock = threading.Lock()


def note_ignored(where: str, names: Iterable[str], why: str = "not used by this server") -> None:
    """Log each of `names` (fields of `where`: a route, or a route and a nested object) the first
    time this process ignores it there."""
    for name in names:
        key = (where, name)
        with _lock:
            if key in _seen:
                continue
            _seen.add(key)
        logger.info("%s: ignoring the field '%s' (%s)", where, name, why)


def refuse_present(body: BaseModel, refused: dict[str, str], where: str) -> None:
    """A 400 for the first field of `refused` that `body` sets (not null, not false): fields whose
    meaning this server cannot honour, and whose absence would change the answer. The value of each
    says why."""
    extra = body.model_extra or {}
    for name, why in refused.items():
        if extra.get(name) not in (None, False):
            raise bad_request(f"{where}: the field '{name}' is not supported here: {why}", param=name)


class Lenient(BaseModel):
    """A request body or an object in one: strict types, and the fields it does not declare kept
    aside (`model_extra`), ignored and logged once under the model's name."""

    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="after")
    def _log_ignored(self) -> "Lenient":
        if self.model_extra:
            note_ignored(type(self).__name__, sorted(self.model_extra))
        return self
