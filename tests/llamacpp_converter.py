"""llama.cpp's `convert_hf_to_gguf.py` (with its vendored `gguf-py`), from the `llama-cpp-python`
sdist on PyPI: fetched once into wallbreaker's cache folder, or a skip naming the command."""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

VERSION = "0.3.36"
FETCH_COMMAND = f"pip download --no-deps --no-binary :all: llama-cpp-python=={VERSION}"
_PREFIX = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
_WANTED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def fetch(cache: Path) -> Path:
    """The folder holding convert_hf_to_gguf.py, conversion/ and gguf-py/, fetched and unpacked into
    `cache` once (`make converter` runs this ahead of the tests); a failure raises."""
    target = cache / f"llama-cpp-converter-{VERSION}"
    if not (target / "convert_hf_to_gguf.py").is_file():
        sdist = cache / "sdist" / f"llama_cpp_python-{VERSION}.tar.gz"
        if not sdist.is_file():
            subprocess.run([sys.executable, "-m", *FETCH_COMMAND.split(), "-d", str(sdist.parent)], check=True,
                           capture_output=True, timeout=600)
        staging = target.with_name(target.name + ".partial")
        with tarfile.open(sdist) as tf:
            members = [m for m in tf.getmembers() if m.name.startswith(_PREFIX)
                       and m.name[len(_PREFIX):].startswith(_WANTED) and (m.isfile() or m.isdir())]
            for m in members:
                m.name = m.name[len(_PREFIX):]
            tf.extractall(staging, members=members, filter="data")
        staging.rename(target)
    return target


def converter_dir(cache: Path) -> Path:
    """`fetch`'s folder, or a skip naming the command (no network, no PyPI), checked to import its gguf-py."""
    try:
        target = fetch(cache)
    except (subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"llama.cpp's converter could not be fetched ({type(e).__name__}); fetch it with: "
                    f"make converter, or {FETCH_COMMAND}")
    found = subprocess.run([sys.executable, "-c", "import gguf; print(gguf.__file__)"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(target / "gguf-py")})
    if found.returncode or not found.stdout.strip().startswith(str(target / "gguf-py")):
        pytest.skip(f"the converter's vendored gguf-py does not import ({found.stderr.strip()[-200:]})")
    return target


def convert(converter: Path, folder: Path, outtype: str, out: Path, flags: tuple[str, ...] = ()) -> Path:
    """`folder` (a Hugging Face model) -> a GGUF of `outtype` (f32, q8_0, ...) at `out`. `flags`: more
    of the converter's options (Qwen3-Next without its MTP layers needs `--no-mtp`)."""
    if not out.is_file():
        subprocess.run([sys.executable, str(converter / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype,
                        "--outfile", str(out), *flags], check=True, capture_output=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(converter / "gguf-py")})
    return out


if __name__ == "__main__":  # `make converter`: fetch it ahead, into wallbreaker's cache folder
    from wallbreaker.formats.packaged import cache_dir
    print(fetch(cache_dir()))
