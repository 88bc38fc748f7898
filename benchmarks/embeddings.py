"""Embedding throughput: `LLM.embed` beside sentence-transformers on all-MiniLM-L6-v2, the same
texts (8-256 tokens, from WikiText-2) and the same torch thread count, at batch 1 and batch 32.
Side by side and interleaved (sentence-transformers, then each wallbreaker variant, round after
round); medians of texts per second.

Variants: wallbreaker float32 on the folder (the exact path), on the llama.cpp-converted Q8_0 GGUF
(`auto`: Q8_0 blocks through our kernels), and on the folder with `auto` (Q8_0 blocks made at load).

    .venv/bin/python benchmarks/embeddings.py --folder DIR --q8-gguf FILE --threads 2
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

# This folder's kernels.py would shadow the `kernels` package that transformers imports.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch

from wallbreaker import LLM
from wallbreaker.measure.machine import describe_machine, machine_facts
from wallbreaker.measure.reporting import markdown_table, write_json

RESULTS = Path(__file__).parent / "results"
WIKITEXT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext-2" / "valid.txt"


def make_texts(tokenizer, count: int, lo: int, hi: int, seed: int = 0) -> list[str]:
    """`count` texts of WikiText-2, each cut to a token count drawn uniformly from [lo, hi]."""
    words = WIKITEXT.read_text().split() if WIKITEXT.is_file() else \
        "the quick brown fox jumps over the lazy dog while a river runs past the city".split() * 1000
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        target = rng.randint(lo, hi)
        start = rng.randrange(len(words) - 400)
        n = target
        while True:  # words until the text has `target` tokens with [CLS] and [SEP]
            text = " ".join(words[start:start + n])
            have = len(tokenizer(text)["input_ids"])
            if have <= target or n == 1:
                break
            n -= max(1, (have - target) // 2)
        texts.append(text)
    return texts


def throughput(embed, texts: list[str], batch: int) -> float:
    """Texts per second over all `texts`, `batch` at a time."""
    start = time.perf_counter()
    for i in range(0, len(texts), batch):
        embed(texts[i:i + batch])
    return len(texts) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", type=Path, required=True, help="all-MiniLM-L6-v2's folder")
    ap.add_argument("--q8-gguf", type=Path, default=None, help="llama.cpp's Q8_0 conversion of it")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--texts", type=int, default=128, help="texts a round at batch 32 (a quarter of it at batch 1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=RESULTS / "embeddings_minilm.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(args.folder), device="cpu")
    texts = make_texts(st.tokenizer, args.texts, 8, 254)
    lengths = [len(st.tokenizer(t)["input_ids"]) for t in texts]
    variants = {"sentence-transformers float32": lambda b: st.encode(b, batch_size=32)}
    for name, model, dtype in (("wallbreaker float32", args.folder, "float32"),
                               ("wallbreaker Q8_0 GGUF (auto)", args.q8_gguf, "auto"),
                               ("wallbreaker folder, auto (Q8_0 at load)", args.folder, "auto")):
        if model is not None:
            llm = LLM(model, dtype=dtype, num_threads=args.threads)
            variants[name] = llm.embed
    for embed in variants.values():  # warm up: first calls allocate, page in, pick kernels
        embed(texts[:32])
    rows = {(name, batch): [] for name in variants for batch in (1, 32)}
    for _ in range(args.rounds):
        for batch in (32, 1):
            for name, embed in variants.items():
                subset = texts if batch == 32 else texts[:len(texts) // 4]
                rows[(name, batch)].append(throughput(embed, subset, batch))
    facts = machine_facts(args.threads)
    base = {b: statistics.median(rows[("sentence-transformers float32", b)]) for b in (1, 32)}
    table = [[name, batch, statistics.median(v), f"{statistics.median(v) / base[batch]:.2f}x"]
             for (name, batch), v in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0]))]
    print(f"all-MiniLM-L6-v2, {len(texts)} texts of {min(lengths)}-{max(lengths)} tokens (mean "
          f"{statistics.mean(lengths):.0f}), {args.threads} threads; {describe_machine(facts)}\n")
    print(markdown_table(["variant", "batch", "texts/s (median)", "vs sentence-transformers"], table))
    write_json(args.json, {"machine": facts, "config": {k: str(v) for k, v in vars(args).items()},
                           "token_lengths": lengths,
                           "results": [{"variant": n, "batch": b, "texts_per_s": v} for (n, b), v in rows.items()]})
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
