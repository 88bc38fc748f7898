"""Where a router's models come from (`--models-dir DIR`, `--model NAME=PATH`, the packaged models
by name), and how long one stays loaded once idle (`keep_alive`, in Ollama's durations)."""
from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import WallbreakerError
from ..formats.packaged import PACKAGED_MODELS, _package_dir, cache_dir
from ..formats.packaged_folders import PACKAGED_FOLDERS
from .ollama_models import remember_digest

DEFAULT_KEEP_ALIVE_S = 300.0  # Ollama's
FOREVER = math.inf


# -- keep_alive: Ollama's durations --------------------------------------------------------------
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def parse_keep_alive(value: Any) -> float:
    """Seconds a model stays loaded once idle: a number of seconds, or a Go duration ("5m", "1h30m",
    "300ms", "0"); negative: forever (`FOREVER`). Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"keep_alive must be a duration or a number of seconds, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)  # "300": seconds, as Ollama reads a bare number
        except ValueError:
            parts = _PART.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"keep_alive {value!r} is not a duration (e.g. \"5m\", \"30s\", \"1h\", 0, -1)")
            seconds = sign * sum(float(n) * _UNITS[u] for n, u in parts)
    if math.isnan(seconds):
        raise ValueError("keep_alive is not a number")
    return FOREVER if seconds < 0 else seconds


# -- where models come from ----------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSource:
    """A model the router may load: its name in requests, and what `LLM(model)` takes to load it
    (a path, or a packaged model's name)."""
    name: str
    model: str

    def files(self) -> list[Path]:
        """Its files on disk, without assembling or unpacking a packaged model: for sizes and listings."""
        if self.model in PACKAGED_MODELS:
            packaged = PACKAGED_MODELS[self.model]
            assembled = cache_dir() / packaged.filename
            if len(packaged.chunks) > 1 and assembled.is_file():
                return [assembled]
            return [p for p in (_chunk_path(package, rel) for package, rel in packaged.chunks) if p is not None]
        if self.model in PACKAGED_FOLDERS:
            folder = cache_dir() / PACKAGED_FOLDERS[self.model].folder
            if folder.is_dir():
                return _files(folder)
            base = _package_dir(PACKAGED_FOLDERS[self.model].package)
            return [base / PACKAGED_FOLDERS[self.model].zip_name] if base is not None else []
        return _files(Path(self.model))

    def disk_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files() if f.is_file())

    def remember_digest(self) -> None:
        """A packaged model's SHA-256, as its package states it, for the listings (no need to hash the file)."""
        packaged = PACKAGED_MODELS.get(self.model)
        if packaged is not None:
            single = [_chunk_path(*packaged.chunks[0])] if len(packaged.chunks) == 1 else []
            for path in [cache_dir() / packaged.filename, *(p for p in single if p is not None)]:
                remember_digest(path, packaged.sha256)


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def _chunk_path(package: str, rel: str) -> Path | None:
    base = _package_dir(package)
    return base / rel if base is not None and (base / rel).is_file() else None


def packaged_installed(alias: str) -> bool:
    """Whether a packaged model can be loaded, found without assembling or unpacking it."""
    if alias in PACKAGED_MODELS:
        packaged = PACKAGED_MODELS[alias]
        return (cache_dir() / packaged.filename).is_file() or all(
            _chunk_path(package, rel) is not None for package, rel in packaged.chunks)
    folder = PACKAGED_FOLDERS[alias]
    return (cache_dir() / folder.folder / "config.json").is_file() or _chunk_path(folder.package, folder.zip_name) is not None


def source_name(model: str) -> str:
    """A model's default name: a packaged model's own, a file's stem, a folder's name."""
    if model in PACKAGED_MODELS or model in PACKAGED_FOLDERS:
        return model
    path = Path(model).expanduser()
    return path.name if path.is_dir() else path.stem


def parse_model_flag(value: str) -> ModelSource:
    """`--model NAME=PATH`, or `--model PATH` named by `source_name`."""
    name, sep, model = value.partition("=")
    if sep and name and model and "/" not in name and os.sep not in name and not Path(value).exists():
        return ModelSource(name, model)
    return ModelSource(source_name(value), value)


def scan_models_dir(directory: str | os.PathLike) -> list[ModelSource]:
    """A folder's models: each `*.gguf` file (named by its stem) and each Hugging Face folder (one
    with a config.json, named by the folder), in name order."""
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise WallbreakerError(f"--models-dir {root}: no such folder")
    out = []
    for p in sorted(root.iterdir()):
        if p.is_file() and p.suffix == ".gguf":
            out.append(ModelSource(p.stem, str(p)))
        elif p.is_dir() and (p / "config.json").is_file():
            out.append(ModelSource(p.name, str(p)))
    return out


def packaged_sources() -> list[ModelSource]:
    """The packaged models that are installed, by their names (`LLM("qwen2.5-coder-0.5b")`'s)."""
    return [ModelSource(alias, alias) for alias in (*PACKAGED_MODELS, *PACKAGED_FOLDERS) if packaged_installed(alias)]


def catalog(models: Iterable[str] = (), models_dir: str | None = None) -> list[ModelSource]:
    """The sources of `serve --model ... --models-dir DIR`: the `--model`s first, then the folder's
    models, then the packaged ones; a name given twice keeps its first source."""
    sources = [parse_model_flag(m) for m in models]
    for s in sources:
        if s.model not in PACKAGED_MODELS and s.model not in PACKAGED_FOLDERS and not Path(s.model).expanduser().exists():
            raise WallbreakerError(f"--model {s.name}={s.model}: no such file or folder, nor a packaged model's name")
    if models_dir is not None:
        sources += scan_models_dir(models_dir) + packaged_sources()
    seen: dict[str, ModelSource] = {}
    for s in sources:
        seen.setdefault(s.name, s)
    return list(seen.values())
