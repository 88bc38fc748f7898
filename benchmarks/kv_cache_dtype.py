"""Batched decoding by KV page dtype: 16 sequences, each a prompt of --prompt-tokens tokens and
--gen-tokens greedy tokens (ignore_eos), all submitted at once, for each --kv-cache-dtypes. Engines
take turns run by run (A/B/C/A/B/C...) so that a noisy spell hits all of them; the figures are
medians. Reports generation tokens/s of the decode phase (from each request's first token to its
last), the whole run's tokens/s, and the KV pool's bytes and blocks.

    .venv/bin/python benchmarks/kv_cache_dtype.py --prompt-tokens 1000
    .venv/bin/python benchmarks/kv_cache_dtype.py --prompt-tokens 4000 --kv-cache-memory-gb 2
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from wallbreaker import LLM, SamplingParams
from wallbreaker.cli import add_engine_flags, engine_options
from wallbreaker.measure.machine import describe_machine, machine_facts
from wallbreaker.measure.reporting import bar_plot, markdown_table, write_json
from wallbreaker.measure.workload import prompt_ids

RESULTS = Path(__file__).parent / "results"


def one_run(llm: LLM, prompts: list[list[int]], gen: int) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    start = time.perf_counter()
    before = dict(llm.engine.counters)
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    decode_s = llm.engine.counters["decode_time_s"] - before["decode_time_s"]
    decode_tokens = llm.engine.counters["decode_tokens"] - before["decode_tokens"]
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"decode_tokens_per_s": decode_tokens / decode_s if decode_s else 0.0,
            "run_tokens_per_s": generated / wall, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-cache-dtypes", default="bfloat16,int8,fp8")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    add_engine_flags(ap, skip=("kv_cache_dtype",), max_num_seqs=16)
    args = ap.parse_args()
    options = engine_options(args)
    kinds = args.kv_cache_dtypes.split(",")
    engines = {k: LLM(args.model, kv_cache_dtype=k, **options) for k in kinds}
    facts = machine_facts()
    first = next(iter(engines.values()))
    prompts = [prompt_ids(first.tokenizer, args.prompt_tokens, f"kv dtype run, sequence {i}") for i in range(args.seqs)]
    for llm in engines.values():  # warm-up: first touches of the pages, kernels' buffers
        one_run(llm, prompts[:2], 4)
    samples: dict[str, list[dict]] = {k: [] for k in kinds}
    for rep in range(args.runs):
        for k, llm in engines.items():
            samples[k].append(one_run(llm, [[t + rep for t in p] for p in prompts], args.gen_tokens))
            print(f"run {rep + 1} {k}: {samples[k][-1]['decode_tokens_per_s']:.1f} decode tokens/s", flush=True)
    medians = {k: {m: statistics.median(s[m] for s in runs) for m in runs[0]} for k, runs in samples.items()}
    base = kinds[0]
    rows = [[k, medians[k]["decode_tokens_per_s"], medians[k]["run_tokens_per_s"],
             f"{medians[k]['decode_tokens_per_s'] / medians[base]['decode_tokens_per_s']:.2f}x",
             engines[k].stats()["kv_blocks_total"], engines[k].kv_cache.nbytes / 2**30] for k in kinds]
    print(f"\n{first.model_path.name}: {args.seqs} sequences x ({args.prompt_tokens} prompt + {args.gen_tokens} "
          f"generated), medians of {args.runs}\nmachine: {describe_machine(facts)}\n")
    print(markdown_table(["KV pages", "decode tokens/s", "whole-run tokens/s", f"decode vs {base}", "blocks",
                          "pool GiB"], rows))
    report = {"model": first.model_path.name, "machine": facts, "config": {k: v for k, v in vars(args).items()
                                                                            if k != "json" and k != "plot"},
              "samples": samples, "medians": medians, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    out = args.json or RESULTS / f"kv_cache_dtype_{args.prompt_tokens}.json"
    write_json(out, {k: (str(v) if isinstance(v, Path) else v) for k, v in report.items()})
    print(f"wrote {out}")
    if args.plot:
        bar_plot({"decode tokens/s": {k: medians[k]["decode_tokens_per_s"] for k in kinds}}, args.plot,
                 f"{args.seqs} x {args.prompt_tokens}-token contexts", {"decode tokens/s": "tokens/s"})


if __name__ == "__main__":
    main()
