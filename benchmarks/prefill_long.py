"""Prefill of long prompts beside llama.cpp and ik_llama.cpp (issue 49): tokens/s of one fresh prompt
of each length, ours through `LLM.generate` (time to first token, default options, the scheduler's
own chunking) and theirs through `llama-bench -p N -n 0`. ik_llama.cpp runs at `-rtr 0` and `-rtr 1`
(run-time repacking) and keeps its best, as its README advises.

Order A/B/A per length: ours, llama.cpp, ik_llama.cpp (both -rtr), ... --runs times, then ours once
more; medians. `--one-pass` also times ours with the whole prompt in one step (`max_num_batched_tokens`
= the longest length, a second engine in the same process) beside the default chunks, for the cost
of chunking (issue 49's item 2: a 16k prompt chunked within 15% of one pass). Results merge into
--json keyed by model and host (machine facts, command, commit), so one file keeps a row per host.

    .venv/bin/python benchmarks/prefill_long.py -m MODEL.gguf --tokens 512,2048,8192 \\
        --llama-cpp-dir DIR/bin --ik-llama-dir DIR/bin
    WALLBREAKER_CPU_ISA=avx2 .venv/bin/python benchmarks/prefill_long.py ... --llama-cpp-dir AVX2_BUILD/bin --no-ik
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

from wallbreaker.measure.baselines.llama_cpp import LlamaCpp, LlamaCppError
from wallbreaker.measure.machine import machine_facts
from wallbreaker.measure.reporting import markdown_table, write_json

RESULTS = Path(__file__).parent / "results"


def host_key(facts: dict) -> str:
    return f"{facts['cpu_id'].split(' L1d')[0]} {facts['kernel_isa']}"


def ours_rate(llm, n: int, tag: str) -> float:
    from wallbreaker.measure.workload import prompt_ids
    from wallbreaker.sampling_params import SamplingParams
    ids = prompt_ids(llm.tokenizer, n, tag)
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))[0]
    return n / out.metrics["ttft_s"]


def ours_decode(llm, n: int, tag: str) -> float:
    from wallbreaker.measure.workload import prompt_ids
    from wallbreaker.sampling_params import SamplingParams
    ids = prompt_ids(llm.tokenizer, 16, tag)
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
    return out.metrics["decode_tokens_per_s"]


def their_rate(tool: LlamaCpp, model: Path, n: int, extra: tuple[str, ...] = (), decode: bool = False) -> float | None:
    """`llama-bench`'s prefill tokens/s over n prompt tokens, or with `decode` its decode tokens/s of n tokens."""
    try:
        got = tool.bench(model, 0 if decode else n, n if decode else 0, extra=extra)
        return got.get("decode_tokens_per_s" if decode else "prefill_tokens_per_s")
    except LlamaCppError as e:
        print(f"  {tool.directory}: {e}")
        return None


def interleaved(runs: int, ours: Callable[[str], float], theirs: dict[str, Callable[[str], float | None]]) -> dict:
    """Samples and medians of ours and each baseline, A/B/A: `runs` rounds of ours then each of theirs,
    then ours once more (a baseline that fails leaves its round out). Each call gets the round's tag,
    so that a prompt of ours is never one its engine has cached."""
    samples: dict[str, list[float]] = {"wallbreaker": [], **{name: [] for name in theirs}}
    for rep in range(runs):
        samples["wallbreaker"].append(ours(str(rep)))
        for name, run in theirs.items():
            if (r := run(str(rep))) is not None:
                samples[name].append(r)
    samples["wallbreaker"].append(ours("last"))
    return {"samples": samples, "medians": {k: statistics.median(v) if v else None for k, v in samples.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, required=True)
    ap.add_argument("--name", default=None, help="the model's row name (default: the file's stem)")
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-cpp-dir", default=None)
    ap.add_argument("--ik-llama-dir", default=None)
    ap.add_argument("--no-ik", action="store_true")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--one-pass", action="store_true", help="also time ours unchunked (see above)")
    ap.add_argument("--decode-tokens", type=int, default=0,
                    help="also batch-1 decode of this many tokens (`llama-bench -p 0 -n N`; ours after a 16-token prompt)")
    ap.add_argument("--json", type=Path, default=RESULTS / "prefill_long.json")
    args = ap.parse_args()
    from wallbreaker.llm import LLM

    lengths = [int(t) for t in args.tokens.split(",") if t]
    llm = LLM(str(args.model), max_model_len=max(lengths, default=2048) + 64)
    ours_rate(llm, 64, "warm-up")
    one_pass = None
    if args.one_pass:
        one_pass = LLM(str(args.model), max_model_len=max(lengths) + 64, max_num_batched_tokens=max(lengths))
        ours_rate(one_pass, 64, "warm-up")
    llama = None if args.no_llama_cpp else LlamaCpp(args.llama_cpp_dir, args.threads)
    ik = None if args.no_ik else LlamaCpp(args.ik_llama_dir, args.threads)
    facts = machine_facts(args.threads)
    data = json.loads(args.json.read_text()) if args.json.exists() else {"runs": {}}
    key = f"{args.name or args.model.stem} | {host_key(facts)} | {args.tokens}" + (" | decode" if args.decode_tokens else "")
    rows = {}
    data["runs"][key] = {"model": args.name or args.model.stem, "machine": facts, "lengths": rows,
                         "llama_cpp_dir": None if args.no_llama_cpp else args.llama_cpp_dir,
                         "ik_llama_dir": None if args.no_ik else args.ik_llama_dir,
                         "time": time.strftime("%Y-%m-%dT%H:%M:%S")}

    def baselines(n: int, decode: bool = False) -> dict[str, Callable[[str], float | None]]:
        out = {}
        if llama is not None:
            out["llama.cpp"] = lambda _: their_rate(llama, args.model, n, decode=decode)
        if ik is not None:  # its best of run-time repacking off and on
            out["ik_llama.cpp"] = lambda _: max((r for rtr in ("0", "1")
                                               if (r := their_rate(ik, args.model, n, ("-rtr", rtr), decode)) is not None),
                                              default=None)
        return out

    for n in lengths:
        n = min(n, llm.engine.max_model_len - 1)  # a model's context holds the prompt and one token to generate
        theirs = baselines(n)
        if one_pass is not None:
            theirs = {"wallbreaker_one_pass": lambda tag: ours_rate(one_pass, n, f"one pass {n} {tag}"), **theirs}
        row = interleaved(args.runs, lambda tag: ours_rate(llm, n, f"prefill {n} {tag}"), theirs)
        med = row["medians"]
        row["vs_llama_cpp"] = med["wallbreaker"] / med["llama.cpp"] if med.get("llama.cpp") else None
        row["vs_ik_llama_cpp"] = med["wallbreaker"] / med["ik_llama.cpp"] if med.get("ik_llama.cpp") else None
        row["chunked_ttft_over_one_pass"] = (med["wallbreaker_one_pass"] / med["wallbreaker"]
                                             if med.get("wallbreaker_one_pass") else None)
        rows[str(n)] = row
        print(f"{n}: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items() if v))
        write_json(args.json, data)  # after each length: a long run cut short keeps what it measured
    if args.decode_tokens:
        n = args.decode_tokens
        decode = interleaved(args.runs, lambda tag: ours_decode(llm, n, f"decode {tag}"), baselines(n, decode=True))
        data["runs"][key]["decode"] = {"tokens": n, **decode}
        write_json(args.json, data)
        print(f"decode {n}: " + ", ".join(f"{k} {v:.1f}" for k, v in decode["medians"].items() if v))
    print(markdown_table(["tokens", "ours tok/s", "llama.cpp", "ik_llama.cpp", "ours/llama.cpp", "ours/ik"],
                         [[n, r["medians"]["wallbreaker"], r["medians"].get("llama.cpp"), r["medians"].get("ik_llama.cpp"),
                           r["vs_llama_cpp"], r["vs_ik_llama_cpp"]] for n, r in rows.items()], digits=2))


if __name__ == "__main__":
    main()
