"""Loading: wall time and peak resident memory to load each installed real model, in a fresh process
per model and engine, beside transformers loading the same GGUF (float32, dequantized in Python;
one run each, it is slow). Feeds BENCHMARKS.md's "Loading" table.

    python benchmarks/load.py

Peak RSS is `ru_maxrss` of the child process (imports included); "after imports" is the peak before
the load starts, so the difference is what loading added at its peak. Writes
benchmarks/results/load.json and .png and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def child(engine: str, model: str, dtype: str) -> dict:
    """Runs in the fresh process: import, then load once, timed."""
    import torch  # noqa: F401  (imports count toward the 'after imports' baseline, not the load)
    from wallbreaker.formats import resolve_model_path
    path = resolve_model_path(model)
    if engine == "wallbreaker":
        from wallbreaker import LLM
        base = _peak_mib()
        start = time.perf_counter()
        llm = LLM(model, dtype=dtype)
        seconds = time.perf_counter() - start
        kv_mib = llm.kv_cache.nbytes / 2**20
    else:
        from wallbreaker.measure.baselines import transformers_hf
        import transformers  # noqa: F401
        base = _peak_mib()
        _, seconds = transformers_hf.load(path)
        kv_mib = 0.0
    return {"engine": engine, "model": model, "dtype": dtype if engine == "wallbreaker" else "float32",
            "file_mib": path.stat().st_size / 2**20, "load_s": seconds, "peak_rss_mib": _peak_mib(),
            "rss_after_imports_mib": base, "kv_pool_reserved_mib": kv_mib}


def measure(engine: str, model: str, dtype: str, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", engine, model, "--dtype", dtype]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"engine": engine, "model": model, "error": f"ran past {timeout:.0f} s"}
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        tail = result.stderr.strip().splitlines()[-1:] or ["no output"]
        return {"engine": engine, "model": model, "error": tail[0]}
    return json.loads(lines[-1])


def plot(rows: list[dict], path: Path) -> None:
    from wallbreaker.measure.reporting import bar_plot
    ok = [r for r in rows if "error" not in r]
    groups: dict[str, dict[str, float | None]] = {}
    for r in ok:
        series = f"{r['engine']} ({r['dtype']})"
        groups.setdefault(f"{r['model']}: load s", {})[series] = r["load_s"]
        groups.setdefault(f"{r['model']}: peak RSS MiB", {})[series] = r["peak_rss_mib"]
    bar_plot(groups, path, "Loading: wall time and peak RSS (fresh process each)",
             {g: "s" if g.endswith("load s") else "MiB" for g in groups})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", nargs=2, metavar=("ENGINE", "MODEL"), help=argparse.SUPPRESS)
    p.add_argument("--models", default=None, help="comma-separated (default: every installed packaged model)")
    p.add_argument("--dtypes", default="auto", help="wallbreaker dtypes to load with (default: auto)")
    p.add_argument("--dtype", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.dtype)))
        return

    from wallbreaker.formats.packaged import PACKAGED_MODELS, is_installed
    from wallbreaker.measure.reporting import markdown_table, write_json
    models = args.models.split(",") if args.models else [a for a in PACKAGED_MODELS if is_installed(a)]
    skipped = [a for a in PACKAGED_MODELS if not args.models and a not in models]
    rows = []
    for model in models:
        runs = [("wallbreaker", d) for d in args.dtypes.split(",")]
        if not args.no_transformers:
            runs.append(("transformers", "float32"))
        for engine, dtype in runs:
            print(f"{model}: {engine} ({dtype}) ...", file=sys.stderr, flush=True)
            rows.append(measure(engine, model, dtype, args.timeout))
    json_path = write_json(args.out / "load.json", {"rows": rows, "not_installed": skipped})
    plot(rows, args.out / "load.png")
    table = [[r["model"], f"{r['engine']} ({r.get('dtype', '?')})", r.get("file_mib"), r.get("load_s"),
              r.get("peak_rss_mib"), r.get("rss_after_imports_mib"), r.get("error")] for r in rows]
    print(markdown_table(["model", "engine", "file MiB", "load s", "peak RSS MiB", "RSS after imports MiB", "error"],
                         table, 1))
    if skipped:
        print(f"\nnot installed: {', '.join(skipped)} (`make models`, `make target-model`)")
    print(f"\nwrote {json_path} and {json_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
