"""Issue 49's proposed prefill tile, measured before it is built: the prototype in
interleaved_q8_0.cpp (Q8_0 weights interleaved by block, 16 rows a group at AVX-512 VNNI, 8 at AVX2)
beside the engine's integer tiles (`_C.qmatmul` at the same level) on the same shapes and threads,
A/B/A (ours, the prototype, ours). Both count 2 M N K operations a call over Q8_0 weights and
activations quantized to Q8_0; the prototype checks its own result against a float64 reference.

    .venv/bin/python benchmarks/prototypes/interleaved_gemm.py

Writes benchmarks/results/interleaved_gemm_prototype.json, one entry per host.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gguf
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
from kernels import carve, set_scales  # noqa: E402

from wallbreaker import _C, kernels  # noqa: E402
from wallbreaker.formats.dequant import block_info  # noqa: E402
from wallbreaker.measure.machine import machine_facts, timed  # noqa: E402
from wallbreaker.measure.reporting import markdown_table, write_json  # noqa: E402

RESULTS = HERE.parent / "results"
SHAPES = ((1536, 1536), (8960, 1536), (1536, 8960))  # out x in
ROWS, THREADS = 512, 2
VARIANT = {16: "8x2", 8: "4x2"}  # activation rows x groups a tile, the best of a few on a Xeon with AMX


def build(rows: int, out: Path) -> Path:
    exe = out / f"interleaved_{rows}"
    subprocess.run(["g++", "-O3", "-fopenmp", f"-DROWS={rows}", str(HERE / "interleaved_q8_0.cpp"), "-o", str(exe)],
                   check=True)
    return exe


def ours(level: str, n: int, k: int) -> float:
    """GOP/s of the engine's tiles at `level` over a Q8_0 [n, k] weight and ROWS activation rows."""
    kernels.set_isa(level)
    block, size = block_info(gguf.GGMLQuantizationType.Q8_0)
    pool = torch.randint(0, 256, (n * k // block * size,), dtype=torch.uint8)
    set_scales(pool, "Q8_0", k)
    w = carve(pool, n, k // block * size)[0]
    x = torch.randn(ROWS, k)
    q = int(gguf.GGMLQuantizationType.Q8_0)
    return 2.0 * ROWS * n * k / statistics.median(timed(lambda: _C.qmatmul(x, [w], [q]), 7)) / 1e9


def prototype(exe: Path, rows: int, n: int, k: int) -> dict:
    out = subprocess.run([str(exe), str(ROWS), str(n), str(k), str(THREADS), VARIANT[rows]], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    torch.set_num_threads(THREADS)
    levels = [lv for lv, rows in (("avx512", 16), ("avx2", 8)) if lv in kernels.LEVELS
              and kernels.LEVELS.index(lv) <= kernels.LEVELS.index(kernels.cpu_isa())]
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for level in levels:
            rows = 16 if level == "avx512" else 8
            exe = build(rows, Path(tmp))
            for n, k in SHAPES:
                a1 = ours(level, n, k)
                p = prototype(exe, rows, n, k)
                a2 = ours(level, n, k)
                table.append({"level": level, "shape": [n, k], "rows": ROWS, "threads": THREADS,
                              "ours_gops": [a1, a2], "prototype_gops": p["gops"], "prototype_variant": p["variant"],
                              "prototype_max_rel_err": p["max_rel_err"],
                              "speedup": p["gops"] / statistics.mean([a1, a2])})
    kernels.set_isa("")
    facts = machine_facts(THREADS)
    path = RESULTS / "interleaved_gemm_prototype.json"
    data = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    data["runs"][facts["cpu_id"].split(" L1d")[0]] = {"machine": facts, "rows": table,
                                                       "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    write_json(path, data)
    print(markdown_table(["level", "shape", "ours GOP/s (A, A')", "prototype GOP/s", "speedup", "max rel err"],
                         [[r["level"], f"{r['shape'][0]}x{r['shape'][1]}",
                           f"{r['ours_gops'][0]:.0f}, {r['ours_gops'][1]:.0f}", r["prototype_gops"], r["speedup"],
                           f"{r['prototype_max_rel_err']:.1e}"] for r in table], digits=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
