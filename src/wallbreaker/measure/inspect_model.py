"""`wallbreaker inspect`: what a model file holds and what decoding it costs in bytes."""
from __future__ import annotations

import json
from collections import Counter

import torch

from ..config import KV_CACHE_DTYPES, EngineConfig
from ..formats import open_model
from ..kernels import K_TYPES
from ..kv.cache import kv_bytes_per_token
from ..models import generates
from .roofline import stored_bandwidth, stored_decode_cost

BOUND_BATCHES = (1, 8, 64)
BOUND_CONTEXTS = (128, 1024, 4096)
K_TYPE_NAMES = frozenset(t.name for t in K_TYPES)


def describe(model: str | None, json_output: bool = False) -> str:
    files = open_model(model)
    cfg = files.config
    by_type: Counter[str] = Counter()
    bytes_by_type: Counter[str] = Counter()
    for w in files.weights.values():
        by_type[w.stored_type] += 1
        bytes_by_type[w.stored_type] += w.nbytes
    weight_bytes = files.weight_bytes
    in_place, repacked, copied = _residence(files)
    kv_f32 = kv_bytes_per_token(cfg, torch.float32)
    kv_by_dtype = {name: kv_bytes_per_token(cfg, dtype) for name, dtype in KV_CACHE_DTYPES.items()}
    stored = stored_decode_cost(files, EngineConfig().kv_cache_torch_dtype)
    info = {
        "path": str(files.path), "format": files.format, "architecture": cfg.architecture,
        "layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size, "context_length": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta, "tied_output_head": cfg.tie_word_embeddings,
        "tensors": len(files.weights), "tensor_types": dict(by_type),
        "tensor_bytes_by_type": dict(bytes_by_type), "weight_bytes_stored": weight_bytes,
        "auto_path_weight_bytes": {"mapped_from_the_file": in_place, "mapped_from_the_repack_cache": repacked,
                                   "copied_into_memory": copied},
        "kv_bytes_per_token_float32": kv_f32, "kv_bytes_per_token": kv_by_dtype,
        "bytes_read_per_decoded_token": {f"context {n}": stored.bytes_per_step(1, n) for n in (1, 512, 4096)},
    }
    if cfg.is_recurrent:
        info["recurrent"] = _recurrent(cfg, stored)
    encoder = not generates(cfg.architecture)
    if encoder:  # it only pools: no KV cache, no decoding, absolute positions
        for key in ("rope_theta", "tied_output_head", "kv_bytes_per_token_float32", "kv_bytes_per_token",
                    "bytes_read_per_decoded_token"):
            info.pop(key)
        info["pooling"] = None if cfg.pooling is None else {"method": cfg.pooling.method, "task": cfg.pooling.task}
    if cfg.is_moe:
        info.update(experts=cfg.num_experts, experts_active_per_token=cfg.num_experts_per_tok,
                    expert_intermediate_size=cfg.expert_ffn, expert_bytes_stored=stored.expert_bytes,
                    weight_bytes_read_per_token=stored.weights_read(1))
    bandwidth = stored_bandwidth()
    if bandwidth and not encoder:
        info["decode_bound_tokens_per_s"] = _bounds(files, bandwidth)
    if json_output:
        return json.dumps(info, indent=2)
    lines = [f"{files.path}  ({files.format})",
             f"  architecture   {cfg.architecture}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
             f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads, head dim {cfg.head_dim}, FFN {cfg.intermediate_size}",
             f"  vocabulary     {cfg.vocab_size}, context {cfg.max_position_embeddings}, " + (
                 "absolute positions, an encoder: it pools (" + (info["pooling"] or {}).get("method", "?") + "), "
                 "with no KV cache and no decoding" if encoder else
                 f"RoPE base {cfg.rope_theta:g}, {'tied' if cfg.tie_word_embeddings else 'separate'} output head"),
             f"  tensors        {len(files.weights)}, {weight_bytes / 1e6:.1f} MB as stored"]
    if cfg.is_moe:
        lines.insert(2, f"  experts        {cfg.num_experts}, {cfg.num_experts_per_tok} active per token, FFN "
                        f"{cfg.expert_ffn}: {stored.expert_bytes / 1e6:.1f} MB, of which a token reads "
                        f"{stored.expert_bytes * stored.active_share / 1e6:.1f} MB")
    for t, count in by_type.most_common():
        lines.append(f"    {t:<6} {count:4d} tensors  {bytes_by_type[t] / 1e6:9.1f} MB")
    lines.append(f"  on the auto path: {in_place / 1e6:.1f} MB read in place from the file's mapping, "
                 f"{repacked / 1e6:.1f} MB from the repack cache's (as stored), {copied / 1e6:.1f} MB copied "
                 "(float tensors)")
    if encoder:
        return "\n".join(lines)
    lines.append("  KV cache       bytes per token: " + ", ".join(f"{b:,} ({name})" for name, b in kv_by_dtype.items())
                 + (f" ({cfg.num_attention_layers} attention layers of {cfg.num_layers})" if cfg.is_recurrent else ""))
    if cfg.is_recurrent:
        r = info["recurrent"]
        even = r["break_even_context"]
        lines.append(f"  state          {r['state_bytes_per_sequence']:,} bytes per sequence, float32, read and written "
                     f"every step" + (f": the K/V reads of {even:,.0f} positions (bfloat16)" if even else
                                      ": no KV cache at all"))
        lines.append(f"                 {r['sequences_per_gb']} sequences' states fit in 1 GB (each step also takes a "
                     "slot for its new state)")
    state = " + the recurrent state, read and written" if cfg.is_recurrent else ""
    lines.append(f"  read per decoded token (weights once, active experts only, + KV of the context in bfloat16{state}, "
                 "batch 1):" if cfg.is_moe else
                 f"  read per decoded token (weights once + KV of the context in bfloat16{state}, batch 1):")
    for label, b in info["bytes_read_per_decoded_token"].items():
        lines.append(f"    {label:<13} {b / 1e6:9.1f} MB")
    if bandwidth:
        bounds = info["decode_bound_tokens_per_s"]
        lines.append(f"  decode bound at {bounds['bandwidth_gb_per_s']:.1f} GB/s (stored by `wallbreaker roofline`), "
                     f"weights as stored, KV in {bounds['kv_dtype']}, tokens/s of the whole batch:")
        lines.append("    " + " " * 9 + "".join(f"{f'ctx {c}':>11}" for c in BOUND_CONTEXTS))
        for batch in BOUND_BATCHES:
            row = bounds[f"batch {batch}"]
            lines.append(f"    batch {batch:<3}" + "".join(f"{row[f'context {c}']:11.1f}" for c in BOUND_CONTEXTS))
    return "\n".join(lines)


def _recurrent(cfg, stored) -> dict:
    """A recurrent model's state against its KV cache: per sequence, how many positions of K/V
    reads its state's traffic is worth, and how many sequences' states (with the slot a step
    writes) fit in a gigabyte."""
    from ..kv.state_pool import slots_per_sequence
    state = cfg.state_bytes_per_sequence
    return {"state_bytes_per_sequence": state, "state_bytes_moved_per_step": 2 * state,
            "break_even_context": stored.break_even_context,
            "sequences_per_gb": int(2**30 // (state * (slots_per_sequence(0) - 1))) if state else None}


def _residence(files) -> tuple[int, int, int]:
    """Stored bytes the `auto` path reads from the model file's mapping (K-quant rows, in the file's
    order), from the repack cache's (every other matrix), and copies (vectors: norms, biases)."""
    in_place = repacked = copied = 0
    for w in files.weights.values():
        if len(w.shape) < 2:
            copied += w.nbytes
        elif w.blocks_mapped and w.stored_type in K_TYPE_NAMES:
            in_place += w.nbytes
        else:
            repacked += w.nbytes
    return in_place, repacked, copied


def _bounds(files, bandwidth: float) -> dict:
    """Memory-bound decode tokens/s with the KV cache in the dtype the default (`auto`) path keeps it in."""
    kv_dtype = EngineConfig().kv_cache_torch_dtype
    cost = stored_decode_cost(files, kv_dtype)
    out: dict = {"bandwidth_gb_per_s": bandwidth / 1e9, "kv_dtype": str(kv_dtype).removeprefix("torch.")}
    for batch in BOUND_BATCHES:
        out[f"batch {batch}"] = {f"context {c}": cost.memory_bound(bandwidth, batch, c) for c in BOUND_CONTEXTS}
    return out
