"""csrc/peak_probe.cpp: the arithmetic peaks benchmarks/prefill_gemm.py judges the prefill GEMM by.

A loop runs exactly where the CPU has its instruction (0 elsewhere, never a crash on an illegal
instruction), and its rate is one a core can make: at most four of its instructions a cycle at
6 GHz (no core issues more), and two threads make more than one alone."""
from __future__ import annotations

import platform

import pytest

from wallbreaker import _C

X86 = platform.machine().lower() in ("x86_64", "amd64")
PRODUCTS_PER_INSTRUCTION = {"vnni512": 64, "avx2": 32, "amx_int8": 16 * 16 * 64, "amx_bf16": 16 * 16 * 32}


def cpu_flags() -> set[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


HAS = {"vnni512": {"avx512_vnni", "avx512bw"}, "avx2": {"avx2"}, "amx_int8": {"amx_int8", "amx_tile"},
       "amx_bf16": {"amx_bf16", "amx_tile"}}


@pytest.mark.parametrize("kind", sorted(HAS))
def test_a_loop_runs_where_the_cpu_has_its_instruction(kind):
    rate = _C.peak_ops(kind, 1, 0.02, 1)
    flags = cpu_flags()
    if not X86 or not flags:
        assert rate == 0.0 or rate > 0
        return
    if HAS[kind] <= flags:
        if kind.startswith("amx") and rate == 0.0:
            pytest.skip("the kernel did not grant AMX's tile state")
        assert 1e9 < rate < 2 * PRODUCTS_PER_INSTRUCTION[kind] * 4 * 6e9
    else:
        assert rate == 0.0


def test_an_unknown_loop_is_zero():
    assert _C.peak_ops("vnni1024", 1, 0.01, 1) == 0.0


@pytest.mark.skipif(not X86 or "avx2" not in cpu_flags(), reason="needs AVX2")
def test_two_threads_make_more_than_one():
    one = _C.peak_ops("avx2", 1, 0.05, 3)
    two = _C.peak_ops("avx2", 2, 0.05, 3)
    assert two > 0.8 * one
