"""The torch-free kernel harness (tests/kernel_harness): csrc's matmul kernels built into a binary
of their own and checked against the portable level and gguf's dequantization, for every format,
tile shape and tuning knob. Natively here (x86: the avx2 and avx512 levels within the bound of
test_kernels.py, stable across knobs), and for aarch64 under qemu-aarch64-static where the cross
compiler and qemu are installed (the arm level bit for bit the portable one's, with and without
its i8mm tiles, and the fallback where the CPU lacks dotprod; `make test-arm` installs them)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "tests" / "kernel_harness" / "run.sh"


def run_harness(mode: str, build: Path) -> str:
    env = {**os.environ, "PYTHON": sys.executable, "BUILD": str(build)}
    out = subprocess.run(["bash", str(RUN), mode], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out.stdout


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="needs a C++ compiler (g++)")
def test_every_level_here_matches_the_portable_level_and_gguf(tmp_path):
    out = run_harness("native", tmp_path)
    assert "passed:" in out and "FAIL" not in out
    assert out.count("within the bound of gguf's dequantization") >= 10  # the generic level, every format


@pytest.mark.slow
def test_the_arm_level_is_the_portable_levels_bits_under_qemu(tmp_path):
    if not (shutil.which("aarch64-linux-gnu-g++") and shutil.which("qemu-aarch64-static")):
        pytest.skip("needs g++-aarch64-linux-gnu and qemu-user-static: `make test-arm` installs them (as root)")
    out = run_harness("arm", tmp_path)
    gcc_runs, clang_run = out.split("== clang build") if "== clang build" in out else (out, "")
    with_i8mm, dotprod_only, neither = gcc_runs.split("== qemu-aarch64-static -cpu ")[1:]
    for run in (with_i8mm, dotprod_only):  # the i8mm tiles of several rows, then the dotprod ones alone
        assert "levels on this CPU: generic arm" in run
        assert run.count("bit for bit the generic level's") == 10  # every format of the table
    assert "i8mm 1" in with_i8mm and "dotprod 1, i8mm 0" in dotprod_only
    assert "identical:" in neither  # the portable level's bytes: the x86-64 build's = the aarch64 build's
    assert "levels on this CPU: generic " in neither and " arm " not in neither.split("\n")[1]
    assert out.count("passed:") == 3 + bool(clang_run) and "FAIL" not in out
    if clang_run:  # clang's pragmas (what Apple's clang takes), with dotprod and i8mm
        assert clang_run.count("bit for bit the generic level's") == 10
