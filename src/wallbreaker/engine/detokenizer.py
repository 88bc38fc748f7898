"""Incremental detokenization with stop strings.

Text is decoded from a sliding window of recent tokens and diffed against what was already
produced (the prefix-offset / read-offset technique of vLLM and TGI), so that tokenizers
whose pieces depend on their neighbours (byte-level BPE, leading-space handling) decode
exactly as the whole sequence would. A window whose text ends in U+FFFD may be in the
middle of a UTF-8 sequence: the replacement characters are held until later bytes complete
them (or until `flush`).

Stop strings: the first stop string to complete in the text (the occurrence ending
earliest; among those, the one starting earliest) cuts the output. Any suffix of the text
that could still grow into a stop string is held back, so emitted text never has to be
taken back.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context for the first generated tokens.
PROMPT_CONTEXT = 5


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: list[int],
        stop: list[str],
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = [s for s in stop if s]
        self._stop_prefixes = _proper_prefixes(tuple(self._stop))
        self._include_stop = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self._stop), default=0)

        context = list(prompt_ids[-PROMPT_CONTEXT:])
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends mid-character: its bytes would leak into the output's text.
            context, context_text = [], ""
        self._ids = context  # decoding context + generated tokens
        self._prefix_offset = 0  # window start: tokens before it are fully decoded
        self._read_offset = len(context)  # tokens before it are the window's settled prefix
        self._consumed = len(context_text)  # chars of decode(window) already taken as output

        self._emitted: list[str] = []  # chunks handed out
        self._pending = ""  # decoded but held back: it may be the start of a stop string
        self._stopped = False
        self._finished = False
        self.stop_string: str | None = None  # the stop string that cut the output, once one did

    @property
    def stopped(self) -> bool:
        return self._stopped

    def text(self) -> str:
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that became safe to emit (may be "")."""
        if self._stopped or self._finished:
            return ""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """The sequence ended for another reason: emit whatever was held back."""
        if self._stopped or self._finished:
            return ""
        out = self._advance(final=True)
        self._finished = True
        return out

    def _advance(self, final: bool) -> str:
        window = self._decode(self._ids[self._prefix_offset :])
        settled = window if final else window.rstrip(REPLACEMENT_CHAR)
        old_len = len(self._pending)
        if len(settled) > self._consumed:
            self._pending += settled[self._consumed :]
            self._consumed = len(settled)
        if settled == window:
            self._slide_window()

        # A stop string completed now starts inside the held-back text or later, never in
        # emitted text: whatever could begin one was held back.
        cut = self._find_stop(old_len)
        if cut is not None:
            self._stopped = True
        elif final:
            cut = len(self._pending)
        else:
            cut = len(self._pending) - self._held_back()
        out, self._pending = self._pending[:cut], self._pending[cut:]
        if out:
            self._emitted.append(out)
        return out

    def _slide_window(self) -> None:
        """The whole window is decoded: its newest tokens become the next window's prefix."""
        if self._read_offset == len(self._ids):
            return
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._consumed = len(self._decode(self._ids[self._prefix_offset :]))

    def _find_stop(self, old_len: int) -> int | None:
        """Cut position in the pending text for the earliest-ending stop string ending after old_len."""
        best: tuple[int, int] | None = None  # (end, start)
        for s in self._stop:
            start = self._pending.find(s, max(0, old_len - len(s) + 1))
            if start != -1 and (best is None or (start + len(s), start) < best):
                best = (start + len(s), start)
                self.stop_string = s
        if best is None:
            return None
        end, start = best
        return end if self._include_stop else start

    def _held_back(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of a stop string."""
        text = self._pending
        for k in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            if text[-k:] in self._stop_prefixes:
                return k
        return 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""


@lru_cache(maxsize=256)
def _proper_prefixes(stop: tuple[str, ...]) -> frozenset[str]:
    """Every proper prefix of the stop strings: one set lookup per suffix length, whatever their
    number. Shared by a request's n sequences and by requests with the same stop list."""
    return frozenset(s[:k] for s in stop for k in range(1, len(s)))
