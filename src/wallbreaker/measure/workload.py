"""Benchmark prompts of exact token lengths.

Each prompt is English-like text whose words are shuffled by its tag, so two prompts share no
prefix block (the prefix cache would otherwise turn a repeated measurement into a cache hit) and
every engine sees the same ids.
"""
from __future__ import annotations

import random
from typing import Any

WORDS = ("the memory wall decides how fast a model can write when every new token must read each weight "
         "once and the keys and values of all earlier tokens from memory while the arithmetic units wait "
         "so batching many sequences shares one read of the weights among them and a paged cache keeps "
         "their keys in small blocks that are filled as they grow and freed when they end").split()


def prompt_ids(tokenizer: Any, num_tokens: int, tag: str) -> list[int]:
    """`num_tokens` token ids starting with the tokenizer's usual specials, content seeded by `tag`."""
    rng = random.Random(tag)
    ids: list[int] = []
    words = max(16, num_tokens)
    while len(ids) < num_tokens:
        text = f"{tag}: " + " ".join(rng.choice(WORDS) for _ in range(words))
        ids = tokenizer.encode(text)
        words *= 2
    return ids[:num_tokens]


def mixed_lengths(count: int, low: int, high: int, seed: int = 0) -> list[int]:
    """`count` lengths spread evenly over [low, high] in a seeded random order (log-uniform-ish mixes
    overweight the short end; a serving mix here is meant to cover the range)."""
    if count == 1:
        return [low]
    lengths = [round(low + (high - low) * i / (count - 1)) for i in range(count)]
    random.Random(seed).shuffle(lengths)
    return lengths
