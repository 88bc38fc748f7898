"""Quantization quality: perplexity and size of each method at each width, on WikiText-2 test.

    nice -n 10 python benchmarks/quality.py --model smollm2 --chunks 40

For every configuration: quantize the model (its float32 weights, dequantized from the packaged
GGUF, are the full-precision reference) into a wallbreaker folder, load the folder back, and measure
`wallbreaker perplexity`'s figure (llama-perplexity's windows: ctx 512, second half scored). Results
accumulate in benchmarks/results/quality-<model>.json (a configuration already there is not redone
unless --redo); `--markdown` prints the table for BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from wallbreaker import LLM  # noqa: E402
from wallbreaker.formats.packaged import cache_dir  # noqa: E402
from wallbreaker.measure.perplexity import perplexity  # noqa: E402
from wallbreaker.quant.pipeline import QuantizeConfig  # noqa: E402
from wallbreaker.quant.run import quantize_to  # noqa: E402

TEST_FILE = ROOT.parent / "shared" / "data" / "wikitext-2" / "test.txt"
# name -> QuantizeConfig fields (group 128, asymmetric unless said)
CONFIGS: dict[str, dict] = {
    "rtn-8": dict(method="rtn", bits=8), "rtn-4": dict(method="rtn", bits=4), "rtn-3": dict(method="rtn", bits=3),
    "gptq-8": dict(method="gptq", bits=8), "gptq-4": dict(method="gptq", bits=4), "gptq-3": dict(method="gptq", bits=3),
    "awq-8": dict(method="awq", bits=8), "awq-4": dict(method="awq", bits=4), "awq-3": dict(method="awq", bits=3),
    "mixed-3.5": dict(method="mixed", bits=3.5), "mixed-4.5": dict(method="mixed", bits=4.5),
    "gptq-3-act": dict(method="gptq", bits=3, act_order=True),
    # mixed with RTN rounding and sensitivities on 2 sequences: what 2 cores afford on a 1.5B model
    "mixed-3.5-rtn": dict(method="mixed", bits=3.5, mixed_quantizer="rtn", sensitivity_samples=2),
    "mixed-4.5-rtn": dict(method="mixed", bits=4.5, mixed_quantizer="rtn", sensitivity_samples=2),
    # AWQ without llm-awq's range clipping (on by default: see quant/awq.py)
    "awq-3-noclip": dict(method="awq", bits=3, awq_clip=False),
}
# llama-perplexity -c 512 --chunks 40 on the same GGUF files: the llama.cpp rows of
# benchmarks/results/perplexity_kv_cache_dtype.json (benchmarks/kv_cache_perplexity.py --llama-cpp-dir)
PUBLISHED = {"smollm2": 19.0292, "qwen2.5-coder-1.5b": 12.3798}


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def measure(name: str, args: argparse.Namespace, work: Path) -> dict:
    text = TEST_FILE.read_text(encoding="utf-8") if args.file is None else Path(args.file).read_text(encoding="utf-8")
    row: dict = {"name": name}
    if name == "float":
        llm = LLM(args.model, dtype="float32", max_num_seqs=1)
        row.update(method="float", bits=32.0, file_bytes=None)
    else:
        cfg = QuantizeConfig(**CONFIGS[name], group_size=args.group_size, nsamples=args.nsamples, seqlen=args.seqlen,
                             seed=args.seed)
        out = work / name
        shutil.rmtree(out, ignore_errors=True)
        start = time.perf_counter()
        qm = quantize_to(args.model, out, cfg)
        row["quantize_s"] = round(time.perf_counter() - start, 1)
        llm = LLM(str(out), dtype="float32", max_num_seqs=1)
        quant = [w for w in llm.files.weights.values() if w.quant is not None]
        numel = sum(w.shape[0] * w.shape[1] for w in quant)
        row.update(method=cfg.method, bits=qm.average_bits, group_size=cfg.group_size, sym=cfg.sym,
                   act_order=cfg.act_order, file_bytes=folder_bytes(out),
                   linear_bytes=sum(w.nbytes for w in quant), linear_bits_per_weight=8 * sum(w.nbytes for w in quant) / numel)
        if cfg.method == "mixed":
            row["bits_per_tensor"] = qm.bits_per_tensor
            row["propagation_gains"] = qm.report["sensitivity"]["gains"]
        if cfg.method == "awq":
            row["awq_alpha"] = qm.report.get("awq_alpha")
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    result = perplexity(llm, text, ctx=args.ctx, chunks=args.chunks)
    row.update(result.to_dict(), perplexity_s=round(time.perf_counter() - start, 1))
    print(f"{name}: {result.line()}", file=sys.stderr)
    return row


def markdown(results: dict, model: str) -> str:
    rows = results["rows"]
    lines = ["| configuration | avg bits (codes) | bits/weight incl. scales | linear weights MB | folder MB | PPL | Δ vs float |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    base = rows.get("float", {}).get("ppl")
    order = ["float"] + [n for n in CONFIGS if n in rows]
    for name in order:
        r = rows.get(name)
        if r is None:
            continue
        delta = f"{r['ppl'] - base:+.3f}" if base and name != "float" else ""
        if name == "float":
            lines.append(f"| float32 (dequantized GGUF) | 32 | | | | {r['ppl']:.4f} ± {r['stderr']:.2f} | |")
            continue
        lines.append(f"| {name} | {r['bits']:.2f} | {r['linear_bits_per_weight']:.3f} | {r['linear_bytes'] / 1e6:.1f} | "
                     f"{r['file_bytes'] / 1e6:.1f} | {r['ppl']:.4f} ± {r['stderr']:.2f} | {delta} |")
    if model in PUBLISHED:
        lines.append(f"| llama.cpp `llama-perplexity` on the original GGUF (perplexity_kv_cache_dtype.json) | | | | | {PUBLISHED[model]} | |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--file", default=None, help="(default: WikiText-2 test.txt)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=40)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--nsamples", type=int, default=64)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", nargs="*", default=["float", *CONFIGS], help="(default: all)")
    p.add_argument("--redo", action="store_true", help="measure configurations already in the results again")
    p.add_argument("--keep", action="store_true", help="keep the quantized folders")
    p.add_argument("--markdown", action="store_true", help="only print the table of the saved results")
    p.add_argument("--out", default=None, help="(default: benchmarks/results/quality-<model>.json)")
    args = p.parse_args()
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"quality-{args.model}.json")
    results = json.loads(out.read_text()) if out.is_file() else {"rows": {}}
    if not args.markdown:
        results["settings"] = {k: getattr(args, k) for k in ("model", "ctx", "chunks", "group_size", "nsamples",
                                                             "seqlen", "seed")}
        results["command"] = (f"nice -n 10 python benchmarks/quality.py --model {args.model} --ctx {args.ctx} "
                              f"--chunks {args.chunks} --group-size {args.group_size} --nsamples {args.nsamples} "
                              f"--seqlen {args.seqlen} --seed {args.seed}")
        work = cache_dir() / "quality" / args.model
        work.mkdir(parents=True, exist_ok=True)
        measured: dict[str, dict] = {}
        for name in args.configs:
            if name in results["rows"] and not args.redo:
                continue
            measured[name] = measure(name, args, work)
            if out.is_file():  # rows another run wrote meanwhile stay
                results["rows"] = json.loads(out.read_text())["rows"]
            results["rows"].update(measured)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=1))
    print(markdown(results, args.model))


if __name__ == "__main__":
    main()
