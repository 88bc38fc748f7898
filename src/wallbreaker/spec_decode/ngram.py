"""Prompt-lookup speculation: the last n tokens, found earlier in the sequence, propose what followed
them there. No second model; strong when the output repeats or edits its input."""
from __future__ import annotations


def propose_ngram(token_ids: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to k tokens following the most recent earlier match of the longest suffix n-gram."""
    if k <= 0:
        return []
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = token_ids[length - n:]
        for start in range(length - n - 1, -1, -1):
            if token_ids[start:start + n] == suffix:
                follow = token_ids[start + n: start + n + k]
                if follow:
                    return follow
    return []
