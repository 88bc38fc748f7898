"""Model bytes read where they lie in a file mapping: views of a mapped file as tensors, and giving a
mapping's pages back once their bytes live elsewhere (so that resident memory counts them once).

The kernels only read weights, so a weight tensor may be a read-only view of a file: the page cache
holds it, shared with every process that maps the same file, and the kernel can drop its pages under
memory pressure and read them again. llama.cpp runs models from the mapping the same way."""
from __future__ import annotations

import ctypes
import mmap
import warnings
from pathlib import Path

import numpy as np
import torch

_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def as_tensor(a: np.ndarray) -> torch.Tensor:
    """A torch view of (a part of) a read-only map; the kernels only read it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given NumPy array is not writable"
        return torch.from_numpy(a)


def map_file(path: Path, offset: int, nbytes: int) -> np.ndarray:
    """`nbytes` of `path` from `offset`, mapped read-only (uint8, 1-D)."""
    return np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=(nbytes,))


def _is_file_mapping(a: np.ndarray) -> bool:
    while a is not None:
        if isinstance(a, np.memmap) and isinstance(getattr(a, "_mmap", None), mmap.mmap):
            return True
        a = a.base if isinstance(a.base, np.ndarray) else None
    return False


def release_pages(a: np.ndarray) -> None:
    """Drop this process's resident pages of a mapped array's whole pages (the page cache keeps them;
    a later read maps them again). A no-op for memory that is not a read-only file mapping, where
    dropping pages would lose data."""
    if not _is_file_mapping(a) or a.flags.writeable:
        return
    start = -(-a.ctypes.data // _PAGE) * _PAGE
    end = (a.ctypes.data + a.nbytes) // _PAGE * _PAGE
    if end > start:
        _libc.madvise(start, end - start, _MADV_DONTNEED)


def file_mappings() -> list[tuple[int, int, str]]:
    """(start, end, path) of this process's file-backed mappings, sorted (Linux's /proc; empty elsewhere)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end, parts[5].removesuffix(" (deleted)")))
    return sorted(out)


def mapped_file(t: torch.Tensor, mappings: list[tuple[int, int, str]]) -> str | None:
    """The file whose mapping holds `t`'s bytes, or None (the process's own memory)."""
    ptr = t.data_ptr()
    for start, end, path in mappings:
        if start <= ptr < end:
            return path if ptr + t.numel() * t.element_size() <= end else None
    return None
