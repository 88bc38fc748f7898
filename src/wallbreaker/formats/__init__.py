"""Model files in: GGUF through the `gguf` package, Hugging Face folders through `safetensors`."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import ModelNotFoundError
from .packaged import DEFAULT_MODEL, PACKAGED_MODELS, packaged_model_path
from .weights import ModelFiles, WeightRef


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """None -> the embedded default; a packaged alias (e.g. "gemma3-270m") -> its file; else a path."""
    if model is None:
        return packaged_model_path(DEFAULT_MODEL)
    if str(model) in PACKAGED_MODELS:
        return packaged_model_path(str(model))
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"{path}: no such file or folder")
    return path


def open_model(model: str | os.PathLike | None) -> ModelFiles:
    path = resolve_model_path(model)
    if path.is_dir():
        from .hf_model import read_hf_folder
        return read_hf_folder(path)
    from .gguf_model import read_gguf_model
    return read_gguf_model(path)


__all__ = ["ModelFiles", "WeightRef", "open_model", "resolve_model_path"]
