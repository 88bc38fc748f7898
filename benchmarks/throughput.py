"""Throughput against concurrency: the same requests (64 prompts of mixed lengths, 128 greedy
tokens each, ignore_eos, all submitted at once) at max_num_seqs 1, 4, 16 and 64. Reports generated
tokens/s of the whole run, requests/s, per-request latency (end to end, from submission) and TTFT,
and the memory bound at that batch when `wallbreaker roofline` has stored a bandwidth.

    python benchmarks/throughput.py

Writes benchmarks/results/throughput_<model>.json and .png and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from wallbreaker import LLM, SamplingParams
from wallbreaker.cli import add_engine_flags, engine_options
from wallbreaker.formats import resolve_model_path
from wallbreaker.measure.reporting import markdown_table, median, percentile, write_json
from wallbreaker.measure.roofline import decode_bound_tokens_per_s
from wallbreaker.measure.workload import mixed_lengths, prompt_ids

RESULTS = Path(__file__).parent / "results"


def run_level(model: str | None, options: dict, concurrency: int, lengths: list[int], max_tokens: int) -> dict:
    llm = LLM(model, **{**options, "max_num_seqs": concurrency})
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([prompt_ids(llm.tokenizer, 32, "warm-up")], SamplingParams(max_tokens=8, ignore_eos=True))
    prompts = [prompt_ids(llm.tokenizer, n, f"throughput c{concurrency} r{i}") for i, n in enumerate(lengths)]
    before = dict(llm.engine.counters)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    decode_s = llm.engine.counters["decode_time_s"] - before["decode_time_s"]
    decode_tokens = llm.engine.counters["decode_tokens"] - before["decode_tokens"]
    e2e = [o.metrics["e2e_s"] for o in outs]
    ttft = [o.metrics["ttft_s"] for o in outs]
    generated = sum(o.metrics["num_generated_tokens"] for o in outs)
    mean_context = sum(lengths) / len(lengths) + max_tokens / 2
    bound = decode_bound_tokens_per_s(llm, concurrency, int(mean_context))
    stats = llm.stats()
    return {"concurrency": concurrency, "wall_s": wall, "generated_tokens": generated,
            "prompt_tokens": sum(lengths), "gen_tokens_per_s": generated / wall,
            "total_tokens_per_s": (generated + sum(lengths)) / wall, "requests_per_s": len(outs) / wall,
            "e2e_s": {"mean": sum(e2e) / len(e2e), "p50": median(e2e), "p90": percentile(e2e, 90),
                      "p99": percentile(e2e, 99)},
            "ttft_s": {"mean": sum(ttft) / len(ttft), "p50": median(ttft), "p90": percentile(ttft, 90)},
            "decode_tokens_per_s_per_request_p50": median([o.metrics["decode_tokens_per_s"] for o in outs]),
            "decode_phase_tokens_per_s": decode_tokens / decode_s if decode_s else None,
            "memory_bound_tokens_per_s": bound, "num_preemptions": stats["num_preemptions"],
            "load_time_s": llm.load_time_s}


def plot(levels: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["concurrency"] for r in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(xs, [r["gen_tokens_per_s"] for r in levels], "o-", label="generated tokens/s (whole run)")
    left.plot(xs, [r["decode_phase_tokens_per_s"] for r in levels], "s--", label="decode phase tokens/s")
    if all(r["memory_bound_tokens_per_s"] for r in levels):
        left.plot(xs, [r["memory_bound_tokens_per_s"] for r in levels], ":", color="gray", label="memory bound")
    left.set_xscale("log", base=2)
    left.set_xticks(xs, [str(x) for x in xs])
    left.set_xlabel("concurrent sequences (max_num_seqs)")
    left.set_ylabel("tokens/s")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    for key, style in (("p50", "o-"), ("p90", "s--")):
        right.plot(xs, [r["e2e_s"][key] for r in levels], style, label=f"end-to-end {key}")
    right.plot(xs, [r["ttft_s"]["p50"] for r in levels], "^:", label="TTFT p50")
    right.set_xscale("log", base=2)
    right.set_xticks(xs, [str(x) for x in xs])
    right.set_xlabel("concurrent sequences (max_num_seqs)")
    right.set_ylabel("seconds per request (all submitted at once)")
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_flags(p, skip=("max_num_seqs",))  # --concurrency sets max_num_seqs
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-prompt-tokens", type=int, default=32)
    p.add_argument("--max-prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--name", default=None, help="results file suffix (default: the model file's stem)")
    args = p.parse_args()

    lengths = mixed_lengths(args.num_prompts, args.min_prompt_tokens, args.max_prompt_tokens)
    levels = []
    for c in (int(x) for x in args.concurrency.split(",")):
        print(f"max_num_seqs {c} ...", file=sys.stderr, flush=True)
        levels.append(run_level(args.model, engine_options(args), c, lengths, args.max_tokens))
    name = args.name or resolve_model_path(args.model).stem
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    json_path = write_json(args.out / f"throughput_{name}.json", {"config": config, "prompt_lengths": lengths,
                                                                  "levels": levels})
    plot(levels, args.out / f"throughput_{name}.png",
         f"{name}: {args.num_prompts} requests, prompts {args.min_prompt_tokens}-{args.max_prompt_tokens}, "
         f"{args.max_tokens} tokens each")
    rows = [[r["concurrency"], r["gen_tokens_per_s"], r["decode_phase_tokens_per_s"], r["memory_bound_tokens_per_s"],
             r["requests_per_s"], r["e2e_s"]["p50"], r["e2e_s"]["p90"], r["ttft_s"]["p50"], r["wall_s"],
             r["num_preemptions"]] for r in levels]
    print(markdown_table(["max_num_seqs", "gen tokens/s", "decode-phase tokens/s", "memory bound", "req/s",
                          "e2e p50 s", "e2e p90 s", "TTFT p50 s", "wall s", "preemptions"], rows, 2))
    print(f"\nwrote {json_path} and {json_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
