"""What a KV page dtype costs in perplexity: each model on its default path with bf16, int8 and fp8
pages (and float32 weights and pages, the exact path), beside llama.cpp's `llama-perplexity` with an
f16 cache and with `-ctk q8_0 -ctv q8_0 -fa on` (its int8 cache), on the same GGUF and text, where
llama-perplexity is found (--llama-cpp-dir, $LLAMA_CPP_DIR or PATH).

    .venv/bin/python benchmarks/kv_cache_perplexity.py --models smollm2 qwen2.5-coder-1.5b
"""
from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

from wallbreaker import LLM
from wallbreaker.measure.baselines.llama_cpp import LlamaCpp, LlamaCppError
from wallbreaker.measure.machine import describe_machine, machine_facts
from wallbreaker.measure.perplexity import perplexity
from wallbreaker.measure.reporting import bar_plot, markdown_table, write_json

RESULTS = Path(__file__).parent / "results"
TEXT = Path(__file__).parents[2] / "shared" / "data" / "wikitext-2" / "test.txt"
PATHS = {  # label: LLM options
    "float32": {"dtype": "float32", "kv_cache_dtype": "float32"},
    "auto (bf16 KV)": {},
    "auto, int8 KV": {"kv_cache_dtype": "int8"},
    "auto, fp8 KV": {"kv_cache_dtype": "fp8"},
}
LLAMA_CPP_PATHS = {"llama-perplexity (f16 KV)": (), "llama-perplexity -ctk q8_0 -ctv q8_0 -fa on":
                   ("-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on")}
BASE = "auto (bf16 KV)"


def measure(model: str, paths: list[str], text: Path, ctx: int, chunks: int,
            llama_cpp: LlamaCpp) -> list[dict]:
    rows, gguf = [], None
    for label in paths:
        llm = LLM(model, enable_prefix_caching=False, **PATHS[label])
        gguf = llm.model_path
        start = time.perf_counter()
        r = perplexity(llm, text.read_text(), ctx=ctx, chunks=chunks)
        rows.append({"model": gguf.name, "engine": "wallbreaker", "path": label, "ppl": r.ppl, "stderr": r.stderr,
                     "seconds": time.perf_counter() - start})
        print(f"{gguf.name} {label}: {r.line()}", flush=True)
        del llm
        gc.collect()
    for label, flags in LLAMA_CPP_PATHS.items():
        try:
            r = llama_cpp.perplexity(gguf, text, ctx, chunks, flags)
        except LlamaCppError as e:
            print(f"{gguf.name} {label}: not run ({e})", flush=True)
            continue
        rows.append({"model": gguf.name, "engine": "llama.cpp", "path": label, **r})
        print(f"{gguf.name} {label}: PPL = {r['ppl']:.4f} +/- {r['stderr']:.5f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2", "qwen2.5-coder-1.5b"])
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=40)
    ap.add_argument("--llama-cpp-dir", default=None)
    ap.add_argument("--json", type=Path, default=RESULTS / "perplexity_kv_cache_dtype.json")
    ap.add_argument("--plot", type=Path, default=RESULTS / "perplexity_kv_cache_dtype.png")
    args = ap.parse_args()
    facts = machine_facts()
    llama_cpp = LlamaCpp(args.llama_cpp_dir, threads=facts.get("threads") or 2)
    rows = [row for model in args.models
            for row in measure(model, args.paths, args.text, args.ctx, args.chunks, llama_cpp)]
    base = {r["model"]: r["ppl"] for r in rows if r["engine"] == "wallbreaker" and r["path"] == BASE}
    for r in rows:
        r["vs_auto"] = r["ppl"] / base[r["model"]] - 1 if r["model"] in base else None
    print(f"\n{args.chunks} windows of {args.ctx}, {args.text.name}; machine: {describe_machine(facts)}\n")
    print(markdown_table(["model", "engine", "path", "PPL", "±", f"vs {BASE}"],
                         [[r["model"], r["engine"], r["path"], f"{r['ppl']:.4f}", f"{r['stderr']:.3f}",
                           "" if r["vs_auto"] is None else f"{100 * r['vs_auto']:+.2f}%"] for r in rows]))
    write_json(args.json, {"date": time.strftime("%Y-%m-%d"), "file": str(args.text), "ctx": args.ctx,
                           "chunks": args.chunks, "machine": facts, "results": rows})
    print(f"wrote {args.json}")
    bar_plot({r["model"]: {f"{r['engine']}: {r['path']}": 100 * r["vs_auto"] for r in rows
                           if r["model"] == model and r["vs_auto"] is not None and r["path"] != BASE}
              for model in base}, args.plot, f"perplexity vs the default path (bf16 KV), {args.chunks} x {args.ctx}",
             dict.fromkeys(base, "% change"))


if __name__ == "__main__":
    main()
