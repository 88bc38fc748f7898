"""The knobs the tuner chooses among (kernels/tuning.py, `_C.tuning_knobs()`): each format's matmul
at several activation rows with each value of one knob (`--knob`: `rows`, the weight rows a tile
in calls of several rows; `rows_m1` / `rows_m1_long`, the same at batch 1 for rows of at most 4096
values and longer ones; `prefetch`), the values interleaved in every round (A/B/C, then again),
medians, weights never cache-resident (a pool of matrices). At the kernel level in use:
`WALLBREAKER_CPU_ISA=avx2` for the other one.

    .venv/bin/python benchmarks/kernel_knobs.py --formats Q4_1,Q4_K --rows 4,16
    .venv/bin/python benchmarks/kernel_knobs.py --knob rows_m1 --rows 1
    WALLBREAKER_CPU_ISA=avx2 .venv/bin/python benchmarks/kernel_knobs.py --formats Q4_1 --rows 16
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from wallbreaker import _C, kernels
from wallbreaker.kernels.blocks import random_blocks
from wallbreaker.measure.machine import describe_machine, machine_facts
from wallbreaker.measure.reporting import bar_plot, markdown_table, write_json

RESULTS = Path(__file__).parent / "results"
SHAPES = [(3072, 576), (576, 1536), (1536, 1536), (16384, 3072), (1536, 8960)]  # out x in: SmolLM2's, Qwen's, 3B's gate/up


def measure(qtype, knob: str, n: int, k: int, m: int, rounds: int, calls: int, pool_mb: float) -> dict[int, float]:
    """Median µs a call for each value of the knob."""
    rng = np.random.default_rng(0)
    raw = random_blocks(qtype, n, k, rng)
    count = max(2, int(pool_mb * 1e6 // raw.nbytes))
    pool = [kernels.pack_rows(torch.from_numpy(random_blocks(qtype, n, k, rng)), qtype) for _ in range(count)]
    x = torch.randn(m, k)
    times: dict[int, list[float]] = {c: [] for c in _C.tuning_choices(knob)}
    try:
        for _ in range(rounds):
            for c in times:
                _C.set_tuning(int(qtype), knob, c)
                _C.qmatmul(x, [pool[0]], [int(qtype)])
                start = time.perf_counter()
                for i in range(calls):
                    _C.qmatmul(x, [pool[i % count]], [int(qtype)])
                times[c].append((time.perf_counter() - start) / calls * 1e6)
    finally:
        _C.set_tuning(int(qtype), knob, 0)
    return {c: statistics.median(t) for c, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default="Q4_0,Q4_1,Q5_0,Q8_0,Q4_K,Q6_K")
    p.add_argument("--knob", default="rows", choices=_C.tuning_knobs())
    p.add_argument("--rows", default="4,16", help="activation rows a call, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=32)
    p.add_argument("--pool-mb", type=float, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    facts = machine_facts(args.threads)
    rows, table, plot = [], [], {}
    for name in args.formats.split(","):
        qtype = gguf.GGMLQuantizationType[name]
        default = _C.tuning(int(qtype), args.knob)
        if not default:
            print(f"{name}: the {_C.isa()} level has no tiles for it")
            continue
        for n, k in SHAPES:
            batch1_class = {"rows_m1": k <= 4096, "rows_m1_long": k > 4096}.get(args.knob, True)
            if k % gguf.GGML_QUANT_SIZES[qtype][0] or not batch1_class:  # the shapes the knob serves
                continue
            for m in (int(r) for r in args.rows.split(",")):
                us = measure(qtype, args.knob, n, k, m, args.rounds, args.calls, args.pool_mb)
                rows.append({"format": name, "n": n, "k": k, "rows": m, "knob": args.knob, "us": us,
                             "default": default})
                table.append([name, f"{n}x{k}", m, *us.values(), default])
                plot[f"{name} {n}x{k} @{m}"] = {f"{args.knob} {c}": t for c, t in us.items()}
                print(table[-1], flush=True)
    level = _C.isa()
    path = write_json(args.json or RESULTS / f"kernel_knobs_{args.knob}_{level}.json",
                      {"machine": facts, "results": rows})
    bar_plot(plot, path.with_suffix(".png"), f"µs a call by {args.knob} ({level})")
    print(describe_machine(facts))
    print(markdown_table(["format", "shape", "rows", *(f"{args.knob} {c} µs" for c in _C.tuning_choices(args.knob)),
                          "default"],
                         table, 1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
