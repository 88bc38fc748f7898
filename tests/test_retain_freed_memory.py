"""`_C.retain_freed_memory` and the engine's use of it: after an engine is made, a large freed
allocation stays in malloc's free lists for the next step instead of going back to the OS (glibc's
own `mallinfo2` says which), and `WALLBREAKER_RETAIN_FREED_MEMORY=0` leaves malloc as it was. Each
case runs in a fresh process, since the setting is the process's."""
import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc",
                                reason="glibc's malloc only")

CHILD = r"""
import ctypes, json, sys, torch

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
how = sys.argv[1]
if how == "engine":
    from wallbreaker import LLM
    LLM("smollm2", max_model_len=256)
elif how == "call":
    from wallbreaker import _C
    print(json.dumps({"returned": _C.retain_freed_memory(1 << 30)}))
x = torch.ones(64 << 18)  # 64 MiB: past glibc's largest default mmap threshold (32 MiB)
del x
info = libc.mallinfo2()
print(json.dumps({"free_in_heap": info.fordblks, "mapped": info.hblkhd}))
"""

SIZE = 64 << 20


def freed(how: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, how], capture_output=True, text=True, check=True,
                         env={**os.environ, **env}, timeout=300)
    got: dict = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            got.update(json.loads(line))
    return got


def test_without_it_a_large_block_goes_back_to_the_os():
    assert freed("none")["free_in_heap"] < SIZE


def test_the_call_keeps_a_freed_large_block():
    got = freed("call")
    assert got["returned"] is True
    assert got["free_in_heap"] >= SIZE


def test_an_engine_keeps_freed_step_memory():
    assert freed("engine")["free_in_heap"] >= SIZE


def test_the_switch_leaves_malloc_alone():
    assert freed("engine", WALLBREAKER_RETAIN_FREED_MEMORY="0")["free_in_heap"] < SIZE


def test_a_size_past_mallopt_is_refused():
    from wallbreaker import _C
    with pytest.raises(RuntimeError, match="retain_freed_memory"):
        _C.retain_freed_memory(1 << 31)
