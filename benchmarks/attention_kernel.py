"""The paged attention kernel alone, one decode step of one layer: --seqs sequences of --ctx cached
tokens each, one query each, for each KV page dtype. Reports the median time of a call and the KV
bytes it reads per second (pages and scales), which is what int8 and fp8 pages halve.

    .venv/bin/python benchmarks/attention_kernel.py --heads 9,3,64 --ctx 1000 4000
    WALLBREAKER_CPU_ISA=avx2 .venv/bin/python benchmarks/attention_kernel.py
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from wallbreaker import _C
from wallbreaker.measure.machine import describe_machine, machine_facts, timed
from wallbreaker.measure.reporting import bar_plot, markdown_table, write_json

RESULTS = Path(__file__).parent / "results"
QUANTIZED = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


def pages(kind: str, kv_heads: int, slots: int, head_dim: int, g: torch.Generator):
    """Random K or V pages of `kind` ([kv_heads, slots, head_dim]) and their scales or None."""
    x = torch.randn(kv_heads, slots, head_dim, generator=g)
    if kind not in QUANTIZED:
        return x.to(getattr(torch, kind)), None
    dtype, top = QUANTIZED[kind]
    scale = x.abs().amax(-1) / top
    return (x / scale[..., None]).round().clamp(-top, top).to(dtype) if kind == "int8" else \
        (x / scale[..., None]).to(dtype), scale


def measure(kind: str, heads: tuple[int, int, int], seqs: int, ctx: int, block_size: int, repeats: int) -> dict:
    H, KVH, D = heads
    g = torch.Generator().manual_seed(0)
    blocks = -(-ctx // block_size)
    k, k_scale = pages(kind, KVH, seqs * blocks * block_size, D, g)
    v, v_scale = pages(kind, KVH, seqs * blocks * block_size, D, g)
    tables = torch.randperm(seqs * blocks, generator=g).to(torch.int32).view(seqs, blocks)  # scattered blocks
    query_start = torch.arange(seqs + 1, dtype=torch.int32)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    q = torch.randn(seqs, H, D, generator=g)
    seconds = statistics.median(timed(lambda: _C.paged_attention(q, k, v, k_scale, v_scale, None, None, tables, query_start, lens,
                                                   block_size, D ** -0.5, 0, 0.0), repeats))
    row = D * k.element_size() + (4 if k_scale is not None else 0)
    read = 2 * seqs * KVH * ctx * row
    return {"kv_dtype": kind, "heads": list(heads), "seqs": seqs, "ctx": ctx, "us": seconds * 1e6,
            "kv_bytes": read, "gb_per_s": read / seconds / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-dtypes", nargs="+", default=["bfloat16", "int8", "fp8"])
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head_dim (SmolLM2: 9,3,64)")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--ctx", type=int, nargs="+", default=[1000, 4000])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", type=Path, default=RESULTS / "attention_kernel.json")
    ap.add_argument("--plot", type=Path, default=RESULTS / "attention_kernel.png")
    args = ap.parse_args()
    heads = tuple(int(x) for x in args.heads.split(","))
    facts = machine_facts()
    rows = [measure(kind, heads, args.seqs, ctx, args.block_size, args.repeats)
            for ctx in args.ctx for kind in args.kv_dtypes]
    base = {r["ctx"]: r["us"] for r in rows if r["kv_dtype"] == args.kv_dtypes[0]}
    print(f"heads {heads}, {args.seqs} sequences, one query each; {describe_machine(facts)}\n")
    print(markdown_table(["ctx", "KV pages", "µs a call", "KV GB/s", f"speed vs {args.kv_dtypes[0]}"],
                         [[r["ctx"], r["kv_dtype"], r["us"], r["gb_per_s"], f"{base[r['ctx']] / r['us']:.2f}x"]
                          for r in rows]))
    write_json(args.json, {"machine": facts, "config": {k: str(v) for k, v in vars(args).items()}, "results": rows})
    bar_plot({f"ctx {ctx}": {r["kv_dtype"]: r["us"] for r in rows if r["ctx"] == ctx} for ctx in args.ctx},
             args.plot, f"paged attention, heads {heads}, {args.seqs} sequences", dict.fromkeys(
                 [f"ctx {c}" for c in args.ctx], "µs a call"))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
