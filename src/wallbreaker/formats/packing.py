"""The stored form of codes: each row a little-endian bitstream of `bits`-bit codes.

Code j of a row occupies bits [j·bits, (j+1)·bits) of the row's bytes, lowest bit first, so a row of
n codes takes ceil(n·bits / 8) bytes. At 4 bits byte k holds column 2k in its low nibble and column
2k+1 in its high nibble; at 8 bits it is one code a byte; 3-bit codes really take 3 bits.
"""
from __future__ import annotations

import torch


def packed_row_bytes(n: int, bits: int) -> int:
    return -(-n * bits // 8)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, n] uint8 codes < 2^bits -> [rows, ceil(n·bits/8)] uint8."""
    rows, n = codes.shape
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    pad = -n % 8
    q = torch.nn.functional.pad(codes.long(), (0, pad)).view(rows, -1, 8)  # 8 codes fill `bits` bytes
    shifts = torch.arange(8, dtype=torch.long) * bits
    word = (q << shifts).sum(-1)  # [rows, n/8], at most 56 bits
    out = (word[..., None] >> (torch.arange(bits, dtype=torch.long) * 8)) & 0xFF  # [rows, n/8, bits]
    return out.reshape(rows, -1)[:, :packed_row_bytes(n, bits)].to(torch.uint8).contiguous()


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_codes`: [rows, ceil(n·bits/8)] uint8 -> [rows, n] uint8."""
    rows = packed.shape[0]
    if bits == 8:
        return packed[:, :n].to(torch.uint8)
    groups = -(-n // 8)
    b = torch.nn.functional.pad(packed.long(), (0, groups * bits - packed.shape[1])).view(rows, groups, bits)
    word = (b << (torch.arange(bits, dtype=torch.long) * 8)).sum(-1)  # [rows, groups]
    q = (word[..., None] >> (torch.arange(8, dtype=torch.long) * bits)) & ((1 << bits) - 1)
    return q.reshape(rows, -1)[:, :n].to(torch.uint8)
