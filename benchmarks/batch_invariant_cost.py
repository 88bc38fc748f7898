"""What batch-invariant mode costs (`batch_invariant=True`, models/base.py `set_batch_invariant`): one
--prompt-tokens prompt, greedy --max-tokens tokens, no prefix cache, default mode against the mode,
each run a fresh process, alternated (A/B/A/B): time to first token and decode speed.

    .venv/bin/python benchmarks/batch_invariant_cost.py                       # SmolLM2, auto
    .venv/bin/python benchmarks/batch_invariant_cost.py --dtype float32
    .venv/bin/python benchmarks/batch_invariant_cost.py --model QWEN.gguf --runs 1
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def one_run(args: argparse.Namespace) -> None:
    from wallbreaker import LLM, SamplingParams
    from wallbreaker.measure.workload import prompt_ids
    llm = LLM(args.model, dtype=args.dtype, batch_invariant=args.invariant, enable_prefix_caching=False)
    ids = prompt_ids(llm.tokenizer, args.prompt_tokens, "batch invariant cost")
    out = llm.generate({"prompt_token_ids": ids},
                       SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))[0]
    print(json.dumps({"ttft_s": out.metrics["ttft_s"], "decode_tokens_per_s": out.metrics["decode_tokens_per_s"]}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--runs", type=int, default=2, help="A/B pairs")
    p.add_argument("--invariant", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.child:
        one_run(args)
        return
    from wallbreaker.measure.machine import describe_machine, machine_facts
    from wallbreaker.measure.reporting import markdown_table, write_json
    runs: dict[str, list[dict]] = {"default": [], "batch_invariant": []}
    for _ in range(args.runs):
        for mode, flag in (("default", []), ("batch_invariant", ["--invariant"])):
            cmd = [sys.executable, __file__, "--child", "--dtype", args.dtype, "--prompt-tokens",
                   str(args.prompt_tokens), "--max-tokens", str(args.max_tokens), *flag] + \
                (["--model", args.model] if args.model else [])
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode:
                raise SystemExit(f"a run failed:\n{done.stderr[-3000:]}")
            runs[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(mode, runs[mode][-1], flush=True)
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in ("ttft_s", "decode_tokens_per_s")}
           for mode, rs in runs.items()}
    facts = machine_facts()
    name = (args.model or "smollm2").removesuffix(".gguf").rsplit("/", 1)[-1].lower()
    path = write_json(args.json or RESULTS / f"batch_invariant_cost_{name}_{args.dtype}.json",
                      {"machine": facts, "model": args.model or "smollm2", "dtype": args.dtype,
                       "prompt_tokens": args.prompt_tokens, "medians": med, "runs": runs})
    print(describe_machine(facts))
    print(markdown_table(["mode", "TTFT s", "decode tokens/s"],
                         [[m, v["ttft_s"], v["decode_tokens_per_s"]] for m, v in med.items()], 2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
