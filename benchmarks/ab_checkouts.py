"""Two checkouts of wallbreaker side by side on this host: does a change lose speed? (issue 53 item 4:
the x86 levels lose nothing.) Each run is `wallbreaker bench --baselines none --runs 1` from one
tree's `src/` (its own built `_C`), alternating A, B, A per round, at the kernel level asked for;
medians of each metric and B / A. A figure from another host, or another day's host of the same
kind, says nothing here: only the ratio of two trees measured in one run does.

    git worktree add /tmp/before <commit> && (cd /tmp/before && .venv/bin/python setup.py build_ext --inplace)
    .venv/bin/python benchmarks/ab_checkouts.py --a /tmp/before --b . --isa avx512 --rounds 3
    .venv/bin/python benchmarks/ab_checkouts.py --a /tmp/before --b . --isa avx2 --rounds 3

Writes benchmarks/results/ab_checkouts_<model>_<isa>.json (the machine, the command, both commits,
every run) and prints the table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
METRICS = ("prefill_tps", "decode_tps", "decode_tps@16")


def commit_of(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "not a git tree"


def bench_once(tree: Path, isa: str, args: argparse.Namespace) -> dict[str, float]:
    """One `wallbreaker bench` run from `tree`; its wallbreaker medians."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [sys.executable, "-c", "import sys; from wallbreaker.cli import main; sys.exit(main(sys.argv[1:]))",
               "bench", "--baselines", "none", "--runs", "1", "--prefill-tokens", str(args.prefill_tokens),
               "--decode-tokens", str(args.decode_tokens), "--concurrency", "16", "--json", str(out)]
        if args.model:
            cmd += ["-m", args.model]
        env = {**os.environ, "PYTHONPATH": str(tree.resolve() / "src"), "WALLBREAKER_CPU_ISA": isa}
        subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
        medians = json.loads(out.read_text())["medians"]["wallbreaker"]
    return {m: medians[m] for m in METRICS if m in medians}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", type=Path, required=True, help="the checkout before (with its _C built)")
    p.add_argument("--b", type=Path, required=True, help="the checkout after")
    p.add_argument("--isa", default="avx512", help="kernel level for both (WALLBREAKER_CPU_ISA)")
    p.add_argument("--model", default=None, help="a GGUF path or packaged name (default: SmolLM2)")
    p.add_argument("--rounds", type=int, default=3, help="A/B/A rounds")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    from wallbreaker.measure.machine import machine_facts
    from wallbreaker.measure.reporting import write_json
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    trees = {"A": args.a, "B": args.b}
    order = ["A", "B", "A"] * args.rounds
    runs: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for name in order:
        runs[name].append(bench_once(trees[name], args.isa, args))
        print(name, {m: round(v, 1) for m, v in runs[name][-1].items()}, flush=True)
    med = {name: {m: statistics.median(r[m] for r in rs) for m in rs[0]} for name, rs in runs.items()}
    ratio = {m: med["B"][m] / med["A"][m] for m in med["A"]}
    machine = machine_facts()
    machine["kernel_isa"] = args.isa
    model = (args.model or "smollm2").removesuffix(".gguf").rsplit("/", 1)[-1].lower()
    path = write_json(args.json or RESULTS / f"ab_checkouts_{model}_{args.isa}.json",
                      {"machine": machine, "command": machine["command"], "started_utc": started, "model": model,
                       "isa": args.isa, "commits": {n: commit_of(t) for n, t in trees.items()}, "order": order,
                       "prefill_tokens": args.prefill_tokens, "decode_tokens": args.decode_tokens,
                       "runs": runs, "median": med, "ratio_b_over_a": ratio})
    print("| metric | A | B | B / A |\n| --- | --- | --- | --- |")
    for m in ratio:
        print(f"| {m} | {med['A'][m]:.1f} | {med['B'][m]:.1f} | {ratio[m]:.3f} |")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
