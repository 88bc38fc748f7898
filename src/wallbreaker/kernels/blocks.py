"""GGUF blocks made at load for weights that have none stored (float checkpoints, wallbreaker's own
int-code folders, tensor-parallel column slices that cut a block), so that every linear layer of
the `auto` path runs through the kernels.

- `q8_0_blocks`: any float weight -> Q8_0 (gguf's quantize_q8_0: d = amax/127 per 32, codes
  round-half-even of w/d, d stored as float16).
- `q4_1_blocks`: a grid of <= 4-bit codes with a scale and zero point per group of a multiple of
  32 columns, (q - z)·s -> Q4_1 with d = s, m = -z·s: the same codes and scale, only m rounded to
  float16 (relative error 2^-11 of m).
- `q5_0_exact_blocks`: a weight every 32-block of which is a power of two times integers of at most
  15 in size (MXFP4's e2m1 values, 2^e times 0, +-0.5, ... +-6, are that) -> Q5_0 blocks that hold it
  exactly, or None: MXFP4 experts run on the kernels with their stored values, at 22 bytes a block.
- `random_blocks`: random codes with scales of a trained model's size, as stored, for benchmarks,
  the random-weight models of measure/random_model.py and the tile tuner (kernels/tuning.py).
"""
from __future__ import annotations

import gguf
import numpy as np
import torch

from ..formats.grid import QuantizedTensor


def q8_0_blocks(w: torch.Tensor) -> torch.Tensor:
    """[N, K] float (K % 32 == 0) -> [N, K/32 * 34] uint8 Q8_0 blocks in file order."""
    n, k = w.shape
    b = w.float().reshape(n, k // 32, 32)
    d = b.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.round(b * inv).clamp(-127, 127).to(torch.int8)  # torch.round: half to even, as numpy
    out = torch.empty(n, k // 32, 34, dtype=torch.uint8)
    out[..., :2] = d.to(torch.float16).view(torch.uint8).view(n, k // 32, 2)
    out[..., 2:] = q.view(torch.uint8)
    return out.view(n, -1)


def q4_1_blocks(q: QuantizedTensor) -> torch.Tensor | None:
    """Q4_1 blocks of a grid of <= 4-bit codes, or None where the grid does not map (more bits,
    activation order, groups that are not a multiple of 32)."""
    n, k = q.shape
    if q.bits > 4 or q.g_idx is not None or q.group_size % 32 or k % q.group_size:
        return None
    reps = q.group_size // 32
    s = q.scales.float().repeat_interleave(reps, dim=1)  # [n, k / 32]
    z = q.zero_points().float().repeat_interleave(reps, dim=1)
    codes = q.codes.to(torch.uint8).view(n, k // 32, 32)
    out = torch.empty(n, k // 32, 20, dtype=torch.uint8)
    out[..., 0:2] = s.to(torch.float16).view(torch.uint8).view(n, k // 32, 2)
    out[..., 2:4] = (-z * s).to(torch.float16).view(torch.uint8).view(n, k // 32, 2)
    out[..., 4:] = codes[..., :16] | (codes[..., 16:] << 4)
    return out.view(n, -1)


def q5_0_exact_blocks(w: torch.Tensor) -> torch.Tensor | None:
    """[N, K] float (K % 32 == 0) -> [N, K/32 * 22] uint8 Q5_0 blocks (d, then the 32 high bits, then
    the low nibbles of codes j and j + 16 in byte j) whose values equal w exactly; None where a block
    has no such form. Each block's d is the smallest power of two with max|w| / d <= 15; w / d must
    then be whole numbers, and d a float16."""
    n, k = w.shape
    b = w.float().reshape(n, k // 32, 32)
    mantissa, exponent = torch.frexp(b.abs().amax(dim=-1, keepdim=True) / 15)  # max / 15 = m 2^e, m in [0.5, 1)
    d = torch.ldexp(torch.ones_like(mantissa), exponent - (mantissa == 0.5).int()).to(torch.float16)
    d = torch.where(mantissa == 0, torch.ones_like(d), d)  # an all-zero block
    q = torch.round(b / d.float())
    if not (torch.equal(q * d.float(), b) and bool((q.abs() <= 15).all())):
        return None
    u = (q + 16).to(torch.int64)  # [n, blocks, 32] in 1..31
    high = (((u >> 4) & 1) << torch.arange(32)).sum(-1, keepdim=True)  # bit j: code j's fifth bit
    out = torch.empty(n, k // 32, 22, dtype=torch.uint8)
    out[..., 0:2] = d.view(torch.uint8).view(n, k // 32, 2)
    out[..., 2:6] = ((high >> torch.tensor([0, 8, 16, 24])) & 0xFF).to(torch.uint8)
    out[..., 6:] = ((u[..., :16] & 0xF) | ((u[..., 16:] & 0xF) << 4)).to(torch.uint8)
    return out.view(n, -1)


Q = gguf.GGMLQuantizationType
# The float16 scale fields of each type's block (byte offsets) and the scale that gives weights a
# spread of ~0.02: Q8_0 d * q (q ~ 74 RMS); Q4_K d * sc * q (sc ~ 36, q ~ 9); Q6_K d * sc * q (~74 * 18);
# Q4_0 / Q5_0 d * (q - 8 / 16) (~4.6 / 9.2 RMS), Q4_1 d * q + m (its m the same small value).
_SCALES = {Q.Q8_0: ((0,), 2.7e-4), Q.Q4_K: ((0, 2), 6e-5), Q.Q6_K: ((208,), 1.5e-5),
           Q.Q4_0: ((0,), 4.3e-3), Q.Q5_0: ((0,), 2.2e-3), Q.Q4_1: ((0, 2), 2.2e-3)}


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] uint8 of random blocks with sane float16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    out = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    fields, scale = _SCALES[qtype]
    d = (rng.random((rows, cols // block, 1), dtype=np.float32) + 0.5) * scale
    for at in fields:
        out[:, :, at:at + 2] = d.astype(np.float16).view(np.uint8)
    return out.reshape(rows, -1)
