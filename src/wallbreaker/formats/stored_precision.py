"""The precision a checkpoint stores its weights in, which `dtype="auto"` keeps for a pooling model.

A generative model on `auto` runs our kernels: stored GGUF blocks as they are, float weights made
Q8_0 at load, judged by perplexity. An embedding is judged against the reference's vectors, and a
user who built an index with sentence-transformers compares ours with those: all-MiniLM-L6-v2's
float32 checkpoint made Q8_0 at load gave a lowest cosine of 0.99945 against sentence-transformers on
tests/test_bert_minilm.py's ten texts, float32 1.0000000. So a pooling model on `auto` runs in the
precision most of its bytes are stored in: F32 (and F16, which bfloat16 would round) as float32,
BF16 as bfloat16 (its float32 norms, if any, are read in bfloat16 too), quantized blocks on the
kernels' path as stored. `dtype="packed"` asks for Q8_0
at load explicitly.
"""
from __future__ import annotations

from typing import Mapping

from .weights import WeightRef

_FLOAT = {"F32": "float32", "F16": "float32", "BF16": "bfloat16"}


def stored_dtype(weights: Mapping[str, WeightRef]) -> str:
    """`float32`, `bfloat16`, or `packed` (most bytes in quantized blocks): the engine dtype that keeps
    the checkpoint's precision."""
    by_type: dict[str, int] = {}
    for ref in weights.values():
        by_type[ref.stored_type] = by_type.get(ref.stored_type, 0) + ref.nbytes
    floats = {t: n for t, n in by_type.items() if t in _FLOAT}
    if 2 * sum(floats.values()) < sum(by_type.values()):
        return "packed"
    return _FLOAT[max(floats, key=floats.__getitem__)]
