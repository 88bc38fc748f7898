"""Models at laptop scale: random-weight GGUFs of Llama-3.2-3B's and Llama-3.1-8B's shapes (SmolLM2's
vocabulary), made here from their configs (measure/random_model.py: no weights downloaded), then
loaded in a fresh process each: load time, resident memory split into anonymous (the process's own)
and file-backed (mapped: the model file, the repack cache), after the load and after a decode that
has read every weight. Feeds BENCHMARKS.md's scale table; speed beside llama.cpp is `wallbreaker
bench -m FILE --llama-cpp-dir ...` on the same files.

    python benchmarks/scale.py --dir ~/scale-models            # makes the files once, then measures
    python benchmarks/scale.py --dir ~/scale-models --cold     # drops the repack cache first

Each model is loaded twice, in two fresh processes: the first may build its repack cache (a Q8_0
file's blocks change layout; Q4_K_M's are read in place but for llama's q/k rows), the second maps
it. Bounds checked (issue 38): RSS <= file + KV touched + 400 MB, anonymous <= KV pool + 400 MB,
load <= 2 s once the cache exists. Writes benchmarks/results/scale.json and .png.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
MODELS = (("llama-3.2-3b", "q8_0"), ("llama-3.2-3b", "q4_k_m"), ("llama-3.1-8b", "q4_k_m"))
KV_GB = 1.0  # as the run had it
MB = 1e6


def memory() -> dict[str, float]:
    """This process's resident set, split (MB), from /proc/self/status."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024 / MB
    return {"rss_mb": fields["VmRSS"], "anon_mb": fields["RssAnon"], "file_mb": fields["RssFile"],
            "peak_rss_mb": fields["VmHWM"]}


def child(path: str) -> dict:
    import torch  # noqa: F401  (the imports' own memory is part of every figure, as it is for a user)
    from wallbreaker import LLM, SamplingParams
    before = memory()
    start = time.perf_counter()
    llm = LLM(path, kv_cache_memory_gb=KV_GB, max_model_len=4096)
    load_s = time.perf_counter() - start
    loaded = memory()
    llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    stats = llm.stats()
    kv_touched = stats["kv_cache_bytes"]  # an upper bound: the pool's pages cost memory only once written
    return {"load_s": load_s, "after_imports": before, "after_load": loaded, "after_decode": memory(),
            "weight_bytes": stats["weight_bytes"], "weight_bytes_mapped": stats["weight_bytes_mapped"],
            "kv_pool_bytes": stats["kv_cache_bytes"], "kv_touched_bytes": kv_touched}


def measure(path: Path, timeout: float) -> dict:
    result = subprocess.run([sys.executable, __file__, "--child", str(path)], capture_output=True, text=True,
                            timeout=timeout)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        return {"error": (result.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def bounds(run: dict, file_bytes: int) -> dict[str, bool]:
    after = run["after_decode"]
    return {"rss": after["rss_mb"] * MB <= file_bytes + run["kv_touched_bytes"] + 400 * MB,
            "anon": after["anon_mb"] * MB <= run["kv_pool_bytes"] + 400 * MB}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--dir", type=Path, default=Path.home() / "scale-models", help="where the GGUFs are made")
    p.add_argument("--models", default=",".join(f"{s}:{q}" for s, q in MODELS))
    p.add_argument("--cold", action="store_true", help="remove each model's repack cache before its first load")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return

    from wallbreaker.formats.packaged import cache_dir, packaged_model_path
    from wallbreaker.kernels.repack_cache import source_identity
    from wallbreaker.measure.machine import machine_facts
    from wallbreaker.measure.random_model import SHAPES, write_random_gguf
    from wallbreaker.measure.reporting import markdown_table, write_json
    rows = []
    for spec in args.models.split(","):
        shape, scheme = spec.split(":")
        path = args.dir / f"{shape}-{scheme}.gguf"
        if not path.exists():
            print(f"making {path} ...", file=sys.stderr, flush=True)
            args.dir.mkdir(parents=True, exist_ok=True)
            write_random_gguf(path, SHAPES[shape], scheme, packaged_model_path("smollm2"))
        if args.cold:
            (cache_dir() / "repack" / f"{source_identity(path)[:40]}.bin").unlink(missing_ok=True)
        size = path.stat().st_size
        for attempt in ("first", "second"):
            print(f"{path.name}: {attempt} load ...", file=sys.stderr, flush=True)
            run = measure(path, args.timeout)
            row = {"model": path.name, "file_bytes": size, "load": attempt, **run}
            if "error" not in run:
                row["within_bounds"] = bounds(run, size)
            rows.append(row)
    json_path = write_json(args.out / "scale.json", {"machine": machine_facts(), "kv_cache_memory_gb": KV_GB,
                                                     "rows": rows})
    table = [[r["model"], r["load"], r["file_bytes"] / MB, r.get("load_s"),
              r.get("after_load", {}).get("rss_mb"), r.get("after_decode", {}).get("rss_mb"),
              r.get("after_decode", {}).get("anon_mb"), r.get("after_decode", {}).get("file_mb"),
              r.get("kv_pool_bytes", 0) / MB, r.get("within_bounds", r.get("error"))] for r in rows]
    print(markdown_table(["model", "load", "file MB", "load s", "RSS after load MB", "RSS after decode MB",
                          "anon MB", "file-backed MB", "KV pool MB", "within bounds"], table, 2))
    print(f"\nwrote {json_path}")


if __name__ == "__main__":
    main()
