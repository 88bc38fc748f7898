"""Quantized matmul kernels of our own (the C++ extension `wallbreaker._C`, csrc/): y = x Wᵀ with W
in GGUF block formats as stored, activations quantized to 8 bits once per call, integer dot
products, float32 out. docs/kernels.md has the design and the measured figures.

- `qmatmul(x, weights, qtypes, prompt=False)`: x [M, K] float32 or bfloat16; `weights` a list of
  segments, each a uint8 tensor [N_i, row_bytes] in the kernels' row layout (`pack_rows`) with its GGML
  type in `qtypes`; out [M, sum N_i] float32, the segments' columns side by side (fused q/k/v, gate/up).
  `prompt`: through the prompt tiles where the level has them (avx512 and avx2: weights decoded once
  per call into rows interleaved 16 (avx2: 8) a vector, csrc/prefill_avx512.inc, prefill_avx2.inc), for
  calls of many rows; each row's bits are then the same in any call, but not the row tiles'
  (`QuantLinear` takes them from `PROMPT_MIN_ROWS`).
- `qmatmul_reference`: the same product by dequantizing (formats.dequant) and a float matmul; the
  tests check the kernels against gguf's own dequantization.
- `qmatmul_dense`: the same product for calls of many activation rows (prefill) on CPUs with AMX:
  weight rows decoded to bfloat16 a tile at a time and multiplied in PyTorch's bfloat16 matmul
  (`dense_path()` says whether it runs here; `QuantLinear` takes it from `DENSE_MIN_ROWS` rows).
- `isa()`, `set_isa(level)`: the kernel level in use, chosen at first use from the CPU (`avx512`
  needs AVX-512 F/BW/VL/DQ + VNNI, `avx2` needs AVX2 + FMA + F16C, `arm` aarch64 with the
  dot-product extension, else `generic`), capped by
  `ATEN_CPU_CAPABILITY` (avx2 -> avx2, default -> generic) and set by `WALLBREAKER_CPU_ISA`.
"""
from __future__ import annotations

import functools
import platform
import os
from typing import Sequence

import gguf
import torch

from .. import _C
from ..formats.dequant import dequantize

T = gguf.GGMLQuantizationType

# The kernels' format table (csrc/qformats.h): per GGML type, values and bytes a block, the float16
# fields a 32-block starts with, and the code fields of a block in the row layout's group order.
_FORMATS = {T(qt): (bs, bb, halves, [int(f) for f in fields.split(",") if f])
            for _, qt, bs, bb, halves, _, fields in _C.formats()}
BLOCK32_TYPES = frozenset(t for t, (bs, *_) in _FORMATS.items() if bs == 32)
K_TYPES = frozenset(t for t, (bs, *_) in _FORMATS.items() if bs == 256)
SUPPORTED_TYPES = BLOCK32_TYPES | K_TYPES
# The kernel levels of this architecture, each run by every CPU that runs the next: x86-64's, or
# aarch64's (csrc/kernels_arm.cpp, bit for bit the generic level's results).
LEVELS = ("generic", "arm") if platform.machine().lower() in ("aarch64", "arm64") else ("generic", "avx2", "avx512")


# From this many activation rows a call takes the dense path where it runs: at 32 rows it already
# beats the integer tiles (8192x3072 Q4_K, 2 threads, Xeon with AMX: 3.1 ms against 5.0; 256 rows
# 12 ms against 37); a tile of 1024 decoded rows was the fastest of 128-1024.
DENSE_MIN_ROWS = 32
DENSE_TILE_ROWS = 1024
# From this many rows a call outside batch-invariant mode takes the prompt tiles (qmatmul's `prompt`).
PROMPT_MIN_ROWS = 32
_dense: bool | None = None


def dense_path() -> bool:
    """Whether `qmatmul_dense` runs here: the kernel level is avx512, the CPU has AVX-512 BF16 and
    PyTorch can use AMX (without AMX a bfloat16 matmul is no faster than the integer tiles).
    `WALLBREAKER_DENSE_PREFILL=0` turns it off, `=1` turns it on wherever the CPU can run it."""
    global _dense
    if _dense is None:
        wanted = os.environ.get("WALLBREAKER_DENSE_PREFILL", "")
        if wanted not in ("", "0", "1"):
            raise ValueError(f"WALLBREAKER_DENSE_PREFILL={wanted}: expected 0 or 1")
        able = _C.dense_supported() and isa() == "avx512"
        _dense = able and wanted != "0" and (wanted == "1" or _amx())
    return _dense


@functools.cache
def _amx() -> bool:
    """Whether PyTorch can use AMX here (a fact of the machine and the process: asked once)."""
    try:
        return bool(torch._C._cpu._init_amx())  # asks the kernel for AMX's state, as oneDNN will
    except AttributeError:
        return False


def qmatmul_dense(x: torch.Tensor, weights: Sequence[torch.Tensor], qtypes: Sequence[int],
                  chunk: int = 0) -> torch.Tensor:
    """`chunk` > 0: matmuls of exactly that many rows (the last padded), so that a row's bits do not
    depend on the number of rows (csrc/ops.cpp); 0: one matmul over all rows."""
    return _C.qmatmul_dense(x, list(weights), [int(q) for q in qtypes], DENSE_TILE_ROWS, chunk)


def isa() -> str:
    """The kernel level in use: 'avx512', 'avx2', 'arm' or 'generic'."""
    return _C.isa()


def cpu_model() -> str:
    """The CPU's model name (what tuned kernels and every speed figure are keyed by)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_isa() -> str:
    """The best level this CPU supports."""
    return _C.cpu_isa()


def set_isa(level: str | None) -> None:
    """Force a kernel level (None: the best the CPU has). A level the CPU lacks is an error."""
    global _dense
    try:
        _C.set_isa(level or "")
    except RuntimeError as e:
        raise ValueError(str(e).splitlines()[0]) from None
    _dense = None


@functools.lru_cache(maxsize=64)  # a tied embedding asks for it on every step
def _row_permutation(qtype: T, row_bytes: int) -> torch.Tensor | None:
    """Byte order of a row in the kernels' layout, as indices into the file's order (None: the same).
    32-block formats (csrc/qblocks.inc): the float16 d of every block, then (Q4_1, Q5_1) every m,
    then the codes in groups of 4 blocks (a row's last group: the rest), each of the format's code
    fields (the table's) for every block of the group before the next: Q4_x each block's 16 nibble
    bytes; Q5_x each block's qh bits 0-15, each block's qh bits 16-31, each block's nibble bytes;
    Q8_0 each block's first 16 codes, then each block's last 16. The K-quants keep the file's order."""
    if qtype not in BLOCK32_TYPES:
        return None
    _, size, halves, fields = _FORMATS[qtype]
    nb = row_bytes // size
    at = torch.arange(row_bytes).view(nb, size)
    parts = [at[:, 2 * h:2 * h + 2].reshape(-1) for h in range(halves)]
    codes = at[:, 2 * halves:]
    # the fields of a block's codes, each laid out for all blocks of a group before the next field
    ends = [sum(fields[:i + 1]) for i in range(len(fields))]
    spans = [(end - f, end) for f, end in zip(fields, ends)]
    full = nb // 4 * 4
    if full:
        g = codes[:full].view(full // 4, 4, -1)
        parts.append(torch.cat([g[:, :, a:b].reshape(full // 4, -1) for a, b in spans], dim=1).reshape(-1))
    if full < nb:
        t = codes[full:]
        parts.extend(t[:, a:b].reshape(-1) for a, b in spans)
    return torch.cat(parts)


def layout_is_stored(qtype: T) -> bool:
    """True where the kernels read a format's rows in the file's own byte order (the K-quants)."""
    return T(qtype) not in BLOCK32_TYPES


def pack_rows(raw: torch.Tensor, qtype: T) -> torch.Tensor:
    """[N, row_bytes] uint8 blocks in file order -> the kernels' row layout (the same bytes)."""
    perm = _row_permutation(T(qtype), raw.shape[1])
    return raw.contiguous() if perm is None else raw[:, perm].contiguous()


def unpack_rows(packed: torch.Tensor, qtype: T) -> torch.Tensor:
    """Inverse of `pack_rows` (any number of rows, e.g. the looked-up rows of an embedding)."""
    perm = _row_permutation(T(qtype), packed.shape[-1])
    if perm is None:
        return packed
    out = torch.empty_like(packed)
    out[..., perm] = packed
    return out


def qmatmul(x: torch.Tensor, weights: Sequence[torch.Tensor], qtypes: Sequence[int],
            prompt: bool = False) -> torch.Tensor:
    """x [M, K] @ concat(W_i)ᵀ -> [M, sum N_i] float32; see the module docstring."""
    return _C.qmatmul(x, list(weights), [int(q) for q in qtypes], prompt)


def dequantize_packed(w: torch.Tensor, qtype: T, in_features: int) -> torch.Tensor:
    """Float32 [N, in_features] of packed rows."""
    return dequantize(unpack_rows(w, qtype), T(qtype), (w.shape[0], in_features))


def qmatmul_reference(x: torch.Tensor, weights: Sequence[torch.Tensor], qtypes: Sequence[int]) -> torch.Tensor:
    """The product by dequantization and a float32 matmul (no activation rounding)."""
    k = x.shape[-1]
    w = torch.cat([dequantize_packed(wi, T(q), k) for wi, q in zip(weights, qtypes)])
    return x.float() @ w.T
