"""Mamba2 and Granite-4.0-H (GGUF `granitehybrid`) files -> ModelConfig and canonical weights.

Canonical names and layouts are what llama.cpp's converter writes (conversion/mamba.py, granite.py):
`blk.N.ssm_in/ssm_out.weight`, `ssm_conv1d.weight` [conv_dim, K] (HF's [conv_dim, 1, K] squeezed),
`ssm_conv1d.bias`, `ssm_dt.bias`, `ssm_a` [heads, 1] holding A = -exp(A_log) (not A_log),
`ssm_d` [heads, 1], `ssm_norm.weight` [groups, inner / groups]; Granite's fused gate|up projections
(the shared MLP's `input_linear` and the experts' [experts, 2 ffn, hidden]) split into gate and up,
the shared MLP named `ffn_*_shexp` beside experts and plain `ffn_*` in a dense model.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import ConfigError, ModelConfig, short_repr
from ..errors import ModelFormatError, UnsupportedModelError
from .config_keys import own_gguf_keys
from .weights import WeightRef

# config.json keys that change the math and are read here (anything else named mamba_* / ssm_* /
# time_step_* is refused, as is every key of `_REFUSED` away from its harmless values).
_MAMBA2_KEYS = {"num_heads", "head_dim", "n_groups", "state_size", "conv_kernel", "chunk_size", "expand",
                "use_bias", "use_conv_bias", "time_step_limit", "time_step_rank", "time_step_min", "time_step_max",
                "time_step_floor", "layer_norm_epsilon", "residual_in_fp32", "rescale_prenorm_residual"}
_GRANITE_KEYS = {"mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand",
                 "mamba_chunk_size", "mamba_conv_bias", "mamba_proj_bias", "time_step_limit"}
_REFUSED = {"use_bias": (False, None), "mamba_proj_bias": (False, None), "attention_bias": (False, None),
            "norm_before_gate": (False, None), "normalization_function": ("rmsnorm", None),
            "hidden_act": ("silu", None), "mlp_bias": (False, None), "rms_norm": (True, None)}


def _number(value: Any) -> Any:
    """config.json numbers, with transformers 5's {"__float__": "Infinity"} for a non-finite one."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        try:
            return float(value["__float__"])
        except (TypeError, ValueError):
            return value
    return float(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _time_step_limit(value: Any, where: str) -> tuple[float, float]:
    if value is None:
        return (0.0, math.inf)
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ModelFormatError(f"{where}: time_step_limit must be two numbers, got {short_repr(value)}")
    return tuple(_number(v) for v in value)


def _layer_kinds(hf: dict[str, Any], layers: Any, where: str) -> tuple[str, ...]:
    """Granite's per-layer kinds ("mamba"/"attention" as IBM writes them, or transformers 5's
    "linear_attention"/"full_attention") -> ModelConfig layer types."""
    given = hf.get("layer_types", hf.get("layers_block_type"))
    if not isinstance(given, list):
        raise ModelFormatError(f"{where}: layer_types must be a list of layer kinds, got {short_repr(given)}")
    kinds = {"mamba": "mamba2", "linear_attention": "mamba2", "attention": "full", "full_attention": "full"}
    bad = next((t for t in given if t not in kinds), None)
    if bad is not None:
        raise UnsupportedModelError(f"{where}: layer type {short_repr(bad)} is not supported")
    return tuple(kinds[t] for t in given)


def mamba_config_from_hf(hf: dict[str, Any], path: Path, arch: str) -> ModelConfig:
    where = f"{path}/config.json"
    for key, harmless in _REFUSED.items():
        if key in hf and hf[key] not in harmless:
            raise UnsupportedModelError(f"{where}: {key} {short_repr(hf[key])} is not supported")
    known = _MAMBA2_KEYS if arch == "mamba2" else _GRANITE_KEYS
    unknown = sorted(k for k in hf if k.startswith(("mamba_", "ssm_", "time_step_")) and k not in known)
    if unknown:
        raise UnsupportedModelError(f"{where}: {unknown[0]} is not supported")

    def get(key: str, default: Any = None) -> Any:
        if key not in hf and default is None:
            raise ModelFormatError(f"{where}: missing key {key!r}")
        return _number(hf.get(key, default))

    def integer(key: str, default: Any = None) -> Any:
        value = hf.get(key, default)
        if key not in hf and default is None:
            raise ModelFormatError(f"{where}: missing key {key!r}")
        return value

    hidden, layers = integer("hidden_size"), integer("num_hidden_layers")
    eos = hf.get("eos_token_id")
    common: dict[str, Any] = dict(
        architecture=arch, vocab_size=integer("vocab_size"), hidden_size=hidden, num_layers=layers,
        max_position_embeddings=hf.get("max_position_embeddings", 1 << 20),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        ssm_time_step_limit=_time_step_limit(_number(hf.get("time_step_limit")), where))
    if arch == "mamba2":
        heads, head_dim, expand = integer("num_heads"), integer("head_dim", 64), integer("expand", 2)
        fields = dict(intermediate_size=heads * head_dim if isinstance(heads, int) and isinstance(head_dim, int)
                      else heads, num_heads=heads, num_kv_heads=heads, head_dim=head_dim,
                      rms_norm_eps=get("layer_norm_epsilon", 1e-5), tie_word_embeddings=hf.get("tie_word_embeddings", False),
                      layer_types=("mamba2",) * layers if isinstance(layers, int) and 0 < layers <= 1 << 16 else (),
                      ssm_num_heads=heads, ssm_head_dim=head_dim, ssm_num_groups=integer("n_groups", 1),
                      ssm_state_size=integer("state_size", 128), ssm_conv_kernel=integer("conv_kernel", 4),
                      ssm_chunk_size=integer("chunk_size", 256))
        conv_bias = hf.get("use_conv_bias", True)
    else:
        heads, expand = integer("mamba_n_heads", 128), integer("mamba_expand", 2)
        head_dim = hf.get("mamba_d_head", "auto")
        if head_dim == "auto" and isinstance(hidden, int) and isinstance(expand, int) and isinstance(heads, int) and heads:
            head_dim = expand * hidden // heads
        position = hf.get("position_embedding_type")
        if position == "rope":
            rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
            if not isinstance(rope, dict) or rope.get("rope_type", rope.get("type", "default")) != "default":
                raise UnsupportedModelError(f"{where}: RoPE scaling {short_repr(rope)} with Granite's attention is "
                                            f"not supported (plain RoPE is)")
        experts = integer("num_local_experts", 0) or 0
        shared = integer("shared_intermediate_size", 0)
        attn_heads = integer("num_attention_heads")
        theta = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0)) \
            if isinstance(hf.get("rope_parameters", {}), dict) else 10000.0
        fields = dict(intermediate_size=integer("intermediate_size") if experts else shared,
                      num_heads=attn_heads, num_kv_heads=hf.get("num_key_value_heads") or attn_heads,
                      head_dim=hidden // attn_heads if isinstance(hidden, int) and isinstance(attn_heads, int)
                      and attn_heads > 0 else attn_heads,
                      rms_norm_eps=get("rms_norm_eps", 1e-6), rope_theta=_number(theta),
                      tie_word_embeddings=hf.get("tie_word_embeddings", False),
                      layer_types=_layer_kinds(hf, layers, where),
                      num_experts=experts, num_experts_per_tok=integer("num_experts_per_tok", 0) if experts else 0,
                      ssm_num_heads=heads, ssm_head_dim=head_dim, ssm_num_groups=integer("mamba_n_groups", 1),
                      ssm_state_size=integer("mamba_d_state", 256), ssm_conv_kernel=integer("mamba_d_conv", 4),
                      ssm_chunk_size=integer("mamba_chunk_size", 256),
                      embedding_multiplier=get("embedding_multiplier", 1.0),
                      residual_multiplier=get("residual_multiplier", 1.0),
                      attention_multiplier=get("attention_multiplier", 1.0),
                      logits_scaling=get("logits_scaling", 1.0),
                      shared_mlp_size=shared if experts else 0, attention_rope=position == "rope")
        conv_bias = hf.get("mamba_conv_bias", True)
    fields["ssm_conv_bias"] = conv_bias
    if all(isinstance(v, int) for v in (hidden, expand, heads, fields["ssm_head_dim"])) \
            and hidden * expand != heads * fields["ssm_head_dim"]:
        raise ModelFormatError(f"{where}: hidden_size * expand ({hidden} * {expand}) must equal the mixer's heads "
                               f"* head_dim ({heads} * {fields['ssm_head_dim']})")
    try:
        return ModelConfig(**common, **fields)
    except ConfigError as e:
        raise ModelFormatError(f"{where}: {e.field}: {e}") from None


# --- Hugging Face folders -------------------------------------------------------------------

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# per-layer HF suffix -> (canonical suffix, transform of the float tensor)
_MIXER = {
    "in_proj.weight": ("ssm_in.weight", None), "out_proj.weight": ("ssm_out.weight", None),
    "conv1d.weight": ("ssm_conv1d.weight", lambda w: w.squeeze(1)), "conv1d.bias": ("ssm_conv1d.bias", None),
    "dt_bias": ("ssm_dt.bias", None), "A_log": ("ssm_a", lambda w: -torch.exp(w)[:, None]),
    "D": ("ssm_d", lambda w: w[:, None]), "norm.weight": ("ssm_norm.weight", "groups"),
}


def _ref(name: str, shape: tuple[int, ...], stored: str, load: Callable[[], torch.Tensor],
         experts: list[WeightRef] | None = None) -> WeightRef:
    n = math.prod(shape) * (_DTYPES.get(stored, torch.float32).itemsize)
    return WeightRef(name, shape, stored, n, load, experts=experts)


def mamba_hf_weights(path: Path, cfg: ModelConfig, handles: list[tuple[Path, Any, list[str]]]) -> dict[str, WeightRef]:
    """Canonical WeightRefs of a Mamba2 or Granite-4.0-H folder's tensors; a tensor no rule names is refused."""
    top = "backbone." if cfg.architecture == "mamba2" else "model."
    tops = {top + "embeddings.weight": "token_embd.weight", top + "embed_tokens.weight": "token_embd.weight",
            top + "norm_f.weight": "output_norm.weight", top + "norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    weights: dict[str, WeightRef] = {}
    groups = cfg.ssm_num_groups
    for file, handle, names in handles:
        for hf_name in names:
            sl = handle.get_slice(hf_name)
            shape, stored = tuple(sl.get_shape()), sl.get_dtype()

            def plain(t: Callable[[torch.Tensor], torch.Tensor] | None = None, hf_name: str = hf_name):
                return lambda: (t or (lambda w: w))(handle.get_tensor(hf_name).float())

            if hf_name in tops:
                weights[tops[hf_name]] = _ref(tops[hf_name], shape, stored, plain())
                continue
            parts = hf_name[len(top):].split(".", 3) if hf_name.startswith(top + "layers.") else []
            if len(parts) < 3 or not parts[1].isdigit():
                raise ModelFormatError(f"{file.name}: tensor {hf_name!r} is not used by the {cfg.architecture} "
                                       f"architecture; refusing to run the model without it")
            p, rest = f"blk.{int(parts[1])}.", ".".join(parts[2:])
            made = _layer_refs(p, rest, shape, stored, plain, groups, handle, hf_name)
            if made is None:
                raise ModelFormatError(f"{file.name}: tensor {hf_name!r} is not used by the {cfg.architecture} "
                                       f"architecture; refusing to run the model without it")
            for ref in made:
                weights[ref.name] = ref
    if cfg.architecture == "granitehybrid" and not cfg.is_moe:  # a dense model: the shared MLP is its FFN
        for part in ("gate", "up", "down"):
            for i in range(cfg.num_layers):
                ref = weights.pop(f"blk.{i}.ffn_{part}_shexp.weight", None)
                if ref is not None:
                    ref.name = f"blk.{i}.ffn_{part}.weight"
                    weights[ref.name] = ref
    if cfg.tie_word_embeddings:
        weights.pop("output.weight", None)
    elif "output.weight" not in weights:
        raise ModelFormatError(f"{path}: config says untied output head but lm_head.weight is missing")
    return weights


def _layer_refs(p: str, rest: str, shape: tuple[int, ...], stored: str, plain, groups: int, handle,
                hf_name: str) -> list[WeightRef] | None:
    kind, _, suffix = rest.partition(".")
    if rest in ("norm.weight", "input_layernorm.weight"):
        return [_ref(p + "attn_norm.weight", shape, stored, plain())]
    if rest == "post_attention_layernorm.weight":
        return [_ref(p + "ffn_norm.weight", shape, stored, plain())]
    if kind in ("mixer", "mamba") and suffix in _MIXER:
        name, t = _MIXER[suffix]
        if t == "groups":
            return [_ref(p + name, (groups, shape[0] // groups), stored, plain(lambda w: w.view(groups, -1)))]
        new_shape = {"conv1d.weight": shape[::2], "A_log": (*shape, 1), "D": (*shape, 1)}.get(suffix, shape)
        return [_ref(p + name, new_shape, stored, plain(t))]
    if kind == "self_attn" and suffix in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"):
        part = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output"}[suffix[0]]
        return [_ref(f"{p}{part}.weight", shape, stored, plain())]
    if rest == "shared_mlp.input_linear.weight":  # [2 ffn, hidden]: gate rows, then up rows
        half = shape[0] // 2
        return [_ref(f"{p}ffn_gate_shexp.weight", (half, shape[1]), stored, plain(lambda w: w[:half].contiguous())),
                _ref(f"{p}ffn_up_shexp.weight", (half, shape[1]), stored, plain(lambda w: w[half:].contiguous()))]
    if rest == "shared_mlp.output_linear.weight":
        return [_ref(f"{p}ffn_down_shexp.weight", shape, stored, plain())]
    if rest == "block_sparse_moe.router.layer.weight":
        return [_ref(f"{p}ffn_gate_inp.weight", shape, stored, plain())]
    if rest == "block_sparse_moe.input_linear.weight":  # [experts, 2 ffn, hidden]
        n, half = shape[0], shape[1] // 2
        return [_experts(f"{p}ffn_{part}_exps.weight", n, (half, shape[2]), stored, handle, hf_name,
                         slice(lo, lo + half)) for part, lo in (("gate", 0), ("up", half))]
    if rest == "block_sparse_moe.output_linear.weight":  # [experts, hidden, ffn]
        return [_experts(f"{p}ffn_down_exps.weight", shape[0], tuple(shape[1:]), stored, handle, hf_name,
                         slice(0, shape[1]))]
    return None


def _experts(name: str, n: int, shape: tuple[int, ...], stored: str, handle, hf_name: str, rows: slice) -> WeightRef:
    """An [experts, out, in] tensor whose expert e is rows `rows` of the stored tensor's e-th matrix."""
    def one(e: int) -> WeightRef:
        return _ref(f"{name}[{e}]", shape, stored, lambda: handle.get_slice(hf_name)[e:e + 1, rows][0].float().contiguous())
    parts = [one(e) for e in range(n)]
    return _ref(name, (n, *shape), stored, lambda: torch.stack([r.load() for r in parts]), experts=parts)


# --- GGUF ---------------------------------------------------------------------------------

_GGUF_KEYS = frozenset({
    "vocab_size", "context_length", "embedding_length", "block_count", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "attention.scale",
    "rope.freq_base", "rope.dimension_count", "rope.scaling.finetuned", "expert_count", "expert_used_count",
    "expert_shared_feed_forward_length", "embedding_scale", "residual_scale", "logit_scale",
    "ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.inner_size", "ssm.time_step_rank",
})


def mamba_config_from_gguf(gf) -> ModelConfig:
    """llama.cpp's mamba2 / granitehybrid keys -> ModelConfig. Which layers have attention is read from
    the tensors (a layer with `attn_q.weight`); the per-layer `attention.head_count_kv` array (0: a
    recurrent layer) must agree where it says anything."""
    name, arch = gf.path.name, gf.get("general.architecture")
    value = own_gguf_keys(gf, _GGUF_KEYS)

    num = (int, float)
    hidden, layers = value("embedding_length", int), value("block_count", int)
    if layers > len(gf.tensors):
        raise ModelFormatError(f"{name}: metadata {arch}.block_count is {layers} but the file has only "
                               f"{len(gf.tensors)} tensors")
    inner, heads = value("ssm.inner_size", int), value("ssm.time_step_rank", int)
    embed = gf.tensors.get("token_embd.weight")
    eos = gf.get("tokenizer.ggml.eos_token_id")
    attention = tuple(f"blk.{i}.attn_q.weight" in gf.tensors for i in range(layers))
    fields: dict[str, Any] = dict(
        architecture=arch, vocab_size=int(embed.shape[0]) if embed is not None else value("vocab_size", int),
        hidden_size=hidden, num_layers=layers, max_position_embeddings=value("context_length", int, 1 << 20),
        rms_norm_eps=float(value("attention.layer_norm_rms_epsilon", num, 1e-5)),
        tie_word_embeddings="output.weight" not in gf.tensors,
        bos_token_id=gf.get("tokenizer.ggml.bos_token_id"), eos_token_ids=() if eos is None else (eos,),
        layer_types=tuple("full" if att else "mamba2" for att in attention),
        ssm_num_heads=heads, ssm_head_dim=inner // heads if heads > 0 else heads,
        ssm_num_groups=value("ssm.group_count", int, 1), ssm_state_size=value("ssm.state_size", int),
        ssm_conv_kernel=value("ssm.conv_kernel", int),
        ssm_conv_bias=not all(attention) and f"blk.{attention.index(False)}.ssm_conv1d.bias" in gf.tensors)
    if arch == "mamba2":
        fields.update(intermediate_size=inner, num_heads=heads, num_kv_heads=heads, head_dim=fields["ssm_head_dim"])
    else:
        attn_heads = value("attention.head_count", int)
        head_dim = hidden // attn_heads if attn_heads > 0 else attn_heads
        kv = value("attention.head_count_kv", (int, list), attn_heads)
        per_layer = kv if isinstance(kv, list) else [kv if att else 0 for att in attention]
        if len(per_layer) != layers or any(n and not att for n, att in zip(per_layer, attention)):
            raise ModelFormatError(f"{name}: metadata {arch}.attention.head_count_kv {short_repr(kv)} does not match "
                                   f"the layers with attention tensors")
        kv_heads = max(per_layer, default=0)
        if not kv_heads and any(attention):  # some converters leave the array at zeros: the K projection says
            k = gf.tensors[f"blk.{attention.index(True)}.attn_k.weight"]
            kv_heads = k.shape[0] // head_dim if head_dim > 0 else 0
        experts = value("expert_count", int, 0)
        shared = value("expert_shared_feed_forward_length", int, 0)
        scale = value("attention.scale", num, None)
        rope = value("rope.scaling.finetuned", bool, False)
        rope_dims = value("rope.dimension_count", int, None)
        if rope and rope_dims not in (None, head_dim):
            raise UnsupportedModelError(f"{name}: partial RoPE ({arch}.rope.dimension_count {rope_dims}) is not supported")
        fields.update(intermediate_size=value("feed_forward_length", int) if experts else shared,
                      num_heads=attn_heads, num_kv_heads=kv_heads or attn_heads, head_dim=head_dim,
                      rope_theta=float(value("rope.freq_base", num, 10000.0)),
                      num_experts=experts, num_experts_per_tok=value("expert_used_count", int) if experts else 0,
                      embedding_multiplier=float(value("embedding_scale", num, 1.0)),
                      residual_multiplier=float(value("residual_scale", num, 1.0)),
                      attention_multiplier=None if scale is None else float(scale),
                      logits_scaling=float(value("logit_scale", num, 1.0)),
                      shared_mlp_size=shared if experts else 0, attention_rope=rope)
    try:
        return ModelConfig(**fields)
    except ConfigError as e:
        raise ModelFormatError(f"{name}: {e.field}: {e}") from None


def add_mamba2_metadata(writer, c: ModelConfig) -> None:
    """The keys llama.cpp's converter writes for mamba2 / granitehybrid (and `mamba_config_from_gguf`
    reads). A GGUF has no SSD chunk size (it changes only the rounding) nor a time-step limit: a
    config whose limit binds cannot be written."""
    if c.ssm_time_step_limit != (0.0, math.inf):
        raise ValueError(f"a GGUF cannot state time_step_limit {c.ssm_time_step_limit} (llama.cpp runs without one)")
    w = writer
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_layers)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_ssm_conv_kernel(c.ssm_conv_kernel)
    w.add_ssm_inner_size(c.ssm_num_heads * c.ssm_head_dim)
    w.add_ssm_state_size(c.ssm_state_size)
    w.add_ssm_time_step_rank(c.ssm_num_heads)
    w.add_ssm_group_count(c.ssm_num_groups)
    if c.architecture == "mamba2":
        w.add_feed_forward_length(0)
        w.add_head_count(0)
        return
    w.add_vocab_size(c.vocab_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv([c.num_kv_heads if c.is_attention(i) else 0 for i in range(c.num_layers)])
    w.add_rope_freq_base(c.rope_theta)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_scaling_finetuned(c.attention_rope)
    w.add_attention_scale(c.attention_multiplier if c.attention_multiplier is not None else c.head_dim ** -0.5)
    w.add_embedding_scale(c.embedding_multiplier)
    w.add_residual_scale(c.residual_multiplier)
    w.add_logit_scale(c.logits_scaling)
    if c.is_moe:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_shared_feed_forward_length(c.shared_mlp_size)
    else:
        w.add_expert_shared_feed_forward_length(c.intermediate_size)
