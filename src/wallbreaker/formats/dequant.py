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


# --- the i-quants, ternary and micro-scaled types: each mirrors gguf.quants' numpy kernel --------

_GRIDS: dict[str, torch.Tensor] = {}
_KSIGNS: list[torch.Tensor] = []
_IQ4_VALUES = torch.tensor(gguf.quants.IQ4_NL.kvalues, dtype=torch.int8)
_FP4_VALUES = torch.tensor(gguf.quants.MXFP4.kvalues, dtype=torch.int8)  # e2m1, doubled
_IQ1_DELTA = 0.125


def _grid(name: str) -> torch.Tensor:
    """An i-quant's codebook from the gguf package, [entries, values] float32."""
    if name not in _GRIDS:
        cls = getattr(gguf.quants, name)
        cls.init_grid()
        _GRIDS[name] = torch.from_numpy(np.array(cls.grid)).reshape(cls.grid_shape)
    return _GRIDS[name]


def _ksigns() -> torch.Tensor:
    """The 128 sign patterns of 8 values (even parity), indexed by 7 bits: [128] uint8."""
    if not _KSIGNS:
        _KSIGNS.append(torch.frombuffer(bytearray(gguf.quants.IQ2_XXS.ksigns), dtype=torch.uint8))
    return _KSIGNS[0]


def _le(b: torch.Tensor) -> torch.Tensor:
    """Little-endian unsigned integers of the last dim's bytes: [..., k] uint8 -> [...] int64."""
    out = b[..., 0].long()
    for i in range(1, b.shape[-1]):
        out |= b[..., i].long() << (8 * i)
    return out


def _sign_bits(x: torch.Tensor) -> torch.Tensor:
    """Each byte's 8 bits as +1 (clear) / -1 (set), float32: [...] -> [..., 8]."""
    bits = (x.unsqueeze(-1).long() >> torch.arange(8)) & 1
    return torch.where(bits == 0, 1.0, -1.0)


def _half_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 holding float16 bit patterns (0..65535) -> float32."""
    return torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(torch.float16).float()


def _iq2_xxs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    qs = blocks[:, 2:].reshape(n, 8, 2, 4)  # per 32 weights: 4 grid indices, then signs and scale
    aux = _le(qs[:, :, 1])  # [n, 8]
    db = (_half_at(blocks, 0) * (0.5 + (aux >> 28).float()) * 0.25).view(n, 8, 1, 1)
    signs = _ksigns()[(aux[..., None] >> torch.tensor([0, 7, 14, 21])) & 0x7F]  # [n, 8, 4]
    grid = _grid("IQ2_XXS")[qs[:, :, 0].long()]  # [n, 8, 4, 8]
    out.view(n, 8, 4, 8).copy_(db * grid * _sign_bits(signs))


def _iq2_xs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    qs = _le(blocks[:, 2:66].reshape(n, 32, 2))  # [n, 32] uint16: 9-bit index, 7-bit signs
    scales = _bits(blocks[:, 66:74], (0, 4), 0x0F).transpose(-1, -2).reshape(n, 16)
    db = (_half_at(blocks, 0) * (0.5 + scales.float()) * 0.25).view(n, 16, 1, 1)
    signs = _sign_bits(_ksigns()[qs >> 9]).view(n, 16, 2, 8)
    grid = _grid("IQ2_XS")[qs & 511].view(n, 16, 2, 8)
    out.view(n, 16, 2, 8).copy_(db * grid * signs)


def _iq2_s(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    qs, signs, qh, scales = blocks[:, 2:34], blocks[:, 34:66], blocks[:, 66:74], blocks[:, 74:82]
    scales = _bits(scales, (0, 4), 0x0F).transpose(-1, -2).reshape(n, 16)
    db = (_half_at(blocks, 0) * (0.5 + scales.float()) * 0.25).view(n, 16, 1, 1)
    high = _bits(qh, (0, 2, 4, 6), 0x03).transpose(-1, -2).reshape(n, 32).long()
    grid = _grid("IQ2_S")[qs.long() | (high << 8)].view(n, 16, 2, 8)
    out.view(n, 16, 2, 8).copy_(db * grid * _sign_bits(signs).view(n, 16, 2, 8))


def _iq3_xxs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    qs, aux = blocks[:, 2:66], _le(blocks[:, 66:98].reshape(n, 8, 4))  # aux [n, 8]: signs and scale
    db = (_half_at(blocks, 0) * (0.5 + (aux >> 28).float()) * 0.5).view(n, 8, 1, 1)
    signs = _ksigns()[(aux[..., None] >> torch.tensor([0, 7, 14, 21])) & 0x7F]  # [n, 8, 4]
    grid = _grid("IQ3_XXS")[qs.long()].view(n, 8, 4, 8)
    out.view(n, 8, 4, 8).copy_(db * grid * _sign_bits(signs))


def _iq3_s(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    qs, qh, signs, scales = blocks[:, 2:66], blocks[:, 66:74], blocks[:, 74:106], blocks[:, 106:110]
    scales = _bits(scales, (0, 4), 0x0F).transpose(-1, -2).reshape(n, 8)
    db = (_half_at(blocks, 0) * (1 + 2 * scales)).view(n, 8, 1, 1)
    high = _bits(qh, range(8), 1).transpose(-1, -2).reshape(n, 64).long()
    grid = _grid("IQ3_S")[qs.long() | (high << 8)].view(n, 8, 4, 8)
    out.view(n, 8, 4, 8).copy_(db * grid * _sign_bits(signs).view(n, 8, 4, 8))


def _iq1_s(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    qs, qh = blocks[:, 2:34], _le(blocks[:, 34:50].reshape(n, 8, 2))  # qh [n, 8] uint16
    dl = (_half_at(blocks, 0) * (2 * ((qh >> 12) & 7) + 1)).view(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, _IQ1_DELTA, -_IQ1_DELTA).float().view(n, 8, 1, 1)
    high = ((qh[..., None] >> torch.tensor([0, 3, 6, 9])) & 7).reshape(n, 32)
    grid = _grid("IQ1_S")[qs.long() | (high << 8)].view(n, 8, 4, 8)
    out.view(n, 8, 4, 8).copy_(dl * (grid + delta))


def _iq1_m(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """The one type whose float16 scale is spread over four fields (the top nibbles of its scales)."""
    n = blocks.shape[0]
    qs, qh, sc = blocks[:, :32], blocks[:, 32:48], _le(blocks[:, 48:56].reshape(n, 4, 2))  # sc [n, 4] uint16
    d = _half_bits(((sc & 0xF000) >> torch.tensor([12, 8, 4, 0])).sum(-1)).view(n, 1)  # disjoint bits: sum == or
    scales = ((sc[..., None] >> torch.tensor([0, 3, 6, 9])) & 7).reshape(n, 16)
    dl = (d * (2 * scales + 1)).view(n, 8, 2, 1, 1)
    nib = (qh.long()[..., None] >> torch.tensor([0, 4])).reshape(n, 32)  # a nibble per grid index
    grid = _grid("IQ1_M")[qs.long() | ((nib & 7) << 8)].view(n, 8, 2, 2, 8)
    delta = torch.where((nib & 0x08) == 0, _IQ1_DELTA, -_IQ1_DELTA).float().view(n, 8, 2, 2, 1)
    out.view(n, 8, 2, 2, 8).copy_(dl * (grid + delta))


def _iq4_nl(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _scaled(out, _IQ4_VALUES[_nibbles(blocks[:, 2:]).long()], _half_at(blocks, 0))


def _iq4_xs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    high = (_le(blocks[:, 2:4])[:, None] >> torch.arange(0, 16, 2)) & 3  # [n, 8]
    low = _bits(blocks[:, 4:8], (0, 4), 0x0F).transpose(-1, -2).reshape(n, 8).long()
    scales = (low | (high << 4)) - 32
    dl = (_half_at(blocks, 0) * scales.float()).view(n, 8, 1)
    q = _bits(blocks[:, 8:].reshape(n, 8, 16), (0, 4), 0x0F).reshape(n, 8, 32)
    _scaled(out.view(n, 8, 32), _IQ4_VALUES[q.long()], dl)


def _tq1_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    powers = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8)
    qs0 = (blocks[:, None, :32] * powers[:, None]).reshape(n, 160)  # uint8 products wrap, as numpy's
    qs1 = (blocks[:, None, 32:48] * powers[:, None]).reshape(n, 80)
    qh = (blocks[:, None, 48:52] * powers[:4, None]).reshape(n, 16)
    q = ((torch.cat([qs0, qs1, qh], dim=1).int() * 3) >> 8) - 1  # [n, 256] in -1..1
    _scaled(out, q, _half_at(blocks, 52))


def _tq2_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    q = _bits(blocks[:, :64].reshape(n, 2, 32), (0, 2, 4, 6), 3).reshape(n, 256).to(torch.int8) - 1
    _scaled(out, q, _half_at(blocks, 64))


def _e8m0_half(x: torch.Tensor) -> torch.Tensor:
    """ggml's e8m0 scale, halved (the e2m1 values are stored doubled): uint8 -> float32."""
    x = x.long()
    bits = torch.where(x < 2, 0x00200000 << x, (x - 1) << 23)
    return bits.to(torch.int32).view(torch.float32)


def _mxfp4(blocks: torch.Tensor, out: torch.Tensor) -> None:
    _scaled(out, _FP4_VALUES[_nibbles(blocks[:, 1:]).long()], _e8m0_half(blocks[:, :1]))


def _ue4m3_half(x: torch.Tensor) -> torch.Tensor:
    """NVFP4's unsigned e4m3 scales, halved: uint8 -> float32 (gguf's ue4m3_to_fp32)."""
    exp = (x.int() >> 3) & 0xF
    man = (x & 7).float()
    raw = torch.where(exp == 0, man * 2.0**-9, (1.0 + man / 8.0) * torch.pow(2.0, exp.float() - 7))
    return torch.where((x == 0) | (x == 0x7F), 0.0, raw * 0.5)


def _nvfp4(blocks: torch.Tensor, out: torch.Tensor) -> None:
    n = blocks.shape[0]
    d = _ue4m3_half(blocks[:, :4]).view(n, 4, 1)
    qs = blocks[:, 4:].reshape(n, 4, 8)
    q = _FP4_VALUES[torch.cat([qs & 0x0F, qs >> 4], dim=-1).long()]  # [n, 4, 16]
    out.view(n, 4, 16).copy_(d * q.float())


def _q8_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    """llama.cpp's dequantize_row_q8_K: float32 d, 256 int8 codes (the 16 int16 sums are not read)."""
    d = blocks[:, :4].contiguous().view(torch.float32)
    _scaled(out, blocks[:, 4:260].view(torch.int8), d)


_KERNELS: dict[gguf.GGMLQuantizationType, Callable[[torch.Tensor, torch.Tensor], None]] = {
    T.F32: _f32, T.F16: _f16, T.BF16: _bf16,
    T.Q4_0: _q4_0, T.Q4_1: _q4_1, T.Q5_0: _q5_0, T.Q5_1: _q5_1, T.Q8_0: _q8_0,
    T.Q2_K: _q2_k, T.Q3_K: _q3_k, T.Q4_K: _q4_k, T.Q5_K: _q5_k, T.Q6_K: _q6_k,
    T.IQ1_S: _iq1_s, T.IQ1_M: _iq1_m, T.IQ2_XXS: _iq2_xxs, T.IQ2_XS: _iq2_xs, T.IQ2_S: _iq2_s,
    T.IQ3_XXS: _iq3_xxs, T.IQ3_S: _iq3_s, T.IQ4_NL: _iq4_nl, T.IQ4_XS: _iq4_xs,
    T.TQ1_0: _tq1_0, T.TQ2_0: _tq2_0, T.MXFP4: _mxfp4, T.NVFP4: _nvfp4, T.Q8_K: _q8_k,
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
