"""Why a KV page dtype may fail on one model and hold on another: the spread of the keys' channels.

For each model, 256 tokens of WikiText-2 are prefilled into bfloat16 pages; the cached keys (after
RoPE, as attention reads them) are then measured: how far each channel's mean magnitude sits above
the median channel's (worst layer and head), and the relative RMS error of int8 rounding with one
scale per token and head (what `kv_cache_dtype="int8"` stores) against one scale per 32 channels
(llama.cpp's q8_0).

    .venv/bin/python benchmarks/kv_key_channels.py --models smollm2 qwen2.5-coder-1.5b
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from wallbreaker import LLM, SamplingParams
from wallbreaker.measure.reporting import markdown_table, write_json

RESULTS = Path(__file__).parent / "results"
TEXT = Path(__file__).parents[2] / "shared" / "data" / "wikitext-2" / "test.txt"


def int8_error(x: torch.Tensor, group: int) -> float:
    """Relative RMS error of symmetric int8 rounding with one scale per `group` channels."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    scale = g.abs().amax(-1, keepdim=True) / 127
    q = torch.round(g / scale.clamp_min(1e-12)).clamp(-127, 127) * scale
    return ((q - g).pow(2).mean() / g.pow(2).mean()).sqrt().item()


def measure(name: str, tokens: int) -> dict[str, float | str]:
    llm = LLM(name, kv_cache_dtype="bfloat16", kv_cache_memory_gb=0.25, enable_prefix_caching=False)
    ids = llm.tokenizer.encode(TEXT.read_text()[:20_000])[:tokens]
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    keys = llm.engine.runner.kv_cache.tensor[:, 0].float()  # [layers, kv_heads, slots, head_dim]
    keys = keys[:, :, keys.abs().amax(dim=(0, 1, 3)) > 0]  # the slots this prompt wrote
    channel = keys.abs().mean(2)  # [layers, kv_heads, head_dim]
    spread = (channel.amax(-1) / channel.median(-1).values).max().item()
    return {"model": name, "head_dim": keys.shape[-1], "channel_spread": spread,
            "int8_error_per_head": int8_error(keys, keys.shape[-1]), "int8_error_per_32": int8_error(keys, 32)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2", "qwen2.5-coder-1.5b"])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--json", type=Path, default=RESULTS / "kv_key_channels.json")
    args = ap.parse_args()
    rows = [measure(m, args.tokens) for m in args.models]
    print(markdown_table(["model", "head_dim", "largest channel / median channel", "int8 error, scale per head",
                          "int8 error, scale per 32"],
                         [[r["model"], r["head_dim"], f"{r['channel_spread']:.1f}x", f"{r['int8_error_per_head']:.4f}",
                           f"{r['int8_error_per_32']:.4f}"] for r in rows]))
    write_json(args.json, {"tokens": args.tokens, "results": rows})
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
