"""A Hugging Face folder's *.safetensors files: their headers opened, and each tensor as a WeightRef
read lazily (whole or a row or column range), in float32."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import ModelFormatError, ModelNotFoundError
from .weights import WeightRef

_DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def safetensors_handles(path: Path) -> list[tuple[Path, Any, list[str]]]:
    """(file, handle, tensor names) of every *.safetensors file: only their headers are read."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path}: no *.safetensors files")
    handles = []
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
            names = list(handle.keys())
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ModelFormatError(f"{file.name}: unreadable safetensors file: {e}") from None
        handles.append((file, handle, names))
    return handles


def tensor_ref(handle, hf_name: str, name: str, add_one: bool = False) -> WeightRef:
    """`hf_name` of an open file as canonical `name` (`add_one`: a norm stored as w, applied as 1 + w)."""
    sl = handle.get_slice(hf_name)
    dtype = getattr(torch, {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(sl.get_dtype(), "float32"))
    shape = tuple(sl.get_shape())
    return WeightRef(name, shape, _DTYPE_NAMES.get(dtype, sl.get_dtype()), _numel(shape) * dtype.itemsize,
                     _loader(handle, hf_name, add_one), load_part=_part_loader(handle, hf_name, add_one))


def _loader(handle, hf_name: str, add_one: bool):
    def load() -> torch.Tensor:
        w = handle.get_tensor(hf_name).float()
        return w + 1.0 if add_one else w
    return load


def _part_loader(handle, hf_name: str, add_one: bool):
    """Rows or columns read through `get_slice`: only those bytes come off the disk."""
    def load_part(dim: int, lo: int, hi: int) -> torch.Tensor:
        sl = handle.get_slice(hf_name)
        w = (sl[lo:hi] if dim == 0 else sl[:, lo:hi]).float()
        return w + 1.0 if add_one else w
    return load_part


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
