"""DRY ("Don't Repeat Yourself", p-e-w's sampler, as llama.cpp implements it): a penalty on the
tokens that would extend a verbatim repetition of the context.

If the context ends with n >= allowed_length tokens that also occur earlier, followed there by
token t, then t gets `multiplier * base ** (n - allowed_length)` subtracted from its logit (the
longest such n for each t). Sequence breakers cut repetitions: a match never reaches back past the
last breaker token of the context, and a breaker token itself is never penalized.

Written by hand: no library does this over token ids. The suffix matches come from the Z-algorithm
over the reversed context, linear in its length, as in llama.cpp.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from ..text.tokenizer import Tokenizer
from ..sampling_params import SamplingParams

FLOAT_MAX_LOG = 88.7228391  # log(float32 max): base ** exponent is clamped below it, as llama.cpp does


def dry_penalties(context: Sequence[int], params: SamplingParams, breakers: frozenset[int]) -> dict[int, float]:
    """{token id: the amount to subtract from its logit}, for the context (prompt + output tokens)."""
    last_n = params.dry_penalty_last_n
    tokens = list(context if last_n == -1 else context[max(0, len(context) - last_n):])
    n = len(tokens)
    allowed = params.dry_allowed_length
    if params.dry_multiplier == 0 or n <= allowed:
        return {}
    rev = tokens[::-1]
    # the tokens since the last breaker: no repetition reaches further back
    rep_limit = next((i for i, t in enumerate(rev) if t in breakers), n)
    if rep_limit < allowed:
        return {}
    match = _z_array(rev)  # match[k]: how many tokens ending k before the end repeat the context's end
    longest: dict[int, int] = {}
    for k in range(1, n):
        length = min(match[k], rep_limit)
        if length >= allowed:
            follower = rev[k - 1]  # the token that came after that earlier occurrence
            if length > longest.get(follower, -1):
                longest[follower] = length
    max_exponent = int(FLOAT_MAX_LOG / math.log(params.dry_base)) if params.dry_base > 1.000001 else 0
    penalties = {}
    for token, length in longest.items():
        if token in breakers:
            continue
        exponent = length - allowed
        if max_exponent > 0:
            exponent = min(exponent, max_exponent)
        penalties[token] = params.dry_multiplier * params.dry_base ** exponent
    return penalties


def _z_array(s: list[int]) -> list[int]:
    """z[k] = the length of the longest common prefix of s and s[k:] (z[0] = 0)."""
    n = len(s)
    z = [0] * n
    left = right = 0
    for k in range(1, n):
        length = min(right - k, z[k - left]) if k < right else 0
        while k + length < n and s[length] == s[k + length]:
            length += 1
        z[k] = length
        if k + length > right:
            left, right = k, k + length
    return z


class DryBreakers:
    """Sequence breakers (strings) -> the token ids whose text contains one, cached by breaker set.

    As llama.cpp, a token counts when its text contains a whole breaker; breakers that only a run of
    several tokens spells are not matched (llama.cpp's defaults, one character each, always are)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._texts: list[bytes] | None = None
        self._cache: dict[tuple[str, ...], frozenset[int]] = {}

    def ids(self, breakers: list[str]) -> frozenset[int]:
        key = tuple(sorted(set(breakers)))
        found = self._cache.get(key)
        if found is None:
            if self._texts is None:
                self._texts = [self._text(i) for i in range(self.tokenizer.vocab_size)]
            wanted = [b.encode() for b in key]
            found = frozenset(i for i, text in enumerate(self._texts) if any(w in text for w in wanted))
            self._cache[key] = found
        return found

    def _text(self, i: int) -> bytes:
        try:
            return self.tokenizer.token_bytes(i)
        except (IndexError, TypeError):
            return b""
