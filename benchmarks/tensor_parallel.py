"""Tensor parallelism: decode tokens/s and peak resident memory per rank, TP=1 against TP=N.

Each configuration runs in a fresh process, so that peak memory (VmHWM: the high-water mark of
resident memory, file pages of the memory-mapped GGUF included) belongs to that run alone.

    python benchmarks/tensor_parallel.py --model smollm2 --dtype float32 --tp 1 2
    python benchmarks/tensor_parallel.py --model qwen2.5-coder-1.5b --dtype auto --tp 1 2 --max-tokens 32
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from wallbreaker.cli import add_engine_flags, engine_options

PROMPT = "Write a short story about a robot who learns to paint."


def vm_hwm_mib(pid: int | str = "self") -> float:
    """Peak resident memory of a live process, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def shard_weights_mib(llm, rank: int, tp: int) -> float:
    """The resident weight bytes of another rank's shard, built here after the run (no group needed)."""
    import torch
    from wallbreaker.models import load_model
    from wallbreaker.layers.linear import module_bytes
    from wallbreaker.layers.shard import Shard
    return module_bytes(load_model(llm.files, llm.config, torch.device("cpu"), Shard(rank, tp))) / 2**20


def run_one(model: str | None, options: dict, tp: int, max_tokens: int, batch: int) -> dict:
    from wallbreaker import LLM, SamplingParams

    baseline = vm_hwm_mib()  # the interpreter, torch and wallbreaker imported: every rank pays this
    start = time.perf_counter()
    llm = LLM(model, **{**options, "tensor_parallel_size": tp, "max_num_seqs": max(batch, options["max_num_seqs"])})
    dtype, threads = options["dtype"], options["num_threads"]
    load_s = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    rates = []
    for _ in range(2):
        outs = llm.generate([PROMPT] * batch, params)
        rates.append(sum(o.metrics["decode_tokens_per_s"] for o in outs) / len(outs) * batch)
    pids = llm.workers.worker_pids if llm.workers else {}
    peaks = {0: vm_hwm_mib(), **{rank: vm_hwm_mib(pid) for rank, pid in pids.items()}}
    llm.shutdown()
    weights = {0: llm.weight_bytes / 2**20, **{r: shard_weights_mib(llm, r, tp) for r in range(1, tp)}}
    return {"model": model or "smollm2", "dtype": dtype, "tensor_parallel_size": tp, "batch": batch,
            "max_tokens": max_tokens, "load_s": round(load_s, 2), "decode_tokens_per_s": round(max(rates), 2),
            "baseline_rss_mib": round(baseline, 1), "peak_rss_mib_per_rank": {r: round(v, 1) for r, v in peaks.items()},
            "weights_mib_per_rank": {r: round(v, 1) for r, v in weights.items()},
            "threads_per_rank": threads or max(1, (os.cpu_count() or 1) // tp)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # internal: run one TP size
    # --num-threads is per rank (default: the cores / TP size)
    add_engine_flags(p, skip=("tensor_parallel_size",), dtype="float32", max_num_seqs=8, max_model_len=1024)
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args.model, engine_options(args), args.one, args.max_tokens, args.batch)))
        return
    results = []
    for tp in args.tp:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--one", str(tp)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(results[-1]))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
