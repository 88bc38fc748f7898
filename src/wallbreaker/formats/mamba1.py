"""Mamba (v1) and Falcon-Mamba files (config.json `mamba`, `falcon_mamba`; GGUF `mamba`) -> ModelConfig
and canonical weights, as their entry in formats/families.py reads them.

Canonical names and layouts are what llama.cpp's converter writes (conversion/mamba.py `MambaModel`):
`blk.N.ssm_in.weight` [2 intermediate, hidden] (x rows, then z), `ssm_conv1d.weight` [intermediate, K]
(HF's [intermediate, 1, K] squeezed) and `.bias`, `ssm_x.weight` [rank + 2 d_state, intermediate],
`ssm_dt.weight` [intermediate, rank] and `.bias`, `ssm_a` [intermediate, d_state] holding
A = -exp(A_log), `ssm_d` [intermediate], `ssm_out.weight`. Falcon-Mamba is GGUF `mamba` with
`ssm.dt_b_c_rms` true; a GGUF has one epsilon, for the layer norms and the time step's, B's and C's.
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

# config.json keys read here or harmless (the time step's initialisation, the scan's implementation)
_KNOWN = {"vocab_size", "hidden_size", "state_size", "num_hidden_layers", "layer_norm_epsilon", "expand",
          "conv_kernel", "use_bias", "use_conv_bias", "hidden_act", "time_step_rank", "time_step_scale",
          "time_step_min", "time_step_max", "time_step_init_scheme", "time_step_floor", "residual_in_fp32",
          "rescale_prenorm_residual", "intermediate_size", "mixer_rms_eps", "use_mambapy", "use_falcon_mambapy",
          "use_associative_scan"}
_REFUSED = {"use_bias": (False, None), "hidden_act": ("silu", None)}


def config_from_hf(hf: dict[str, Any], path: Path, arch: str) -> ModelConfig:
    where = f"{path}/config.json"
    for key, harmless in _REFUSED.items():
        if key in hf and hf[key] not in harmless:
            raise UnsupportedModelError(f"{where}: {key} {short_repr(hf[key])} is not supported")
    unknown = sorted(k for k in hf if k.startswith(("mamba_", "ssm_", "time_step_", "mixer_")) and k not in _KNOWN)
    if unknown:
        raise UnsupportedModelError(f"{where}: {unknown[0]} is not supported")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if key not in hf:
            raise ModelFormatError(f"{where}: missing key {key!r}")
    hidden, layers = hf["hidden_size"], hf["num_hidden_layers"]
    usable = isinstance(hidden, int) and not isinstance(hidden, bool)
    inner = hf.get("intermediate_size") or (hf.get("expand", 2) * hidden if usable else hidden)
    rank = hf.get("time_step_rank", "auto")
    if rank == "auto":
        rank = math.ceil(hidden / 16) if usable else hidden
    eos = hf.get("eos_token_id")
    falcon = hf.get("model_type") == "falcon_mamba"
    try:
        return ModelConfig(
            architecture=arch, vocab_size=hf["vocab_size"], hidden_size=hidden, intermediate_size=inner,
            num_layers=layers, num_heads=1, num_kv_heads=1, head_dim=inner if isinstance(inner, int) else 2,
            rms_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), max_position_embeddings=1 << 20,
            tie_word_embeddings=hf.get("tie_word_embeddings", True), bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            layer_types=("mamba",) * layers if isinstance(layers, int) and 0 < layers <= 1 << 16 else (),
            ssm_state_size=hf.get("state_size", 16), ssm_conv_kernel=hf.get("conv_kernel", 4),
            ssm_conv_bias=hf.get("use_conv_bias", True), ssm_time_step_rank=rank,
            ssm_bc_norm_eps=float(hf.get("mixer_rms_eps", 1e-6)) if falcon else None)
    except ConfigError as e:
        raise ModelFormatError(f"{where}: {e.field}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"{where}: {e}") from None


def hf_tensor_names(num_layers: int) -> dict[str, str]:
    """HF name -> canonical (GGUF) name of every Mamba tensor."""
    table = {"backbone.embeddings.weight": "token_embd.weight", "backbone.norm_f.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"norm.weight": "attn_norm.weight", "mixer.in_proj.weight": "ssm_in.weight",
                 "mixer.conv1d.weight": "ssm_conv1d.weight", "mixer.conv1d.bias": "ssm_conv1d.bias",
                 "mixer.x_proj.weight": "ssm_x.weight", "mixer.dt_proj.weight": "ssm_dt.weight",
                 "mixer.dt_proj.bias": "ssm_dt.bias", "mixer.A_log": "ssm_a", "mixer.D": "ssm_d",
                 "mixer.out_proj.weight": "ssm_out.weight"}
    for i in range(num_layers):
        for hf, gg in per_layer.items():
            table[f"backbone.layers.{i}.{hf}"] = f"blk.{i}.{gg}"
    return table


def _transformed(ref: WeightRef, shape: tuple[int, ...], fn) -> WeightRef:
    return WeightRef(ref.name, shape, ref.stored_type, ref.nbytes, lambda: fn(ref.load()))


def canonical_hf_weights(source: str, cfg: ModelConfig, weights: dict[str, WeightRef]) -> None:
    """A folder's tensors brought in place to the converter's form: A_log to A, the convolution squeezed."""
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        if p + "ssm_a" in weights:
            ref = weights[p + "ssm_a"]
            weights[p + "ssm_a"] = _transformed(ref, tuple(ref.shape), lambda w: -torch.exp(w))
        conv = weights.get(p + "ssm_conv1d.weight")
        if conv is not None and len(conv.shape) == 3 and conv.shape[1] == 1:
            weights[p + "ssm_conv1d.weight"] = _transformed(conv, (conv.shape[0], conv.shape[2]),
                                                            lambda w: w.reshape(w.shape[0], -1))


def layer_tensors(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Every tensor layer i reads, canonical name -> shape."""
    h, d, n, r, p = cfg.hidden_size, cfg.intermediate_size, cfg.ssm_state_size, cfg.ssm_time_step_rank, f"blk.{i}."
    expected = {p + "attn_norm.weight": (h,), p + "ssm_in.weight": (2 * d, h),
                p + "ssm_conv1d.weight": (d, cfg.ssm_conv_kernel), p + "ssm_conv1d.bias": (d,),
                p + "ssm_x.weight": (r + 2 * n, d), p + "ssm_dt.weight": (d, r), p + "ssm_dt.bias": (d,),
                p + "ssm_a": (d, n), p + "ssm_d": (d,), p + "ssm_out.weight": (h, d)}
    if not cfg.ssm_conv_bias:
        del expected[p + "ssm_conv1d.bias"]
    return expected


# --- GGUF ---------------------------------------------------------------------------------

_GGUF_KEYS = frozenset({"vocab_size", "context_length", "embedding_length", "block_count", "feed_forward_length",
                        "attention.head_count", "attention.layer_norm_rms_epsilon", "ssm.conv_kernel",
                        "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank", "ssm.dt_b_c_rms"})


def config_from_gguf(gf) -> ModelConfig:
    """llama.cpp's `mamba` keys -> ModelConfig."""
    name, arch = gf.path.name, gf.get("general.architecture")
    value = own_gguf_keys(gf, _GGUF_KEYS)

    layers = value("block_count", int)
    if layers > len(gf.tensors):
        raise ModelFormatError(f"{name}: metadata {arch}.block_count is {layers} but the file has only "
                               f"{len(gf.tensors)} tensors")
    inner = value("ssm.inner_size", int)
    embed = gf.tensors.get("token_embd.weight")
    eos = gf.get("tokenizer.ggml.eos_token_id")
    eps = float(value("attention.layer_norm_rms_epsilon", (int, float), 1e-5))
    try:
        return ModelConfig(
            architecture=arch, vocab_size=int(embed.shape[0]) if embed is not None else value("vocab_size", int),
            hidden_size=value("embedding_length", int), intermediate_size=inner, num_layers=layers, num_heads=1,
            num_kv_heads=1, head_dim=inner, rms_norm_eps=eps, max_position_embeddings=value("context_length", int, 1 << 20),
            tie_word_embeddings="output.weight" not in gf.tensors, bos_token_id=gf.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (eos,), layer_types=("mamba",) * layers,
            ssm_state_size=value("ssm.state_size", int), ssm_conv_kernel=value("ssm.conv_kernel", int),
            ssm_conv_bias=layers == 0 or "blk.0.ssm_conv1d.bias" in gf.tensors,
            ssm_time_step_rank=value("ssm.time_step_rank", int),
            ssm_bc_norm_eps=eps if value("ssm.dt_b_c_rms", bool, False) else None)
    except ConfigError as e:
        raise ModelFormatError(f"{name}: {e.field}: {e}") from None


def add_gguf_keys(writer, c: ModelConfig) -> None:
    """The keys llama.cpp's converter writes for `mamba` (and `config_from_gguf` reads)."""
    if c.ssm_bc_norm_eps not in (None, c.rms_norm_eps):
        raise ValueError(f"a GGUF has one epsilon: Falcon-Mamba's mixer norms' ({c.ssm_bc_norm_eps}) must be the "
                         f"layer norms' ({c.rms_norm_eps})")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_block_count(c.num_layers)
    writer.add_ssm_conv_kernel(c.ssm_conv_kernel)
    writer.add_ssm_inner_size(c.intermediate_size)
    writer.add_ssm_state_size(c.ssm_state_size)
    writer.add_ssm_time_step_rank(c.ssm_time_step_rank)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_ssm_dt_b_c_rms(c.ssm_bc_norm_eps is not None)
