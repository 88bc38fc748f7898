"""Tensor parallelism changes nothing on the exact path: greedy tokens and logits of a model at
TP=2 (gloo, two processes) against one process, float32.

    .venv/bin/python benchmarks/tp_exactness.py --model qwen2.5-coder-1.5b [--tokens 16]

Writes benchmarks/results/tp_exactness_<model>.json.
"""
from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch

from wallbreaker import LLM, SamplingParams
from wallbreaker.cli import add_engine_flags, engine_options

PROMPTS = ["def quicksort(arr):", "The capital of France is", "class LinkedList:", "Once upon a time,",
           "import numpy as np\n\nx = np.", "Q: What is 12 * 7?\nA:", "SELECT name FROM", "fn main() {"]


def run(model: str, options: dict, tp: int, tokens: int) -> tuple[list[list[int]], torch.Tensor]:
    llm = LLM(model, **{**options, "tensor_parallel_size": tp})
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        ids = [o.outputs[0].token_ids for o in outs]
        logits = llm.logits(llm.encode(PROMPTS[0])[1] + ids[0])
        return ids, logits
    finally:
        if hasattr(llm, "shutdown"):
            llm.shutdown()
        del llm
        gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16)
    add_engine_flags(ap, skip=("tensor_parallel_size",), model="qwen2.5-coder-1.5b", dtype="float32",
                     kv_cache_memory_gb=0.5, max_model_len=512)
    args = ap.parse_args()
    single, single_logits = run(args.model, engine_options(args), 1, args.tokens)
    sharded, sharded_logits = run(args.model, engine_options(args), 2, args.tokens)
    result = {"model": args.model, "tokens": args.tokens, "prompts": len(PROMPTS),
              "prompts_identical": sum(a == b for a, b in zip(single, sharded)),
              "max_abs_logit_difference": float((single_logits - sharded_logits).abs().max())}
    print(json.dumps(result))
    out = Path(__file__).parent / "results" / f"tp_exactness_{args.model}.json"
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
