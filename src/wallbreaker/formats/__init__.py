"""Model files in: GGUF through the `gguf` package, Hugging Face folders through `safetensors`."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import ModelFormatError, ModelNotFoundError, WallbreakerError
from .packaged import DEFAULT_MODEL, PACKAGED_MODELS, packaged_model_path
from .packaged_folders import PACKAGED_FOLDERS, packaged_folder_path
from .weights import ModelFiles, WeightRef


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """None -> the embedded default; a packaged alias (e.g. "gemma3-270m") -> its file; else a path."""
    if model is None:
        return packaged_model_path(DEFAULT_MODEL)
    if str(model) in PACKAGED_MODELS:
        return packaged_model_path(str(model))
    if str(model) in PACKAGED_FOLDERS:
        return packaged_folder_path(str(model))
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"{path}: no such file or folder")
    return path


def open_model(model: str | os.PathLike | None) -> ModelFiles:
    """The model's files, or a typed error: the loaders refuse bad files with a one-line
    ModelFormatError or UnsupportedModelError naming the file and the key; any other exception
    that escapes one of them (a case nobody thought of) becomes a ModelFormatError here, chained."""
    path = resolve_model_path(model)
    try:
        if path.is_dir():
            from . import hf_model
            return hf_model.read_hf_folder(path)
        from . import gguf_model
        return gguf_model.read_gguf_model(path)
    except WallbreakerError:
        raise
    except Exception as e:
        detail = " ".join(str(e).split())
        detail = detail if len(detail) <= 300 else detail[:300] + "..."
        raise ModelFormatError(f"{path}: cannot read this model ({UNEXPECTED}): {type(e).__name__}: {detail}") from e


# The safety net's mark in its messages: a test that sees it has found a case the loaders miss.
UNEXPECTED = "unexpected error"


__all__ = ["ModelFiles", "WeightRef", "open_model", "resolve_model_path"]
