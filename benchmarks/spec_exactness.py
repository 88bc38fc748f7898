"""Greedy output with speculative decoding is token-for-token the output without it, on the real
draft/target pair (float32, the exact path) and with prompt-lookup n-grams.

    .venv/bin/python benchmarks/spec_exactness.py [--k 1 4 8] [--tokens 32]

Needs `make models target-model`. Writes benchmarks/results/spec_exactness.json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from wallbreaker import LLM, SamplingParams
from wallbreaker.cli import add_engine_flags, engine_options

PROMPTS = [
    "def quicksort(arr):", "class LinkedList:\n    def __init__(self):", "import numpy as np\n\ndef softmax(x):",
    "# Binary search in a sorted list\ndef binary_search(items, target):", "def fibonacci(n):",
    "SELECT name, COUNT(*) FROM orders", "fn main() {\n    let v = vec![1, 2, 3];", "async function fetchJson(url) {",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--tokens", type=int, default=32)
    add_engine_flags(ap, skip=("model", "speculative_method", "speculative_model", "num_speculative_tokens",
                               "speculative_adaptive"), dtype="float32", kv_cache_memory_gb=1.0, max_model_len=1024)
    args = ap.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    common = engine_options(args)
    plain = [o.outputs[0].token_ids for o in LLM(args.target, **common).generate(PROMPTS, params)]
    results = []
    for method in ("draft", "ngram"):
        for k in args.k:
            extra = dict(speculative_method=method, num_speculative_tokens=k, speculative_adaptive=False)
            if method == "draft":
                extra["speculative_model"] = args.draft
            llm = LLM(args.target, **common, **extra)
            start = time.perf_counter()
            outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
            stats = llm.stats()
            row = {"method": method, "k": k, "identical": outs == plain,
                   "prompts_identical": sum(a == b for a, b in zip(outs, plain)), "prompts": len(PROMPTS),
                   "acceptance_rate": stats["spec_acceptance_rate"],
                   "mean_accepted_length": stats["spec_mean_accepted_length"],
                   "seconds": time.perf_counter() - start}
            print(json.dumps(row), flush=True)
            results.append(row)
            del llm
    out = Path(__file__).parent / "results" / f"spec_exactness_{args.dtype}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"target": args.target, "draft": args.draft, "tokens": args.tokens,
                               "dtype": args.dtype, "results": results}, indent=2))


if __name__ == "__main__":
    main()
