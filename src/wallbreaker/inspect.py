"""`wallbreaker inspect`: what a model file holds and what decoding it costs in bytes."""
from __future__ import annotations

import json
from collections import Counter

from .formats import open_model


def describe(model: str | None, json_output: bool = False) -> str:
    files = open_model(model)
    cfg = files.config
    by_type: Counter[str] = Counter()
    bytes_by_type: Counter[str] = Counter()
    for w in files.weights.values():
        by_type[w.stored_type] += 1
        bytes_by_type[w.stored_type] += w.nbytes
    weight_bytes = files.weight_bytes
    kv_f32 = cfg.kv_bytes_per_token
    info = {
        "path": str(files.path), "format": files.format, "architecture": cfg.architecture,
        "layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size, "context_length": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta, "tied_output_head": cfg.tie_word_embeddings,
        "tensors": len(files.weights), "tensor_types": dict(by_type),
        "tensor_bytes_by_type": dict(bytes_by_type), "weight_bytes_stored": weight_bytes,
        "kv_bytes_per_token_float32": kv_f32,
        "bytes_read_per_decoded_token": {f"context {n}": weight_bytes + n * kv_f32 for n in (1, 512, 4096)},
    }
    if json_output:
        return json.dumps(info, indent=2)
    lines = [f"{files.path}  ({files.format})",
             f"  architecture   {cfg.architecture}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
             f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads, head dim {cfg.head_dim}, FFN {cfg.intermediate_size}",
             f"  vocabulary     {cfg.vocab_size}, context {cfg.max_position_embeddings}, RoPE base {cfg.rope_theta:g}, "
             f"{'tied' if cfg.tie_word_embeddings else 'separate'} output head",
             f"  tensors        {len(files.weights)}, {weight_bytes / 1e6:.1f} MB as stored"]
    for t, count in by_type.most_common():
        lines.append(f"    {t:<6} {count:4d} tensors  {bytes_by_type[t] / 1e6:9.1f} MB")
    lines.append(f"  KV cache       {kv_f32:,} bytes per token (float32)")
    lines.append("  read per decoded token (weights once + KV of the context, batch 1):")
    for label, b in info["bytes_read_per_decoded_token"].items():
        lines.append(f"    {label:<13} {b / 1e6:9.1f} MB")
    return "\n".join(lines)
