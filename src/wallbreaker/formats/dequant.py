"""Dequantization of GGUF (llama.cpp) tensor types to float32 torch tensors.

Every kernel mirrors `gguf.quants.dequantize` operation for operation, so results are bit-for-bit
identical: float16 scales are widened to float32 first, each product/sum is its own rounded op
(no fused multiply-add), and operand order follows the reference.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import gguf
import numpy as np
import torch

from wallbreaker.errors import ModelFormatError, UnsupportedModelError

T = gguf.GGMLQuantizationType

# Weights dequantized per step: bounds temporaries for huge tensors (e.g. a 262144x640 embedding).
_CHUNK_WEIGHTS = 1 << 20


def block_info(qtype: gguf.GGMLQuantizationType) -> tuple[int, int]:
    """(weights per block, bytes per block)."""
    try:
        return gguf.GGML_QUANT_SIZES[T(qtype)]
    except (KeyError, ValueError):
        raise UnsupportedModelError(f"unknown GGUF tensor type {qtype!r}") from None


def tensor_nbytes(qtype: gguf.GGMLQuantizationType, shape: Sequence[int]) -> int:
    block, size = block_info(qtype)
    row = shape[-1] if len(shape) else 1
    if row % block:
        raise ModelFormatError(
            f"row length {row} is not a multiple of the {T(qtype).name} block size {block}"
        )
    return math.prod(shape) // block * size


def _half_at(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte `offset` of each block, widened to float32: [n_blocks, 1]."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def _bits(x: torch.Tensor, shifts: Sequence[int], mask: int) -> torch.Tensor:
    """(x >> s) & mask for each s, stacked on a new second-to-last dim: [..., len(shifts), k]."""
    s = torch.tensor(list(shifts), dtype=torch.uint8, device=x.device).view(-1, 1)
    return (x.unsqueeze(-2) >> s) & mask


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] packed -> [n, 32]: low nibbles then high nibbles."""
    return _bits(qs, (0, 4), 0x0F).reshape(qs.shape[0], 32)


def _qh32(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a little-endian uint32 -> its 32 bits: [n, 32]."""
    return _bits(qh.unsqueeze(-1), range(8), 1).reshape(qh.shape[0], 32)


def _scaled(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """out = q * scale, q an integer tensor. Widening first then multiplying in place is faster than
    torch's mixed-dtype multiply, and exact since the widening is."""
    out.copy_(q)
    return out.mul_(scale)


def _f32(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks.view(torch.float32))


def _f16(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks.view(torch.float16))


def _bf16(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(blocks.view(torch.bfloat16))


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(blocks[:, 2:]).view(torch.int8) - 8  # [n, 32]
    _scaled(out, q, _half_at(blocks, 0))


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _scaled(out, _nibbles(blocks[:, 4:]), _half_at(blocks, 0))
    out.add_(_half_at(blocks, 2))


def _q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    q = (_nibbles(blocks[:, 6:]) | (_qh32(blocks[:, 2:6]) << 4)).view(torch.int8) - 16  # [n, 32]
    _scaled(out, q, _half_at(blocks, 0))


def _q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(blocks[:, 8:]) | (_qh32(blocks[:, 4:8]) << 4)  # [n, 32]
    _scaled(out, q, _half_at(blocks, 0))
    out.add_(_half_at(blocks, 2))


def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _scaled(out, blocks[:, 2:].view(torch.int8), _half_at(blocks, 0))


def _q2_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    scales = blocks[:, :16]
    dl = (_half_at(blocks, 80) * (scales & 0x0F)).view(n, 16, 1)
    ml = (_half_at(blocks, 82) * (scales >> 4)).view(n, 16, 1)
    q = _bits(blocks[:, 16:80].reshape(n, 2, 32), (0, 2, 4, 6), 3).view(n, 16, 16)
    out = out.view(n, 16, 16)
    _scaled(out, q, dl)
    out.sub_(ml)


def _q3_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    lo = _bits(blocks[:, 96:104], (0, 4), 0x0F).view(n, 16)
    hi = _bits(blocks[:, 104:108], (0, 2, 4, 6), 3).view(n, 16)
    scales = ((lo | (hi << 4)).view(torch.int8) - 32).float()  # [n, 16]
    dl = (_half_at(blocks, 108) * scales).view(n, 16, 1)
    ql = _bits(blocks[:, 32:96].reshape(n, 2, 32), (0, 2, 4, 6), 3).view(n, 16, 16)
    qh = _bits(blocks[:, :32], range(8), 1).view(n, 16, 16)
    # the -4 offset applies where the hmask bit is clear
    q = ql.view(torch.int8) - ((qh ^ 1) << 2).view(torch.int8)  # [n, 16, 16]
    _scaled(out.view(n, 16, 16), q, dl)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 6-bit scales and mins packed in 12 bytes -> ([n, 8], [n, 8])."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_affine(blocks: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> None:
    """out = d*sc * q - dmin*m for Q4_K/Q5_K; q: [n, 8, 32]."""
    n = blocks.shape[0]
    sc, mn = _k_scale_min(blocks[:, 4:16])
    d = (_half_at(blocks, 0) * sc).view(n, 8, 1)
    dm = (_half_at(blocks, 2) * mn).view(n, 8, 1)
    out = out.view(n, 8, 32)
    _scaled(out, q, d)
    out.sub_(dm)


def _q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    q = _bits(blocks[:, 16:].reshape(n, 4, 32), (0, 4), 0x0F).view(n, 8, 32)
    _k_affine(blocks, q, out)


def _q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    ql = _bits(blocks[:, 48:].reshape(n, 4, 32), (0, 4), 0x0F).view(n, 8, 32)
    qh = _bits(blocks[:, 16:48], range(8), 1)  # [n, 8, 32]
    _k_affine(blocks, ql | (qh << 4), out)


def _q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    scales = blocks[:, 192:208].view(torch.int8)
    d = (_half_at(blocks, 208) * scales).view(n, 16, 1)
    ql = _bits(blocks[:, :128].reshape(n, 2, 64), (0, 4), 0x0F).view(n, 8, 32)
    qh = _bits(blocks[:, 128:192].reshape(n, 2, 32), (0, 2, 4, 6), 3).view(n, 8, 32)
    q = (ql | (qh << 4)).view(torch.int8) - 32
    _scaled(out.view(n, 16, 16), q.view(n, 16, 16), d)


_KERNELS: dict[gguf.GGMLQuantizationType, Callable[[torch.Tensor, torch.Tensor], None]] = {
    T.F32: _f32, T.F16: _f16, T.BF16: _bf16,
    T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0,
    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
}

SUPPORTED_TYPES: frozenset[gguf.GGMLQuantizationType] = frozenset(_KERNELS)


def dequantize(
    raw: torch.Tensor | np.ndarray, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    """raw: the tensor's bytes (uint8, any shape, contiguous; for F32/F16/BF16 it may also already be
    the typed array). shape: the logical shape in torch order (outermost first; the last dim is the one
    blocks run along). Returns a new float32 torch tensor of `shape`, on raw's device.

    A numpy `raw` (e.g. a read-only memmap) is copied chunk by chunk, never aliased, so the result
    owns its memory and no more than one chunk of the file is copied at a time.
    """
    try:
        qtype = T(qtype)
    except ValueError:
        raise UnsupportedModelError(f"unknown GGUF tensor type {qtype!r}") from None
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedModelError(f"GGUF tensor type {qtype.name} is not supported")
    shape = tuple(int(s) for s in shape)
    nbytes = tensor_nbytes(qtype, shape)
    if isinstance(raw, np.ndarray):
        data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        device = torch.device("cpu")
    else:
        data = raw.contiguous().reshape(-1).view(torch.uint8)
        device = raw.device
    if data.shape[0] != nbytes:
        raise ModelFormatError(
            f"{qtype.name} tensor of shape {list(shape)} needs {nbytes} bytes, got {data.shape[0]}"
        )

    block, size = block_info(qtype)
    n_blocks = nbytes // size
    out = torch.empty(shape, dtype=torch.float32, device=device)
    out_blocks = out.view(n_blocks, block)
    kernel = _KERNELS[qtype]
    step = max(1, _CHUNK_WEIGHTS // block)
    for lo in range(0, n_blocks, step):
        hi = min(lo + step, n_blocks)
        chunk = data[lo * size:hi * size]
        if isinstance(chunk, np.ndarray):
            chunk = torch.from_numpy(np.array(chunk))
        kernel(chunk.view(hi - lo, size), out_blocks[lo:hi])
    return out
