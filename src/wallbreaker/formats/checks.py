"""Which tensors a config reads, by canonical name and shape, and the check that a model's files
hold exactly those (formats/families.py says what differs by family)."""
from __future__ import annotations

from ..config import ModelConfig
from ..errors import ModelFormatError
from .families import family
from .lfm2 import conv_layer_tensors
from .names import FUSED_GATE_UP, FUSED_QKV
from .weights import WeightRef, row_view


def split_fused(source: str, cfg: ModelConfig, weights: dict[str, WeightRef]) -> None:
    """Phi-3's fused projections, `blk.N.attn_qkv.weight` and `blk.N.ffn_gate_up.weight`, replaced in
    place by row views under the separate projections' names (which the model and the checks read).
    (Qwen3-Next's `attn_qkv` is its delta net's q/k/v, read as it is.)"""
    if not family(cfg.architecture).split_fused:
        return
    q, kv, ff = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        for fused, parts in ((FUSED_QKV, (("attn_q.weight", q), ("attn_k.weight", kv), ("attn_v.weight", kv))),
                             (FUSED_GATE_UP, (("ffn_gate.weight", ff), ("ffn_up.weight", ff)))):
            ref = weights.pop(p + fused, None)
            if ref is None:
                continue
            rows = sum(n for _, n in parts)
            if len(ref.shape) != 2 or ref.shape[0] != rows:
                raise ModelFormatError(f"{source}: tensor {ref.name!r} has shape {tuple(ref.shape)}, expected "
                                       f"({rows}, {cfg.hidden_size})")
            lo = 0
            for name, n in parts:
                if p + name in weights:
                    raise ModelFormatError(f"{source}: tensor {p + name!r} is stored both fused in {ref.name!r} "
                                           f"and on its own")
                weights[p + name] = row_view(ref, p + name, lo, lo + n)
                lo += n


def layer_tensors(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Every tensor layer i of `cfg` reads, canonical name -> shape."""
    spec = family(cfg.architecture)
    if spec.layer_tensors is not None:
        return spec.layer_tensors(cfg, i)
    h, q, kv, ff = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    p = f"blk.{i}."
    expected = {p + "attn_norm.weight": (h,), p + "ffn_norm.weight": (h,)}
    if cfg.is_attention(i):
        expected.update({p + "attn_q.weight": (q, h), p + "attn_k.weight": (kv, h), p + "attn_v.weight": (kv, h),
                         p + "attn_output.weight": (h, q)})
    elif cfg.layer_types[i] == "conv":
        expected.update(conv_layer_tensors(h, cfg.conv_kernel, p))
    if cfg.is_moe:
        e, eff = cfg.num_experts, cfg.expert_ffn
        expected.update({p + "ffn_gate_inp.weight": (e, h), p + "ffn_gate_exps.weight": (e, eff, h),
                         p + "ffn_up_exps.weight": (e, eff, h), p + "ffn_down_exps.weight": (e, h, eff)})
    else:
        expected.update({p + "ffn_gate.weight": (ff, h), p + "ffn_up.weight": (ff, h), p + "ffn_down.weight": (h, ff)})
    if cfg.qkv_bias:
        expected.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,)})
    if cfg.qk_norm and cfg.is_attention(i):
        expected.update({p + "attn_q_norm.weight": (cfg.head_dim,), p + "attn_k_norm.weight": (cfg.head_dim,)})
    if cfg.sandwich_norm:
        expected.update({p + "post_attention_norm.weight": (h,), p + "post_ffw_norm.weight": (h,)})
    return expected


def top_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    top = {"token_embd.weight": (cfg.vocab_size, cfg.hidden_size), family(cfg.architecture).final_norm: (cfg.hidden_size,)}
    if not cfg.tie_word_embeddings:
        top["output.weight"] = (cfg.vocab_size, cfg.hidden_size)
    if cfg.pooling is not None and cfg.pooling.task == "score":  # a decoder cross-encoder's head
        top["cls.output.weight"] = (cfg.num_labels, cfg.hidden_size)
    return top


def check_weights(source: str, cfg: ModelConfig, weights: dict[str, WeightRef]) -> None:
    """Every tensor the architecture reads must be there with the shape the metadata implies, and
    every tensor there must be one it reads: a tensor nothing would read means a model we would
    run wrong (an unknown bias, a norm of another architecture), so it is refused, named.

    Checked layer by layer, so that memory stays bounded whatever `num_layers` claims; a layer
    count the tensors cannot hold is refused before any layer is looked at."""
    per_layer = 6 + (4 if cfg.is_moe else 3) + 3 * cfg.qkv_bias + 2 * cfg.qk_norm + 2 * cfg.sandwich_norm
    if cfg.is_recurrent:  # a recurrent layer's tensors differ; every layer has its two norms
        per_layer = 2
    if cfg.num_layers * per_layer > len(weights):
        raise ModelFormatError(f"{source}: {cfg.num_layers} layers need at least {cfg.num_layers * per_layer} "
                               f"tensors but the model has {len(weights)}")

    def check(expected: dict[str, tuple[int, ...]]) -> None:
        for name, shape in expected.items():
            if name not in weights:
                raise ModelFormatError(f"{source}: missing tensor {name!r}")
            if tuple(weights[name].shape) != shape:
                raise ModelFormatError(
                    f"{source}: tensor {name!r} has shape {tuple(weights[name].shape)}, expected {shape}")

    top = top_tensors(cfg)
    check(top)
    used = len(top)
    for i in range(cfg.num_layers):
        expected = layer_tensors(cfg, i)
        check(expected)
        used += len(expected)
    if used != len(weights):  # every expected name is there, so the rest are extra
        known = set(top).union(*(layer_tensors(cfg, i) for i in range(cfg.num_layers)))
        extra = sorted(n for n in weights if n not in known)
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ModelFormatError(f"{source}: tensor {extra[0]!r} is not used by the "
                               f"{family(cfg.architecture).describe(cfg)} "
                               f"architecture{more}; refusing to run the model without it")
