"""formats/stored_precision.py: the dtype `auto` gives a pooling model is the one most of its bytes
are stored in (the reference's precision), packed only for a checkpoint of quantized blocks."""
from __future__ import annotations

import pytest

from wallbreaker.formats.stored_precision import stored_dtype
from wallbreaker.formats.weights import WeightRef


def refs(**bytes_by_type: int) -> dict[str, WeightRef]:
    return {t: WeightRef(t, (1,), t, n, load=lambda: None) for t, n in bytes_by_type.items()}


@pytest.mark.parametrize("stored, dtype", [
    (dict(F32=100), "float32"),
    (dict(BF16=100, F32=2), "bfloat16"),  # bfloat16 weights beside float32 norms
    (dict(BF16=100), "bfloat16"),
    (dict(F16=100), "float32"),  # bfloat16 would round float16's mantissa
    (dict(Q8_0=90, F32=10), "packed"),  # llama.cpp's Q8_0 GGUF: the blocks as stored
    (dict(Q4_K=40, F32=60), "float32"),
])
def test_auto_keeps_the_precision_most_bytes_are_stored_in(stored, dtype):
    assert stored_dtype(refs(**stored)) == dtype
