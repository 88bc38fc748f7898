"""Quantized matmul kernels: GB/s of weight bytes read, per format, shape and batch rows, at each
kernel level, against the machine's read bandwidth measured in the same run and against PyTorch's
int4/int8 weight-only kernels (the kernels the `auto` path used before ours).

    .venv/bin/python benchmarks/kernels.py                                   # this CPU's best level
    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/kernels.py          # the avx2 level (and ATen's)

The kernels run with the host's tuning (kernels/tuning.py: measured and stored at the first call
where none is stored; `WALLBREAKER_KERNEL_TUNING=0` for each level's defaults). Weights are never
cache-resident: each timing rotates over distinct matrices carved from a pool of
--pool-mb (default 512) MB, far beyond the last-level cache. Each figure is the median of --repeats
passes over the pool (the best pass is kept too: on a shared machine a pass can lose a thread to
another process for a whole scheduler tick). Results merge into benchmarks/results/kernels.json
(keyed by level) and the plot benchmarks/results/kernels.png is redrawn from all levels measured so
far.

    .venv/bin/python benchmarks/kernels.py --cache --threads 1 --no-torch    # compute rate

--cache times one matrix repeated instead (it stays in L2/L3): the kernels' compute rate, the
figure to tune by, robust to noise as the best of --repeats runs; it goes to kernels_cache.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import gguf
import torch

from wallbreaker import kernels
from wallbreaker.kernels import tuning
from wallbreaker.formats.dequant import block_info
from wallbreaker.measure.machine import measure_bandwidth, timed

T = gguf.GGMLQuantizationType
FORMATS = [t.name for t in sorted(kernels.SUPPORTED_TYPES)]  # the kernels' format table
SHAPES = [(576, 1536), (1536, 1536), (8960, 1536), (1536, 8960), (49152, 576)]  # out x in
ROWS = [1, 4, 16]
K_F16 = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
HALF = torch.tensor([0x00, 0x20], dtype=torch.uint8)  # float16 2^-7: a sane, normal scale
RESULTS = Path(__file__).parent / "results"


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def median_and_best(fn, repeats: int) -> tuple[float, float]:
    """(median, best) seconds of fn over `repeats` runs after one warm-up."""
    times = timed(fn, repeats)
    return statistics.median(times), min(times)


def carve(pool: torch.Tensor, n: int, row_bytes: int) -> list[torch.Tensor]:
    size = n * row_bytes
    return [pool[i * size:(i + 1) * size].view(n, row_bytes) for i in range(max(1, pool.numel() // size))]


def set_scales(pool: torch.Tensor, fmt: str, k: int) -> None:
    """Valid float16 scale fields everywhere in the pool for `fmt`'s layout (codes stay random)."""
    qtype = T[fmt]
    block, size = block_info(qtype)
    if fmt in K_F16:
        blocks = pool[: pool.numel() // size * size].view(-1, size)
        for off in K_F16[fmt]:
            blocks[:, off:off + 2] = HALF
    else:  # kernels' row layout: the float16 fields of a row come first
        row_bytes = k // block * size
        rows = pool[: pool.numel() // row_bytes * row_bytes].view(-1, row_bytes)
        sb = (4 if fmt in ("Q4_1", "Q5_1") else 2) * (k // block)
        rows[:, :sb] = HALF.repeat(sb // 2)


def bench_ours(pool, fmt, level, repeats, rows, cache=False):
    kernels.set_isa(level)
    tuning.apply()  # the host's stored choices, as a model load sets them (WALLBREAKER_KERNEL_TUNING=0: defaults)
    qtype = T[fmt]
    block, size = block_info(qtype)
    out = []
    for n, k in SHAPES:
        if k % block:
            continue
        set_scales(pool, fmt, k)
        mats = carve(pool, n, k // block * size)
        nbytes = n * k // block * size
        for m in rows:
            x = torch.randn(m, k)
            if cache:  # one matrix, calls enough for ~4 MB of weights (or one call) a timing
                mats = mats[:1] * max(1, (4 << 20) // (nbytes * m))

            def run():
                for w in mats:
                    kernels.qmatmul(x, [w], [qtype])

            t, best = (v / len(mats) for v in median_and_best(run, repeats))
            out.append({"format": fmt, "shape": [n, k], "rows": m, "us": t * 1e6, "gbps": nbytes / t / 1e9,
                        "best_gbps": nbytes / best / 1e9, "matrices": len(mats)})
    return out


def bench_torch(pool, repeats, rows):
    out = []
    for n, k in SHAPES:
        for kind in ("int4", "int8"):
            if kind == "int4":
                mats = carve(pool, n, k // 2)
                sz = torch.rand(k // 32, n, 2).to(torch.bfloat16)
                nbytes = n * k // 2 + sz.numel() * 2
                call = lambda x, w: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, 32, sz)  # noqa: E731
            else:
                mats = [w.view(torch.int8) for w in carve(pool, n, k)]
                scale = torch.rand(n).to(torch.bfloat16)
                nbytes = n * k + n * 2
                call = lambda x, w: torch.ops.aten._weight_int8pack_mm(x, w, scale)  # noqa: E731
            for m in rows:
                x = torch.randn(m, k).to(torch.bfloat16)

                def run():
                    for w in mats:
                        call(x, w)

                t, best = (v / len(mats) for v in median_and_best(run, repeats))
                out.append({"format": f"torch-{kind}", "shape": [n, k], "rows": m, "us": t * 1e6,
                            "gbps": nbytes / t / 1e9, "best_gbps": nbytes / best / 1e9, "matrices": len(mats)})
    return out


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    levels = [lv for lv in ("avx512", "avx2", "generic") if lv in data["levels"]]
    fig, axes = plt.subplots(1, len(levels), figsize=(7 * len(levels), 5), squeeze=False)
    for ax, lv in zip(axes[0], levels):
        run = data["levels"][lv]
        rows = [r for r in run["ours"] + run["torch"] if r["rows"] == 1]
        fmts = list(dict.fromkeys(r["format"] for r in rows))
        shapes = [s for s in SHAPES]
        width = 0.8 / len(shapes)
        for i, s in enumerate(shapes):
            vals = [next((r["gbps"] for r in rows if r["format"] == f and tuple(r["shape"]) == s), 0) for f in fmts]
            ax.bar([j + i * width for j in range(len(fmts))], vals, width, label=f"{s[0]}x{s[1]}")
        bw = run["bandwidth_gbps"]
        ax.axhline(bw, color="k", lw=1)
        ax.axhline(0.7 * bw, color="k", lw=1, ls="--")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(fmts))], fmts, rotation=45)
        ax.set_ylabel("GB/s of weight bytes, batch 1")
        ax.set_title(f"{lv}: read bandwidth {bw:.1f} GB/s (line), 70% (dashed)\n{data['cpu']}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default=None, help="comma-separated kernel levels (default: the level in use)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pool-mb", type=int, default=512)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="activation rows (batch), comma-separated")
    ap.add_argument("--cache", action="store_true", help="one matrix repeated (cache-resident): the compute rate")
    ap.add_argument("--no-torch", action="store_true", help="skip PyTorch's int4/int8 baseline")
    ap.add_argument("--json", type=Path, default=None, help="default: results/kernels.json (kernels_cache.json with --cache)")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.json is None:
        args.json = RESULTS / ("kernels_cache.json" if args.cache else "kernels.json")
    torch.set_num_threads(args.threads)
    levels = args.levels.split(",") if args.levels else [kernels.isa()]
    bw = measure_bandwidth(512, 7)["read"]
    print(f"{cpu_model()}; torch threads {args.threads}; ATen capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"read bandwidth (torch.sum over 512 MiB, best of 7): {bw.best / 1e9:.1f} GB/s (median {bw.median / 1e9:.1f})")
    pool = torch.randint(0, 256, (args.pool_mb << 20,), dtype=torch.uint8)
    data = json.loads(args.json.read_text()) if args.json.exists() else {"levels": {}}
    data["cpu"] = cpu_model()
    baseline = [] if args.no_torch else bench_torch(pool, args.repeats, rows)
    for lv in levels:
        ours = []
        for fmt in args.formats.split(","):
            ours += bench_ours(pool, fmt, lv, args.repeats, rows, args.cache)
        bw_after = measure_bandwidth(512, 7)["read"].best
        entry = {"bandwidth_gbps": max(bw.best, bw_after) / 1e9, "bandwidth_gbps_start": bw.best / 1e9,
                 "bandwidth_gbps_end": bw_after / 1e9, "aten_capability": torch.backends.cpu.get_cpu_capability(),
                 "threads": args.threads, "cache_resident": args.cache, "ours": ours, "torch": baseline,
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        data["levels"][lv] = entry
        ref = entry["bandwidth_gbps"]
        what = "one matrix from cache" if args.cache else "rotating over the pool"
        print(f"\nlevel {lv}, {what}: GB/s of weight bytes, median (best), share of {ref:.1f} GB/s")
        print(f"{'format':10} {'shape':>11} " + " ".join(f"{'rows=' + str(m):>22}" for m in rows))
        for r0 in [r for r in ours + baseline if r["rows"] == rows[0]]:
            cells = [next(r for r in ours + baseline if r["format"] == r0["format"] and r["shape"] == r0["shape"]
                          and r["rows"] == m) for m in rows]
            print(f"{r0['format']:10} {r0['shape'][0]:>5}x{r0['shape'][1]:<5} " +
                  " ".join(f"{c['gbps']:6.1f} ({c['best_gbps']:5.1f}) {c['gbps'] / ref:4.0%}" for c in cells))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=1))
    plot(data, args.json.with_suffix(".png"))
    print(f"\nwrote {args.json} and {args.json.with_suffix('.png')}")


if __name__ == "__main__":
    main()
