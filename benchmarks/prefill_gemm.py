"""The prefill GEMM against the machine's arithmetic peak (issue 49): each format's rate over a call
of --rows activation rows (a prompt chunk) as a share of the int8 dot-product peak measured in the
same run by a tight loop of the level's instruction (csrc/peak_probe.cpp: vpdpbusd at avx512,
maddubs+madd at avx2), on the same threads.

Each prompt path is timed where it runs: the row tiles (`qmatmul`, every level), the prompt tiles
(`qmatmul(..., prompt=True)`, where the level has them: the path prompt rows take on a CPU without
AMX) and, on a CPU with AMX, the dense path the prompt rows take there (`qmatmul_dense` in `PROMPT_ROWS`-row calls,
layers/linear.py), which is also put against the AMX-BF16 peak it runs on. Rates count 2 M N K
operations a call.

    .venv/bin/python benchmarks/prefill_gemm.py
    WALLBREAKER_CPU_ISA=avx2 .venv/bin/python benchmarks/prefill_gemm.py

Results merge into benchmarks/results/prefill_gemm.json, one entry per host and level.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import gguf
import torch

from wallbreaker import _C, kernels
from wallbreaker.formats.dequant import block_info
from wallbreaker.engine.model_runner import retain_freed_memory
from wallbreaker.kernels import tuning
from wallbreaker.layers.linear import PROMPT_ROWS
from wallbreaker.measure.machine import machine_facts, timed
from wallbreaker.measure.reporting import markdown_table, write_json

from kernels import carve, set_scales

T = gguf.GGMLQuantizationType
RESULTS = Path(__file__).parent / "results"
FORMATS = ("Q4_K", "Q6_K", "Q8_0", "Q4_0")
SHAPES = ((1536, 1536), (8960, 1536), (1536, 8960), (3072, 3072))  # out x in
PEAK_OF_LEVEL = {"avx512": "vnni512", "avx2": "avx2"}


def peaks(threads: int) -> dict[str, float]:
    """ops/s of each loop this CPU runs (0 where none), on `threads` threads at once."""
    return {kind: _C.peak_ops(kind, threads, 0.3, 5) for kind in ("vnni512", "avx2", "amx_int8", "amx_bf16")}


def weight(fmt: str, n: int, k: int) -> torch.Tensor:
    block, size = block_info(T[fmt])
    pool = torch.randint(0, 256, (n * k // block * size,), dtype=torch.uint8)
    set_scales(pool, fmt, k)
    return carve(pool, n, k // block * size)[0]


def rate(fn, ops: float, repeats: int) -> float:
    return ops / statistics.median(timed(fn, repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=RESULTS / "prefill_gemm.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tuning.apply()
    retained = retain_freed_memory()  # as an engine runs its steps (engine/model_runner.py)
    level = kernels.isa()
    peak = peaks(args.threads)
    int8_peak = peak.get(PEAK_OF_LEVEL.get(level, ""), 0.0)
    dense = kernels.dense_path()
    print(", ".join(f"{k} peak {v / 1e9:.0f} GOP/s" for k, v in peak.items() if v) + f" ({args.threads} threads)")
    rows = []
    for fmt in FORMATS:
        for n, k in SHAPES:
            w, q = weight(fmt, n, k), int(T[fmt])
            x = torch.randn(args.rows, k)
            ops = 2.0 * args.rows * n * k
            row = {"format": fmt, "shape": [n, k], "rows": args.rows,
                   "tiles_gops": rate(lambda: _C.qmatmul(x, [w], [q]), ops, args.repeats) / 1e9}
            row["tiles_share_int8_peak"] = row["tiles_gops"] * 1e9 / int8_peak if int8_peak else None
            row["prompt_gops"] = rate(lambda: _C.qmatmul(x, [w], [q], True), ops, args.repeats) / 1e9
            row["prompt_share_int8_peak"] = row["prompt_gops"] * 1e9 / int8_peak if int8_peak else None
            if dense:
                row["dense_gops"] = rate(lambda: kernels.qmatmul_dense(x, [w], [q], PROMPT_ROWS), ops, args.repeats) / 1e9
                row["dense_share_int8_peak"] = row["dense_gops"] * 1e9 / int8_peak if int8_peak else None
                row["dense_share_amx_bf16_peak"] = row["dense_gops"] * 1e9 / peak["amx_bf16"] if peak["amx_bf16"] else None
            rows.append(row)
    facts = machine_facts(args.threads)
    key = f"{facts['cpu_id'].split(' L1d')[0]} {level} t{args.threads}"
    data = json.loads(args.json.read_text()) if args.json.exists() else {"runs": {}}
    data["runs"][key] = {"machine": facts, "level": level, "threads": args.threads, "peaks_ops_per_s": peak,
                         "int8_peak": PEAK_OF_LEVEL.get(level), "dense_path": dense, "retained_freed_memory": retained, "rows": rows,
                         "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    write_json(args.json, data)
    head = ["format", "shape", "row tiles GOP/s", "share of int8 peak", "prompt tiles GOP/s", "share"]
    if dense:
        head += ["dense GOP/s", "share of int8 peak", "share of AMX-BF16 peak"]
    print(markdown_table(head, [[r["format"], f"{r['shape'][0]}x{r['shape'][1]}", r["tiles_gops"],
                                 r["tiles_share_int8_peak"], r["prompt_gops"], r["prompt_share_int8_peak"]] +
                                ([r["dense_gops"], r["dense_share_int8_peak"], r["dense_share_amx_bf16_peak"]]
                                 if dense else []) for r in rows], digits=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
