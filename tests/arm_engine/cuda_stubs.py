"""Stand-ins for the CUDA libraries that PyPI's aarch64 torch wheel links against, so that its CPU
half loads under qemu without the ~3 GB of nvidia-* wheels.

PyPI has one torch wheel for aarch64 Linux, built with CUDA: libtorch_cpu.so itself needs
libcudart and libcupti, and libtorch_python.so and libtorch_cuda.so need cuDNN, NCCL, cuBLAS and
the rest. The dynamic loader binds every symbol at load (Python opens extensions with RTLD_NOW), so
each missing library is replaced by a small aarch64 library with its soname, its symbol versions
and every symbol the loaded libraries take from it. Each function returns the address of 64 KiB
of zeros: a usable handle where one is expected (libtorch_cuda's static constructors register their
kernels with __cudaRegisterFatBinary and keep its result), and, read as an error code, not 0
(cudaSuccess): torch then finds no GPU, as on a CPU-only machine. Past loading nothing here runs
unless torch calls into CUDA, which its CPU paths do not. WB_STUB_TRACE=1: each function also
writes its name to stderr.

    python cuda_stubs.py SITE SYSROOT OUT   # SITE: the site-packages holding the aarch64 torch
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

READELF = "aarch64-linux-gnu-readelf"
CC = "aarch64-linux-gnu-gcc"
ZEROS = 65536
TRACE = bool(os.environ.get("WB_STUB_TRACE"))


def _readelf(*args: str) -> str:
    return subprocess.run([READELF, "-W", *args], check=True, capture_output=True, text=True).stdout


def _needed(lib: Path) -> list[str]:
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", _readelf("-d", str(lib)))


def _symbols(lib: Path) -> tuple[list[tuple[str, str, str]], set[str]]:
    """(undefined non-weak (name, version, type)), defined names."""
    undefined, defined = [], set()
    for line in _readelf("--dyn-syms", str(lib)).splitlines():
        parts = line.split()
        if len(parts) < 8 or not parts[0].endswith(":"):
            continue
        kind, bind, ndx, name = parts[3], parts[4], parts[6], parts[7]
        base, _, version = name.partition("@")
        if ndx == "UND":
            if base and bind != "WEAK":
                undefined.append((base, version.lstrip("@"), kind))
        else:
            defined.add(base)
    return undefined, defined


def _version_files(lib: Path) -> dict[str, str]:
    """A needed version's name -> the soname that must define it."""
    owner, current = {}, None
    for line in _readelf("-V", str(lib)).splitlines():
        if m := re.search(r"File: (\S+)", line):
            current = m.group(1)
        elif current and (m := re.search(r"Name: (\S+)\s+Flags", line)):
            owner[m.group(1)] = current
    return owner


def main(site: Path, sysroot: Path, out: Path) -> None:
    torch = site / "torch"
    dirs = [torch / "lib", sysroot / "lib/aarch64-linux-gnu", sysroot / "usr/lib/aarch64-linux-gnu"]
    start = next(torch.glob("_C.cpython-*.so"))
    present: dict[str, Path] = {start.name: start}
    missing: set[str] = set()
    queue = [start]
    while queue:
        for soname in _needed(queue.pop()):
            if soname in present or soname in missing:
                continue
            found = next((d / soname for d in dirs if (d / soname).exists()), None)
            if found is None:
                missing.add(soname)
            else:
                present[soname] = found
                queue.append(found)
    defined: set[str] = set()
    wanted: dict[str, dict[str, tuple[str, str]]] = defaultdict(dict)  # soname -> name -> (version, type)
    loose: dict[str, str] = {}
    for lib in present.values():
        undefined, names = _symbols(lib)
        defined |= names
        owners = _version_files(lib)
        for name, version, kind in undefined:
            if version and owners.get(version) in missing:
                wanted[owners[version]][name] = (version, kind)
            elif not version:
                loose[name] = kind
    loose = {n: k for n, k in loose.items() if n not in defined}
    out.mkdir(parents=True, exist_ok=True)
    for soname in sorted(missing):
        symbols = dict(wanted[soname])
        for name, kind in loose.items():  # unversioned and defined nowhere: offered by every stand-in
            symbols.setdefault(name, ("", kind))
        _build(out, soname, symbols)
    print(f"{len(missing)} stand-ins in {out}: {' '.join(sorted(missing))}")


def _build(out: Path, soname: str, symbols: dict[str, tuple[str, str]]) -> None:
    asm = [".bss", ".balign 4096", "wb_stub_zeros:", f".zero {ZEROS}", ".text"]
    for name, (_, kind) in symbols.items():
        if kind == "OBJECT":
            asm += [".bss", ".balign 16", f'.globl "{name}"', f'.type "{name}", %object',
                    f'.size "{name}", 4096', f'"{name}":', ".zero 4096", ".text"]
        else:
            asm += [".balign 4", f'.globl "{name}"', f'.type "{name}", %function', f'"{name}":']
            if TRACE:  # each call says its name on stderr
                label = f".Ln{len(asm)}"
                asm += [f"adrp x1, {label}", f"add x1, x1, :lo12:{label}", f"mov x2, #{len(name) + 1}", "mov x0, #2",
                        "mov x8, #64", "svc #0", ".section .rodata", f'{label}: .ascii "{name}\\n"', ".text"]
            asm += ["adrp x0, wb_stub_zeros", "add x0, x0, :lo12:wb_stub_zeros", "ret"]
    versions: dict[str, list[str]] = defaultdict(list)
    for name, (version, _) in symbols.items():
        versions[version].append(name)
    (out / f"{soname}.s").write_text("\n".join(asm) + "\n")
    args = [CC, "-shared", "-nostdlib", f"-Wl,-soname,{soname}", str(out / f"{soname}.s"), "-o", str(out / soname)]
    named = [v for v in versions if v]
    if named:
        unversioned = versions.get("", [])
        nodes = []
        for i, version in enumerate(named):
            names = versions[version] + (unversioned if i == 0 else [])
            nodes.append(f"{version} {{ global: " + " ".join(f'"{n}";' for n in names) + " };")
        (out / f"{soname}.map").write_text("\n".join(nodes) + "\n")
        args.append(f"-Wl,--version-script,{out / f'{soname}.map'}")
    subprocess.run(args, check=True)


if __name__ == "__main__":
    main(*(Path(a) for a in sys.argv[1:4]))
