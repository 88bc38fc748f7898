"""Speculative decoding, with and without, side by side in one run. Batch 1, one prompt at a
time, each variant on a freshly loaded engine (so its statistics are its own):

  (a) draft pair: target qwen2.5-coder-1.5b, draft qwen2.5-coder-0.5b, greedy, on code prompts;
      beside llama.cpp's `llama-speculative` on the same pair and prompts (and `llama-bench` tg for
      the target alone) when the tools are found;
  (b) ngram on a prompt that asks for a ~200-token code block back with one change (greedy, chat);
  (c) drafts mostly rejected: a random-word prompt sampled at temperature 1.2 (ngram, and the draft
      pair when installed).

Each speculative variant runs with adaptive K (the controller picks 0..K per step) and with fixed K.
Reports decode tokens/s (median over prompts), the speedup over no speculation, acceptance rate,
mean accepted length per verify step, the K histogram, and whether greedy output matched.

    python benchmarks/speculative.py --llama-cpp-dir /work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin

Without qwen2.5-coder-1.5b installed, case (a) is skipped (install it with `make target-model`).
Writes benchmarks/results/speculative.json and .png and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wallbreaker import LLM, SamplingParams
from wallbreaker.cli import add_engine_flags, engine_options
from wallbreaker.formats import resolve_model_path
from wallbreaker.formats.packaged import PACKAGED_MODELS, is_installed
from wallbreaker.measure.reporting import bar_plot, markdown_table, median, write_json

RESULTS = Path(__file__).parent / "results"
TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"

CODE_PROMPTS = ["def quicksort(arr):", "class LinkedList:", "def binary_search(items, target):",
                "import numpy as np\n\n\ndef softmax(x):"]

EDIT_SOURCE = '''def parse_config(path):
    """Read a key=value config file into a dict, skipping comments and blank lines."""
    result = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                raise ValueError(f"line {number}: expected key=value, got {line!r}")
            key, value = line.split("=", 1)
            key, value = key.strip(), value.strip()
            if key in result:
                raise ValueError(f"line {number}: duplicate key {key!r}")
            if value.lower() in ("true", "false"):
                value = value.lower() == "true"
            elif value.isdigit():
                value = int(value)
            result[key] = value
    return result
'''
EDIT_PROMPT = ("Here is a Python function:\n\n```python\n" + EDIT_SOURCE + "```\n\nWrite it out again exactly as "
               "it is, but rename the function `parse_config` to `load_config`. Reply with the code only.")


def random_words_prompt(seed: int, words: int = 120) -> str:
    rng = random.Random(seed)
    pool = ("river glass orbit seven maple quiet ladder copper violet north thunder paper candle mirror "
            "garden pencil falcon silver harbor window").split()
    return "Continue this list: " + " ".join(rng.choice(pool) for _ in range(words))


def available(model: str) -> bool:
    return is_installed(model) if model in PACKAGED_MODELS else Path(model).exists()

SPEC_FIELDS = ("model", "speculative_method", "speculative_model", "num_speculative_tokens", "speculative_adaptive")

@dataclass
class Case:
    key: str
    title: str
    model: str
    prompts: list[str]
    params: SamplingParams
    methods: list[str]  # speculative methods to compare with plain decoding
    chat: bool = False
    draft: str | None = None
    llama_cpp: bool = False


@dataclass
class VariantResult:
    case: str
    variant: str
    decode_tokens_per_s: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    load_time_s: float = 0.0


def run_variant(case: Case, variant: str, options: dict, common: dict) -> VariantResult:
    llm = LLM(case.model, **common, **options)
    llm.generate(["Warm-up: hello"], SamplingParams(max_tokens=8, ignore_eos=True))
    before = llm.stats()
    result = VariantResult(case.key, variant, load_time_s=llm.load_time_s)
    for prompt in case.prompts:
        run = llm.chat if case.chat else llm.generate
        out = run([{"role": "user", "content": prompt}] if case.chat else [prompt], case.params)[0]
        result.decode_tokens_per_s.append(out.metrics.get("decode_tokens_per_s", 0.0))
        result.tokens.append(out.outputs[0].token_ids)
    after = llm.stats()
    if options.get("speculative_method"):
        proposed = after["spec_proposed"] - before["spec_proposed"]
        accepted = after["spec_accepted"] - before["spec_accepted"]
        steps = after["spec_verify_steps"] - before["spec_verify_steps"]
        hist = Counter(after.get("spec_k_histogram", {}))
        hist.subtract(before.get("spec_k_histogram", {}))
        result.stats = {"spec_acceptance_rate": accepted / proposed if proposed else 0.0,
                        "spec_mean_accepted_length": accepted / steps if steps else 0.0,
                        "spec_proposed": proposed, "spec_accepted": accepted, "spec_verify_steps": steps,
                        "spec_k_histogram": {k: v for k, v in sorted(hist.items()) if v}}
    del llm
    gc.collect()
    return result


def llama_cpp_rows(case: Case, args: argparse.Namespace, threads: int) -> list[dict]:
    from wallbreaker.measure.baselines.llama_cpp import LlamaCpp, LlamaCppError
    tool = LlamaCpp(args.llama_cpp_dir, threads)
    if not (tool.available("llama-speculative") and tool.available("llama-bench")):
        print("llama.cpp tools not found: skipping llama-speculative (give --llama-cpp-dir)", file=sys.stderr)
        return []
    target, draft = resolve_model_path(case.model), resolve_model_path(case.draft)
    rows = []
    try:
        alone = tool.bench(target, 0, args.max_tokens).get("decode_tokens_per_s")
        rows.append({"variant": "llama.cpp target alone (llama-bench tg)", "decode_tokens_per_s": alone})
        runs = [tool.speculative(target, draft, p, args.max_tokens, args.k) for p in case.prompts]
        drafted = sum(r["drafted"] or 0 for r in runs)
        rows.append({"variant": f"llama.cpp draft, --spec-draft-n-max {args.k}",
                     "decode_tokens_per_s": median([r["decode_tokens_per_s"] for r in runs]),
                     "spec_acceptance_rate": sum(r["accepted"] or 0 for r in runs) / drafted if drafted else None,
                     "per_prompt": runs})
    except LlamaCppError as e:
        print(f"llama.cpp failed: {e}", file=sys.stderr)
    return rows


def cases(args: argparse.Namespace) -> list[Case]:
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    hot = SamplingParams(temperature=1.2, max_tokens=args.max_tokens, seed=7, ignore_eos=True)
    pair = available(args.target) and available(args.draft)
    out = []
    if "a" in args.cases:
        if pair:
            out.append(Case("a", "draft pair, code prompts, greedy", args.target, CODE_PROMPTS, greedy, ["draft"],
                            draft=args.draft, llama_cpp=True))
        else:
            print(f"case (a) skipped: {args.target} is not installed; install it with `make target-model`",
                  file=sys.stderr)
    if "b" in args.cases:
        out.append(Case("b", "ngram, repeat a code block with one edit, greedy", args.ngram_model, [EDIT_PROMPT],
                        SamplingParams(temperature=0.0, max_tokens=args.edit_max_tokens, ignore_eos=False),
                        ["ngram"], chat=True))
    if "c" in args.cases:
        prompts = [random_words_prompt(s, args.random_words) for s in range(2)]
        out.append(Case("c", "mostly rejected: random words, temperature 1.2", args.target if pair else args.ngram_model,
                        prompts, hot, ["ngram", "draft"] if pair else ["ngram"], draft=args.draft if pair else None))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="a,b,c")
    p.add_argument("--target", default=TARGET)
    p.add_argument("--draft", default=DRAFT)
    p.add_argument("--ngram-model", default=DRAFT if is_installed(DRAFT) else "smollm2",
                   help="model of the ngram cases (default: qwen2.5-coder-0.5b if installed, else smollm2)")
    p.add_argument("--k", type=int, default=4, help="fixed K, and the most the adaptive controller may pick")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--edit-max-tokens", type=int, default=320, help="(b) stops at EOS or here")
    p.add_argument("--random-words", type=int, default=120, help="(c) words in each random prompt")
    # the engine's flags, but the models (the cases pick them) and speculation (the variants set it)
    add_engine_flags(p, skip=SPEC_FIELDS, max_num_seqs=4)
    p.add_argument("--llama-cpp-dir", default=None)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()

    import torch
    threads = args.num_threads or torch.get_num_threads()
    common = {**engine_options(args), "num_threads": threads}
    results: list[VariantResult] = []
    extra: dict[str, list[dict]] = {}
    case_list = cases(args)
    for case in case_list:
        variants: list[tuple[str, dict]] = [("no speculation", {})]
        for method in case.methods:
            spec = {"speculative_method": method, "num_speculative_tokens": args.k}
            if method == "draft":
                spec["speculative_model"] = case.draft
            variants += [(f"{method}, adaptive K<={args.k}", {**spec, "speculative_adaptive": True}),
                         (f"{method}, fixed K={args.k}", {**spec, "speculative_adaptive": False})]
        for name, options in variants:
            print(f"({case.key}) {name} ...", file=sys.stderr, flush=True)
            results.append(run_variant(case, name, options, common))
        if case.llama_cpp:
            extra[case.key] = llama_cpp_rows(case, args, threads)
    report(results, extra, case_list, args)


def report(results: list[VariantResult], extra: dict[str, list[dict]], case_list: list[Case],
           args: argparse.Namespace) -> None:
    titles = {c.key: f"({c.key}) {c.title} [{c.model}]" for c in case_list}
    rows, groups = [], {}
    for key in titles:
        mine = [r for r in results if r.case == key]
        if not mine:
            continue
        base = mine[0]
        base_tps = median(base.decode_tokens_per_s)
        greedy = next(c for c in case_list if c.key == key).params.temperature == 0
        for r in mine:
            tps = median(r.decode_tokens_per_s)
            same = (r.tokens == base.tokens) if greedy and r is not base else None
            rows.append([titles[key], r.variant, tps, f"{tps / base_tps:.2f}x" if base_tps else None,
                         r.stats.get("spec_acceptance_rate"), r.stats.get("spec_mean_accepted_length"),
                         " ".join(f"{k}:{v}" for k, v in r.stats.get("spec_k_histogram", {}).items()) or None,
                         {None: None, True: "yes", False: "no"}[same]])
            groups.setdefault(titles[key], {})[r.variant] = tps
        for row in extra.get(key, []):
            tps = row["decode_tokens_per_s"]
            rows.append([titles[key], row["variant"], tps, None, row.get("spec_acceptance_rate"), None, None, None])
            groups[titles[key]][row["variant"]] = tps
    print(markdown_table(["case", "variant", "decode tokens/s", "vs none", "acceptance", "accepted per verify",
                          "K histogram", "greedy output same"], rows, 2))
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    json_path = write_json(args.out / "speculative.json", {"config": config, "results": [r.__dict__ for r in results],
                                                           "llama_cpp": extra})
    bar_plot(groups, args.out / "speculative.png", "decode tokens/s, batch 1: with and without speculation",
             {g: "tokens/s" for g in groups})
    print(f"\nwrote {json_path} and {json_path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
