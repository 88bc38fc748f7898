"""llama.cpp's `convert_hf_to_gguf.py` (with its vendored `gguf-py`) and its `libggml-base` (the
`dequantize_row_*` references of tests/test_dequant.py), from the `llama-cpp-python` sdist on PyPI:
fetched (and built) once into wallbreaker's cache folder by `make llamacpp`, or a skip naming it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

VERSION = "0.3.36"
FETCH_COMMAND = f"pip download --no-deps --no-binary :all: llama-cpp-python=={VERSION}"
_PREFIX = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
_WANTED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
_LORA = "convert_lora_to_gguf.py"  # extracted on its own: an older extraction lacks it


def _sdist(cache: Path) -> Path:
    sdist = cache / "sdist" / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.is_file():
        subprocess.run([sys.executable, "-m", *FETCH_COMMAND.split(), "-d", str(sdist.parent)], check=True,
                       capture_output=True, timeout=600)
    return sdist


def _extract(sdist: Path, wanted: tuple[str, ...], target: Path) -> None:
    """The sdist's `vendor/llama.cpp/<wanted>` entries into `target`, whole or not at all."""
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers() if m.name.startswith(_PREFIX)
                   and m.name[len(_PREFIX):].startswith(wanted) and (m.isfile() or m.isdir())]
        for m in members:
            m.name = m.name[len(_PREFIX):]
        tf.extractall(staging, members=members, filter="data")
    staging.rename(target)


def fetch(cache: Path) -> Path:
    """The folder holding convert_hf_to_gguf.py, conversion/, gguf-py/ and convert_lora_to_gguf.py,
    fetched and unpacked into `cache` once; a failure raises."""
    target = cache / f"llama-cpp-converter-{VERSION}"
    if not (target / "convert_hf_to_gguf.py").is_file():
        _extract(_sdist(cache), _WANTED, target)
    if not (target / _LORA).is_file():
        lora = cache / f"llama-cpp-lora-converter-{VERSION}"
        if not (lora / _LORA).is_file():
            _extract(_sdist(cache), (_LORA,), lora)
        shutil.copyfile(lora / _LORA, target / _LORA)
    return target


def ggml_lib_dir(cache: Path) -> Path:
    """Where `build_ggml_base` puts libggml-base.so."""
    return cache / f"llama-cpp-ggml-{VERSION}" / "build" / "src"


def build_ggml_base(cache: Path) -> Path:
    """libggml-base.so built from the sdist's ggml/ (cmake and a C/C++ compiler; about 20 s on 2 cores)
    into `cache` once; its folder. A failure raises."""
    lib = ggml_lib_dir(cache)
    if (lib / "libggml-base.so").is_file():
        return lib
    root = lib.parent.parent
    if not (root / "ggml" / "CMakeLists.txt").is_file():
        shutil.rmtree(root, ignore_errors=True)
        _extract(_sdist(cache), ("ggml/",), root)
        (root / "ggml" / "ggml.pc.in").touch()  # left out of the sdist; only an install reads it
    build = root / "build"
    subprocess.run(["cmake", "-S", str(root / "ggml"), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=OFF", "-DBUILD_SHARED_LIBS=ON", "-DGGML_BUILD_EXAMPLES=OFF",
                    "-DGGML_BUILD_TESTS=OFF"], check=True, capture_output=True, timeout=600)
    subprocess.run(["cmake", "--build", str(build), "--target", "ggml-base", "-j", str(os.cpu_count() or 1)],
                   check=True, capture_output=True, timeout=1200)
    return lib


def converter_dir(cache: Path) -> Path:
    """`fetch`'s folder, or a skip naming the command (no network, no PyPI), checked to import its gguf-py."""
    try:
        target = fetch(cache)
    except (subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"llama.cpp's converter could not be fetched ({type(e).__name__}); fetch it with: "
                    f"make llamacpp, or {FETCH_COMMAND}")
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


def convert_lora(converter: Path, adapter: Path, base: Path, outtype: str, out: Path) -> Path:
    """A PEFT adapter folder of the Hugging Face model `base` -> llama.cpp's GGUF LoRA of `outtype`."""
    if not out.is_file():
        subprocess.run([sys.executable, str(converter / _LORA), str(adapter), "--base", str(base), "--outtype", outtype,
                        "--outfile", str(out)], check=True, capture_output=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(converter / "gguf-py")})
    return out


if __name__ == "__main__":  # `make llamacpp`: both, ahead of the tests, into wallbreaker's cache folder
    from wallbreaker.formats.packaged import cache_dir
    print(fetch(cache_dir()))
    try:
        print(build_ggml_base(cache_dir()))
    except (subprocess.SubprocessError, OSError) as e:  # no cmake here: test_dequant's 14 cases skip
        detail = getattr(e, "stderr", b"") or b""
        print(f"libggml-base not built ({type(e).__name__}: {detail.decode(errors='replace')[-300:]})", file=sys.stderr)
