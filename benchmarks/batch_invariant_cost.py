"""What batch invariance costs (on by default; `batch_invariant=False` is the parent commit's default:
the same build then runs the parent's paths, see docs/architecture.md): A/B/A in one run, each run a
fresh process, on one model: time to first token of a 512- and a 4,096-token prompt, batch-1 decode
speed and the decode speed of 16 sequences at once (and a 32-token prompt's time to first token).

    .venv/bin/python benchmarks/batch_invariant_cost.py                                # SmolLM2
    .venv/bin/python benchmarks/batch_invariant_cost.py --model qwen2.5-coder-0.5b
    WALLBREAKER_DENSE_PREFILL=0 .venv/bin/python benchmarks/batch_invariant_cost.py    # no AMX path

Writes benchmarks/results/batch_invariant_cost_<model>_<dtype>[_nodense].json with the machine (CPU
model, family/model/stepping, ISA, AMX, threads, read bandwidth), the command and every run.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
# the four, and a short prompt's (which pays for a 512-row call on the dense path)
METRICS = ("ttft_512_s", "ttft_4096_s", "decode_1_tokens_per_s", "decode_16_tokens_per_s", "ttft_32_s")
LOWER_IS_BETTER = {"ttft_512_s", "ttft_4096_s", "ttft_32_s"}


def one_run(args: argparse.Namespace) -> None:
    """One process, one mode: every metric, each after a warm-up of its shapes."""
    from wallbreaker import LLM, SamplingParams
    from wallbreaker.measure.workload import prompt_ids
    llm = LLM(args.model, dtype=args.dtype, batch_invariant=args.invariant)
    tok = llm.tokenizer

    def first_token(n: int, tag: str) -> float:
        out = llm.generate({"prompt_token_ids": prompt_ids(tok, n, tag)},
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
        return out.metrics["ttft_s"]
    first_token(600, "warm-up")
    result = {"ttft_512_s": first_token(512, "ttft 512"), "ttft_4096_s": first_token(4096, "ttft 4096"),
              "ttft_32_s": min(first_token(32, f"ttft 32 {i}") for i in range(3))}
    decode = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt_ids(tok, 32, "decode one")}, decode)[0]
    result["decode_1_tokens_per_s"] = out.metrics["decode_tokens_per_s"]
    prompts = [{"prompt_token_ids": prompt_ids(tok, 32, f"decode sixteen {i}")} for i in range(16)]
    start = time.perf_counter()
    outs = llm.generate(prompts, decode)
    wall = time.perf_counter() - start
    prefill = max(o.metrics["ttft_s"] for o in outs)  # all 16 prompts go in the first step
    result["decode_16_tokens_per_s"] = 16 * (args.decode_tokens - 1) / (wall - prefill)
    print(json.dumps(result))


def cpu_identity() -> dict:
    """Vendor, family, model, stepping and whether the CPU has AMX, from /proc/cpuinfo."""
    facts: dict = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key in ("vendor_id", "cpu family", "model", "stepping") and key not in facts:
                    facts[key.replace(" ", "_")] = value
                if key == "flags":
                    facts["amx"] = "amx_tile" in value.split()
                    break
    except OSError:
        pass
    return facts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a GGUF path or a packaged name (default: SmolLM2)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="A/B/A rounds (each: parent, invariant, parent)")
    p.add_argument("--invariant", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.child:
        one_run(args)
        return
    from wallbreaker.measure.machine import load_profile, machine_facts, measure_bandwidth
    from wallbreaker.measure.reporting import markdown_table, write_json
    runs: dict[str, list[dict]] = {"parent_default": [], "batch_invariant": []}
    order = [("parent_default", []), ("batch_invariant", ["--invariant"]), ("parent_default", [])] * args.rounds
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for mode, flag in order:
        cmd = [sys.executable, __file__, "--child", "--dtype", args.dtype, "--decode-tokens", str(args.decode_tokens),
               *flag] + (["--model", args.model] if args.model else [])
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"a run failed:\n{done.stderr[-3000:]}")
        runs[mode].append({**json.loads(done.stdout.strip().splitlines()[-1]), "load_avg_1m": os.getloadavg()[0]})
        print(mode, runs[mode][-1], flush=True)
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in METRICS} for mode, rs in runs.items()}
    cost = {k: (med["batch_invariant"][k] / med["parent_default"][k] - 1) * (1 if k in LOWER_IS_BETTER else -1)
            for k in METRICS}  # > 0: the invariant default is that much slower
    facts = {**machine_facts(), **cpu_identity()}
    if facts.get("read_bandwidth_gb_per_s") is None:
        facts["read_bandwidth_gb_per_s"] = round(measure_bandwidth(256, 3)["read"].best / 1e9, 1)
    profile = load_profile()
    facts["bandwidth_source"] = "stored profile" if profile and profile.bandwidth else "measured by this script"
    dense = os.environ.get("WALLBREAKER_DENSE_PREFILL", "")
    name = (args.model or "smollm2").removesuffix(".gguf").rsplit("/", 1)[-1].lower()
    path = write_json(args.json or RESULTS / f"batch_invariant_cost_{name}_{args.dtype}{'_nodense' if dense == '0' else ''}.json",
                      {"machine": facts, "model": args.model or "smollm2", "dtype": args.dtype,
                       "env": {"WALLBREAKER_DENSE_PREFILL": dense} if dense else {},
                       "command": shlex.join([os.path.relpath(sys.executable), *sys.argv]), "started_utc": started,
                       "order": [m for m, _ in order], "medians": med, "cost": cost, "runs": runs})
    print(markdown_table(["metric", "parent default", "batch invariant", "cost"],
                         [[k, med["parent_default"][k], med["batch_invariant"][k], f"{100 * cost[k]:+.1f}%"]
                          for k in METRICS], 3))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
