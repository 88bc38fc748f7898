"""RWKV-7 ("Goose") files (config.json `rwkv7`, fla-hub's RWKV7ForCausalLM layout; GGUF `rwkv7`) ->
ModelConfig and canonical weights, as its entry in formats/families.py reads them.

Canonical names and layouts are what llama.cpp's converter writes (conversion/rwkv.py `Rwkv7Model`):
`token_embd_norm` (layer 0's pre-norm, on the embeddings), per layer `attn_norm` and `attn_norm_2`
(LayerNorms with bias), `time_mix_lerp_fused.weight` [6, 1, 1, hidden] (the token-shift mixes of r, w,
k, v, a, g stacked), the low-rank pairs `time_mix_{w,a,v,g}1.weight` [rank, hidden] and `...2.weight`
[hidden, rank] with the vectors `time_mix_{w,a,v}0.weight` (the pairs' second bias), `time_mix_k_k`,
`time_mix_k_a`, `time_mix_r_k` (flattened), the projections `time_mix_{receptance,key,value,output}`,
the group norm `time_mix_ln`, and the channel mix `channel_mix_lerp_k`, `channel_mix_key`,
`channel_mix_value`; `output_norm` has a bias. Layer 0 has no value-residual pair (its value is the
one the others mix in); the converter writes copies of its `a` pair there, which are dropped here.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, ModelConfig, short_repr
from ..errors import ModelFormatError, UnsupportedModelError
from .config_keys import own_gguf_keys
from .weights import WeightRef

LERPS = "rwkvag"  # the order of time_mix_lerp_fused's rows
LORAS = "wavg"  # decay, in-context learning rate, value residual, gate: ModelConfig.rwkv_lora_ranks' order
_HF_REFUSED = {"hidden_act": ("sqrelu",), "norm_first": (True,), "norm_bias": (True,), "fuse_norm": (False, True),
               "wkv_has_gate": (True,)}
_HF_DEFAULT_RANKS = ((0.5, 1.8), (0.5, 1.8), (0.5, 1.3), (0.8, 0.6))  # the converter's rank rule, per LORAS


def _rank_rule(hidden: int, exponent: float, multiplier: float) -> int:
    return max(1, round(hidden ** exponent * multiplier / 32)) * 32


def _config(where: str, arch: str, **kw: Any) -> ModelConfig:
    layers, hidden, head = kw.pop("layers"), kw.pop("hidden"), kw.pop("head_size")
    try:
        if not (isinstance(head, int) and isinstance(hidden, int) and head > 0 and hidden % head == 0):
            raise ModelFormatError(f"{where}: the head size {short_repr(head)} must divide the hidden size "
                                   f"{short_repr(hidden)}")
        return ModelConfig(
            architecture=arch, hidden_size=hidden, num_layers=layers, num_heads=hidden // head,
            num_kv_heads=hidden // head, head_dim=head, max_position_embeddings=1 << 20,
            layer_types=("rwkv7",) * layers if isinstance(layers, int) and 0 < layers <= 1 << 16 else (), **kw)
    except ConfigError as e:
        raise ModelFormatError(f"{where}: {e.field}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"{where}: {e}") from None


def config_from_hf(hf: dict[str, Any], path: Path, arch: str) -> ModelConfig:
    where = f"{path}/config.json"
    for key, harmless in _HF_REFUSED.items():
        if key in hf and hf[key] not in harmless:
            raise UnsupportedModelError(f"{where}: {key} {short_repr(hf[key])} is not supported")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if key not in hf:
            raise ModelFormatError(f"{where}: missing key {key!r}")
    hidden = hf["hidden_size"]
    usable = isinstance(hidden, int) and not isinstance(hidden, bool) and hidden > 0
    if hf.get("attn") is not None:
        raise UnsupportedModelError(f"{where}: attn {short_repr(hf['attn'])} (attention layers among the RWKV-7 "
                                    f"ones) is not supported")
    value_dim = hf.get("value_dim")
    if value_dim is not None and any(d != hidden for d in (value_dim if isinstance(value_dim, list) else [value_dim])):
        raise UnsupportedModelError(f"{where}: value_dim {short_repr(value_dim)} other than hidden_size is not supported")
    ranks = []
    for name, (exponent, multiplier) in zip(("decay", "a", "v", "gate"), _HF_DEFAULT_RANKS):
        given = hf.get(f"{name}_low_rank_dim")
        ranks.append(given if given is not None else _rank_rule(hidden, exponent, multiplier) if usable else 0)
    eos = hf.get("eos_token_id")
    inner = hf.get("intermediate_size")
    return _config(where, arch, vocab_size=hf["vocab_size"], hidden=hidden, layers=hf["num_hidden_layers"],
                   head_size=hf.get("head_dim", hf.get("head_size", 64)),
                   intermediate_size=inner if inner is not None else (4 * hidden if usable else hidden),
                   rms_norm_eps=float(hf.get("norm_eps", hf.get("layer_norm_epsilon", 1e-5))),
                   tie_word_embeddings=hf.get("tie_word_embeddings", False), bos_token_id=hf.get("bos_token_id"),
                   eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
                   rwkv_lora_ranks=tuple(ranks))


def hf_tensor_names(num_layers: int) -> dict[str, str]:
    """HF name -> canonical name; the six token-shift mixes go to `time_mix_lerp_<x>`, stacked into
    `time_mix_lerp_fused` by `canonical_hf_weights`."""
    table = {"model.embeddings.weight": "token_embd.weight", "lm_head.weight": "output.weight",
             "model.norm.weight": "output_norm.weight", "model.norm.bias": "output_norm.bias",
             "model.layers.0.pre_norm.weight": "token_embd_norm.weight",
             "model.layers.0.pre_norm.bias": "token_embd_norm.bias"}
    per_layer = {"attn_norm.weight": "attn_norm.weight", "attn_norm.bias": "attn_norm.bias",
                 "ffn_norm.weight": "attn_norm_2.weight", "ffn_norm.bias": "attn_norm_2.bias",
                 "attn.k_k": "time_mix_k_k.weight", "attn.k_a": "time_mix_k_a.weight", "attn.r_k": "time_mix_r_k.weight",
                 "attn.r_proj.weight": "time_mix_receptance.weight", "attn.k_proj.weight": "time_mix_key.weight",
                 "attn.v_proj.weight": "time_mix_value.weight", "attn.o_proj.weight": "time_mix_output.weight",
                 "attn.g_norm.weight": "time_mix_ln.weight", "attn.g_norm.bias": "time_mix_ln.bias",
                 "ffn.x_k": "channel_mix_lerp_k.weight", "ffn.key.weight": "channel_mix_key.weight",
                 "ffn.value.weight": "channel_mix_value.weight",
                 **{f"attn.x_{x}": f"time_mix_lerp_{x}" for x in LERPS}}
    for x in LORAS:
        per_layer[f"attn.{x}_lora.lora.0.weight"] = f"time_mix_{x}1.weight"
        per_layer[f"attn.{x}_lora.lora.2.weight"] = f"time_mix_{x}2.weight"
        if x != "g":
            per_layer[f"attn.{x}_lora.lora.2.bias"] = f"time_mix_{x}0.weight"
    for i in range(num_layers):
        for hf, gg in per_layer.items():
            if not (i == 0 and hf.startswith("attn.v_lora")):
                table[f"model.layers.{i}.{hf}"] = f"blk.{i}.{gg}"
    return table


HF_UNREAD = ("model.layers.0.attn.v_lora.",)  # unused placeholders some folders have


def _transformed(ref: WeightRef, shape: tuple[int, ...], fn) -> WeightRef:
    return WeightRef(ref.name, shape, ref.stored_type, ref.nbytes, lambda: fn(ref.load()))


def canonical_hf_weights(source: str, cfg: ModelConfig, weights: dict[str, WeightRef]) -> None:
    """A folder's tensors brought in place to the converter's form: vectors flattened, the six
    token-shift mixes stacked."""
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        for name in ("time_mix_k_k.weight", "time_mix_k_a.weight", "time_mix_r_k.weight", "channel_mix_lerp_k.weight"):
            ref = weights.get(p + name)
            if ref is not None and len(ref.shape) != 1:
                weights[p + name] = _transformed(ref, (math.prod(ref.shape),), torch.flatten)
        parts = [weights.pop(p + f"time_mix_lerp_{x}", None) for x in LERPS]
        if all(r is not None for r in parts):
            sizes = {math.prod(r.shape) for r in parts}
            if len(sizes) != 1:
                raise ModelFormatError(f"{source}: layer {i}'s token-shift mixes x_r..x_g differ in size")
            size = sizes.pop()
            weights[p + "time_mix_lerp_fused.weight"] = WeightRef(
                p + "time_mix_lerp_fused.weight", (len(LERPS), 1, 1, size), parts[0].stored_type,
                sum(r.nbytes for r in parts),
                lambda parts=parts: torch.stack([r.load().reshape(1, 1, -1) for r in parts]))
        elif any(r is not None for r in parts):
            raise ModelFormatError(f"{source}: layer {i} has only some of the token-shift mixes x_r..x_g")


def drop_first_value_pair(cfg: ModelConfig, weights: dict[str, WeightRef]) -> None:
    """The converter's placeholders for layer 0's value-residual pair (copies of its `a` pair)."""
    for name in ("time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight"):
        weights.pop("blk.0." + name, None)


def layer_tensors(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Every tensor layer i reads, canonical name -> shape (layer 0 also the embeddings' norm and the
    final norm's bias, which the common check does not know)."""
    h, p = cfg.hidden_size, f"blk.{i}."
    expected = {p + "attn_norm.weight": (h,), p + "attn_norm.bias": (h,), p + "attn_norm_2.weight": (h,),
                p + "attn_norm_2.bias": (h,), p + "time_mix_lerp_fused.weight": (len(LERPS), 1, 1, h),
                p + "time_mix_k_k.weight": (h,), p + "time_mix_k_a.weight": (h,), p + "time_mix_r_k.weight": (h,),
                p + "time_mix_ln.weight": (h,), p + "time_mix_ln.bias": (h,), p + "channel_mix_lerp_k.weight": (h,),
                p + "channel_mix_key.weight": (cfg.intermediate_size, h),
                p + "channel_mix_value.weight": (h, cfg.intermediate_size),
                **{p + f"time_mix_{proj}.weight": (h, h) for proj in ("receptance", "key", "value", "output")}}
    for x, rank in zip(LORAS, cfg.rwkv_lora_ranks):
        if x == "v" and i == 0:
            continue
        expected.update({p + f"time_mix_{x}1.weight": (rank, h), p + f"time_mix_{x}2.weight": (h, rank)})
        if x != "g":
            expected[p + f"time_mix_{x}0.weight"] = (h,)
    if i == 0:
        expected.update({"token_embd_norm.weight": (h,), "token_embd_norm.bias": (h,), "output_norm.bias": (h,)})
    return expected


# --- GGUF ---------------------------------------------------------------------------------

_GGUF_KEYS = frozenset({"vocab_size", "context_length", "embedding_length", "block_count", "feed_forward_length",
                        "attention.head_count", "attention.layer_norm_epsilon", "wkv.head_size",
                        "attention.decay_lora_rank", "attention.iclr_lora_rank",
                        "attention.value_residual_mix_lora_rank", "attention.gate_lora_rank", "token_shift_count"})
_GGUF_RANKS = ("decay_lora_rank", "iclr_lora_rank", "value_residual_mix_lora_rank", "gate_lora_rank")


def config_from_gguf(gf) -> ModelConfig:
    """llama.cpp's `rwkv7` keys -> ModelConfig."""
    name, arch = gf.path.name, gf.get("general.architecture")
    a = f"{arch}."
    value = own_gguf_keys(gf, _GGUF_KEYS)
    if value("token_shift_count", int, 2) != 2:
        raise UnsupportedModelError(f"{name}: metadata {a}token_shift_count {gf.get(a + 'token_shift_count')} "
                                    f"is not supported (RWKV-7 shifts twice a layer)")
    if a + "attention.gate_lora_rank" not in gf.metadata:
        raise UnsupportedModelError(f"{name}: an RWKV-7 without the output gate ({a}attention.gate_lora_rank) "
                                    f"is not supported")
    layers = value("block_count", int)
    if layers > len(gf.tensors):
        raise ModelFormatError(f"{name}: metadata {a}block_count is {layers} but the file has only "
                               f"{len(gf.tensors)} tensors")
    embed = gf.tensors.get("token_embd.weight")
    eos = gf.get("tokenizer.ggml.eos_token_id")
    return _config(name, arch, vocab_size=int(embed.shape[0]) if embed is not None else value("vocab_size", int),
                   hidden=value("embedding_length", int), layers=layers, head_size=value("wkv.head_size", int),
                   intermediate_size=value("feed_forward_length", int),
                   rms_norm_eps=float(value("attention.layer_norm_epsilon", (int, float), 1e-5)),
                   tie_word_embeddings="output.weight" not in gf.tensors,
                   bos_token_id=gf.get("tokenizer.ggml.bos_token_id"), eos_token_ids=() if eos is None else (eos,),
                   rwkv_lora_ranks=tuple(value("attention." + k, int) for k in _GGUF_RANKS))


def add_gguf_keys(writer, c: ModelConfig) -> None:
    """The keys llama.cpp's converter writes for `rwkv7` (and `config_from_gguf` reads)."""
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_layers)
    writer.add_layer_norm_eps(c.rms_norm_eps)
    writer.add_wkv_head_size(c.head_dim)
    decay, iclr, value, gate = c.rwkv_lora_ranks
    writer.add_decay_lora_rank(decay)
    writer.add_iclr_lora_rank(iclr)
    writer.add_value_residual_mix_lora_rank(value)
    writer.add_gate_lora_rank(gate)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(0)
