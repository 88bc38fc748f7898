"""The fused per-layer steps (csrc/fused_ops.cpp) against the PyTorch ops they replace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wallbreaker import _C
from wallbreaker.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("rows", [1, 5, 70])
def test_add_rms_norm_adds_in_place_and_normalizes(rows):
    g = torch.Generator().manual_seed(0)
    x, delta, w = torch.randn(rows, 96, generator=g), torch.randn(rows, 96, generator=g), torch.randn(96, generator=g)
    h = x.clone()
    y = _C.add_rms_norm_(h, delta, w, 1e-6)
    assert torch.allclose(h, x + delta, atol=0, rtol=0)  # the residual add itself is exact
    torch.testing.assert_close(y, F.rms_norm(x + delta, (96,), w, 1e-6), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("act,ref", [("silu", F.silu), ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"))])
def test_gated_activation(act, ref):
    gate_up = torch.randn(7, 2 * 40, generator=torch.Generator().manual_seed(0)) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    # atol: a few float32 ulps of the |up| <= ~16 that multiplies an activation near 0
    torch.testing.assert_close(_C.gated_act(gate_up, act), ref(gate) * up, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="unknown activation"):
        _C.gated_act(gate_up, "relu")


@pytest.mark.parametrize("act,ref", [("silu", F.silu), ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"))])
def test_gated_activation_far_out_and_in_every_lane(act, ref):
    """Gates far past exp's float range either way (and 0, and tiny), in the vector body and the
    tail of a row (37 = two 16-lane vectors and 5 more), one row alone or among others."""
    edges = torch.tensor([-1e4, -200.0, -90.0, -88.5, -20.0, -1e-30, 0.0, 1e-30, 20.0, 88.5, 90.0, 200.0, 1e4])
    gate = torch.cat([edges, torch.linspace(-12, 12, 24)])  # 37
    up = torch.linspace(-3, 3, 37)
    rows = torch.stack([torch.cat([gate, up]), torch.cat([gate.flip(0), up])])
    out = _C.gated_act(rows, act)
    torch.testing.assert_close(out, ref(rows[:, :37]) * rows[:, 37:], atol=1e-5, rtol=1e-5)
    assert torch.equal(_C.gated_act(rows[1:], act), out[1:])  # a row's values whatever else is in the call


def reference_rope(x, cos, sin):
    """transformers' rotate-half RoPE: x * cos + rotate_half(x) * sin, with the plain (unfolded) sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_write_kv_rotates_q_and_k_and_writes_k_and_v_at_their_slots(cache_dtype, qk_norm):
    T, H, KVH, D, S = 6, 4, 2, 16, 40
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g)
    positions = torch.tensor([0, 1, 2, 17, 3, 100])
    rope = RotaryEmbedding(D, 10000.0)
    cos, sin = rope.cos_sin(positions)
    freqs = positions.float()[:, None] * rope.inv_freq
    plain_cos, plain_sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    slots = torch.tensor([5, 0, 39, 7, 8, 20])
    k_cache, v_cache = torch.zeros(KVH, S, D, dtype=cache_dtype), torch.zeros(KVH, S, D, dtype=cache_dtype)
    q_w, k_w = (torch.randn(D, generator=g), torch.randn(D, generator=g)) if qk_norm else (None, None)

    q = _C.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, H, KVH, q_w, k_w, 1e-6)

    q_in, k_in, v_in = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    q_in, k_in, v_in = q_in.view(T, H, D), k_in.view(T, KVH, D), v_in.view(T, KVH, D)
    if qk_norm:
        q_in, k_in = F.rms_norm(q_in, (D,), q_w, 1e-6), F.rms_norm(k_in, (D,), k_w, 1e-6)
    torch.testing.assert_close(q, reference_rope(q_in, plain_cos, plain_sin), atol=1e-5, rtol=1e-5)
    want_k = reference_rope(k_in, plain_cos, plain_sin).transpose(0, 1).to(cache_dtype)
    torch.testing.assert_close(k_cache[:, slots], want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(v_cache[:, slots], v_in.transpose(0, 1).to(cache_dtype))  # rounded as torch rounds
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[:, untouched].any() and not v_cache[:, untouched].any()


def test_rope_write_kv_refuses_a_slot_outside_the_cache():
    cache = torch.zeros(1, 4, 8)
    cos, sin = RotaryEmbedding(8, 10000.0).cos_sin(torch.tensor([0]))
    with pytest.raises(RuntimeError, match="slot out of range"):
        _C.rope_write_kv(torch.randn(1, 24), cos, sin, cache, cache.clone(), torch.tensor([4]), 1, 1, None, None, 0.0)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("with_offsets", [False, True])
def test_rope_write_kv_rounds_what_the_offsets_leave(kind, with_offsets):
    """A quantized row holds (x - offset) / scale, scale = amax|x - offset| / 127 (int8) or / 448 (fp8):
    it stands for page * scale + offset within half an int8 step, or fp8's 1/16 of |x - offset|."""
    T, H, KVH, D, S = 5, 2, 2, 16, 12
    g = torch.Generator().manual_seed(2)
    offsets = 200 * torch.randn(2, KVH, D, generator=g)  # Qwen2.5-like: a bias far above the rest
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g)
    qkv[:, H * D:] += offsets.flatten()
    cos, sin = RotaryEmbedding(D, 10000.0).cos_sin(torch.zeros(T, dtype=torch.long))  # position 0: K as projected
    dtype = torch.int8 if kind == "int8" else torch.float8_e4m3fn
    pages = [torch.zeros(KVH, S, D, dtype=dtype) for _ in range(2)]
    scales = [torch.zeros(KVH, S) for _ in range(2)]
    slots = torch.tensor([3, 0, 11, 7, 4])
    k_off, v_off = offsets if with_offsets else (None, None)

    _C.rope_write_kv(qkv, cos, sin, *pages, slots, H, KVH, None, None, 0.0, *scales, k_off, v_off)

    inputs = qkv[:, H * D:].view(T, 2, KVH, D).permute(1, 2, 0, 3)  # [K/V, KVH, T, D]
    for x, page, scale, offset in zip(inputs, pages, scales, offsets):
        zero = offset[:, None] if with_offsets else 0.0
        rest = x - zero
        scale = scale[:, slots]
        torch.testing.assert_close(scale, rest.abs().amax(-1) / (127 if kind == "int8" else 448))
        error = (page[:, slots].float() * scale[..., None] + zero - x).abs()
        bound = scale[..., None] / 2 if kind == "int8" else rest.abs() / 16
        assert (error <= bound * 1.001 + 1e-3).all()
