"""RoPE variants against transformers' own initialisers (modeling_rope_utils), frequency by
frequency, and llama.cpp's per-frequency form of Llama 3's scaling against its parameters."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from wallbreaker.config import RopeScaling
from wallbreaker.formats.gguf_writer import llama3_freq_factors
from wallbreaker.formats.hf_writer import rope_parameters
from wallbreaker.layers.rotary import RotaryEmbedding, frequencies

HEAD_DIM, THETA, MAX_POS = 64, 500000.0, 8192
SCALINGS = {
    "linear": RopeScaling("linear", factor=4.0),
    "llama3": RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=1024),
    "yarn": RopeScaling("yarn", factor=4.0, original_max_position_embeddings=2048),
    "yarn-untruncated": RopeScaling("yarn", factor=4.0, original_max_position_embeddings=2048, beta_fast=16.0,
                                    truncate=False, attention_factor=1.3),
}
LONGROPE = RopeScaling("longrope", factor=MAX_POS / 1024, original_max_position_embeddings=1024,
                       short_factor=tuple(1.0 + i / 16 for i in range(HEAD_DIM // 2)),
                       long_factor=tuple(1.0 + i for i in range(HEAD_DIM // 2)))


def transformers_frequencies(s: RopeScaling, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    rope = rope_parameters(THETA, s)
    common = dict(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=MAX_POS)
    if s.kind == "longrope":
        config = Phi3Config(**common, rope_parameters={k: v for k, v in rope.items() if k != "factor"},
                            original_max_position_embeddings=s.original_max_position_embeddings)
    else:
        config = LlamaConfig(**common, rope_parameters=rope)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[s.kind](config, "cpu", seq_len=seq_len)
    return inv_freq.float(), float(attention_factor)


@pytest.mark.parametrize("name", SCALINGS)
def test_scaled_frequencies_equal_transformers(name):
    s = SCALINGS[name]
    ours, long, factor = frequencies(HEAD_DIM, THETA, s)
    theirs, their_factor = transformers_frequencies(s)
    assert long is None
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert factor == pytest.approx(their_factor, rel=1e-12)


def test_longrope_short_below_the_original_context_and_long_from_it():
    short, long, factor = frequencies(HEAD_DIM, THETA, LONGROPE)
    their_short, their_factor = transformers_frequencies(LONGROPE)
    their_long, _ = transformers_frequencies(LONGROPE, seq_len=MAX_POS)
    torch.testing.assert_close(short, their_short, rtol=0, atol=0)
    torch.testing.assert_close(long, their_long, rtol=0, atol=0)
    assert factor == pytest.approx(their_factor) and factor == pytest.approx(math.sqrt(1 + math.log(8) / math.log(1024)))
    rope = RotaryEmbedding(HEAD_DIM, THETA, LONGROPE)
    cos, _ = rope.cos_sin(torch.tensor([1023, 1024]))
    half = HEAD_DIM // 2
    torch.testing.assert_close(cos[0, :half], torch.cos(1023 * short) * factor)
    torch.testing.assert_close(cos[1, :half], torch.cos(1024 * long) * factor)


def test_attention_factor_scales_cos_and_sin():
    s = SCALINGS["yarn"]
    plain, scaled = RotaryEmbedding(HEAD_DIM, THETA), RotaryEmbedding(HEAD_DIM, THETA, s)
    positions = torch.arange(5)
    cos, sin = scaled.cos_sin(positions)
    inv_freq, _, factor = frequencies(HEAD_DIM, THETA, s)
    angles = positions.float()[:, None] * inv_freq
    torch.testing.assert_close(cos[:, :HEAD_DIM // 2], torch.cos(angles) * factor)
    torch.testing.assert_close(sin[:, HEAD_DIM // 2:], torch.sin(angles) * factor)
    assert factor > 1.0 and plain.attention_factor == 1.0


def test_llama3_as_llama_cpp_stores_it_is_the_same_rotation():
    """GGUF's `rope_freqs.weight`: base frequency / scaled frequency, one per pair of channels."""
    s = SCALINGS["llama3"]
    factors = llama3_freq_factors(s, HEAD_DIM, THETA)
    stored = RopeScaling("llama3", freq_factors=tuple(float(f) for f in factors))
    torch.testing.assert_close(frequencies(HEAD_DIM, THETA, stored)[0], frequencies(HEAD_DIM, THETA, s)[0],
                               rtol=1e-6, atol=0)
    assert min(factors) == 1.0 and max(factors) == 8.0
