"""A GGUF file -> ModelFiles: llama.cpp's metadata keys mapped onto ModelConfig."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, ModelConfig, RopeScaling, short_repr
from ..errors import InvalidRequestError, ModelFormatError, UnsupportedModelError
from ..text.chat_template import ChatTemplate
from ..text.tokenizer import Tokenizer, check_token_ids
from .checks import check_weights, split_fused
from .config_keys import GGUFKeys, pre_attn_scalar
from .dequant import dequantize
from .families import family
from .gguf_file import GGUFFile, GGUFTensor, open_gguf
from .gguf_slice import block_loaders, part_loader
from .names import llama_unpermute
from .weights import ModelFiles, WeightRef
# Tensors that are metadata rather than weights: read into the config (RoPE frequency factors).
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")

# The `<arch>.*` keys we read. Any other is refused, by name: an unknown key may change the math.
_KNOWN_KEYS = frozenset({
    "vocab_size", "context_length", "embedding_length", "block_count", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "attention.sliding_window", "attention.sliding_window_pattern",
    "attention.scale", "rope.dimension_count", "rope.freq_base", "rope.freq_base_swa", "rope.scaling.type",
    "rope.scaling.factor", "rope.scaling.original_context_length", "rope.scaling.attn_factor",
    "rope.scaling.finetuned", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
    "rope.scaling.yarn_attn_factor", "attn_logit_softcapping", "final_logit_softcapping", "expert_count",
    "expert_used_count", "expert_feed_forward_length", "expert_weights_norm",
})
# Keys whose every value but one (or absence) changes the math: accepted at that value only.
_NEUTRAL_KEYS = {
    "attention.causal": True, "expert_shared_count": 0, "leading_dense_block_count": 0,
    "expert_gating_func": 1,  # softmax
    "expert_weights_scale": 1.0, "rope.scaling.yarn_ext_factor": 1.0, "rope.scaling.yarn_log_multiplier": 0.0,
    "pooling_type": 0, "logit_scale": 1.0, "embedding_scale": 1.0, "residual_scale": 1.0,
}


def read_gguf_model(path: Path) -> ModelFiles:
    """The file, read as its family (`general.architecture`) says: formats/families.py."""
    gf = open_gguf(path)
    label = gf.path.name
    spec = family(gf.get("general.architecture"), label)
    if spec.read_gguf is not None:
        return spec.read_gguf(gf)
    config = config_from_gguf(gf)
    weights = {name: _weight_ref(t, config) for name, t in gf.tensors.items() if name not in ROPE_TENSORS}
    if spec.gguf_weights_fixup is not None:
        spec.gguf_weights_fixup(config, weights)
    split_fused(label, config, weights)
    check_weights(label, config, weights)
    try:
        tokenizer = Tokenizer.from_gguf_metadata(gf.metadata)
    except (ModelFormatError, UnsupportedModelError) as e:
        raise type(e)(f"{label}: {e}") from e
    check_token_ids(tokenizer, config.vocab_size, label, "token_embd.weight")
    source = gf.get("tokenizer.chat_template")
    if source is not None and not isinstance(source, str):
        raise ModelFormatError(f"{label}: tokenizer.chat_template must be a string, got {short_repr(source)}")
    try:
        template = ChatTemplate(source, tokenizer.bos_token, tokenizer.eos_token)
    except InvalidRequestError as e:
        raise ModelFormatError(f"{label}: tokenizer.chat_template: {e}") from e
    return ModelFiles(Path(path), "gguf", config, weights, tokenizer, template, gf.metadata)


_REQUIRED = object()


def config_from_gguf(gf: GGUFFile) -> ModelConfig:
    """llama.cpp's keys -> ModelConfig. A key of the wrong type, or a value no model can have, is a
    one-line ModelFormatError naming the file and the key (ModelConfig decides what is possible);
    an `<arch>.*` key we do not read is an UnsupportedModelError naming it."""
    name = gf.path.name
    spec = family(gf.get("general.architecture"), name)
    if spec.gguf_config is not None:
        return spec.gguf_config(gf)
    a = f"{spec.name}."
    for key in gf.metadata:
        if not key.startswith(a) or key[len(a):] in _KNOWN_KEYS or key[len(a):] in spec.gguf_keys:
            continue
        neutral = _NEUTRAL_KEYS.get(key[len(a):], _REQUIRED)
        if neutral is _REQUIRED or gf.get(key) != neutral:
            raise UnsupportedModelError(f"{name}: metadata {key} = {short_repr(gf.get(key))} is not supported "
                                        f"(it would change the model's math)")

    def raw(key: str, default: Any = _REQUIRED) -> Any:
        value = gf.get(key, default)
        if value is _REQUIRED:
            raise ModelFormatError(f"{name}: missing metadata key {key}")
        return value

    def integer(key: str, default: Any = _REQUIRED) -> Any:
        value = raw(key, default)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ModelFormatError(f"{name}: metadata {key} must be an integer, got {short_repr(value)}")
        return value

    def number(key: str, default: Any = _REQUIRED) -> Any:
        value = raw(key, default)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise ModelFormatError(f"{name}: metadata {key} must be a number, got {short_repr(value)}")
        return None if value is None else float(value)

    def boolean(key: str, default: bool) -> bool:
        value = raw(key, default)
        if not isinstance(value, bool):
            raise ModelFormatError(f"{name}: metadata {key} must be true or false, got {short_repr(value)}")
        return value

    hidden = integer(a + "embedding_length")
    heads = integer(a + "attention.head_count")
    layers = integer(a + "block_count")
    if spec.gguf_extra_blocks:  # e.g. the multi-token prediction layers the converter counts in block_count
        layers -= integer(a + spec.gguf_extra_blocks, 0)
    if layers > len(gf.tensors):  # before anything is built per layer
        raise ModelFormatError(f"{name}: metadata {a}block_count is {layers} but the file has only "
                               f"{len(gf.tensors)} tensors")
    embed = gf.tensors.get("token_embd.weight")
    tokens = gf.get("tokenizer.ggml.tokens")
    vocab = int(embed.shape[0]) if embed is not None else (
        integer(a + "vocab_size", None) or (len(tokens) if isinstance(tokens, list) else 0))
    # head_dim defaults to hidden / heads where both are usable; else ModelConfig names the bad one
    head_dim = integer(a + "attention.key_length", hidden // heads if heads > 0 and hidden > 0 else heads)
    partial_rope = () if spec.partial_rope else (("rope.dimension_count", "partial RoPE"),)
    for key, what in (("attention.value_length", "a value head size"), *partial_rope):
        value = integer(a + key, None)
        if value is not None and value != head_dim:  # our attention has one head size, rotated whole
            raise UnsupportedModelError(f"{name}: {what} is not supported: metadata {a}{key} is {value}, "
                                        f"{a}attention.key_length {head_dim}")
    context = integer(a + "context_length", 4096)
    rope_scaling = _rope_scaling(gf, a, head_dim, context, integer, number)
    eos = integer("tokenizer.ggml.eos_token_id", None)
    extra: dict[str, Any] = dict(attn_logit_softcap=number(a + "attn_logit_softcapping", None),
                                 final_logit_softcap=number(a + "final_logit_softcapping", None))
    window = integer(a + "attention.sliding_window", None)
    pattern = gf.get(a + "attention.sliding_window_pattern")
    if pattern is not None and not (isinstance(pattern, list) and len(pattern) == layers
                                    and all(isinstance(p, bool) for p in pattern)):
        raise ModelFormatError(f"{name}: metadata {a}attention.sliding_window_pattern must be one true or false "
                               f"a layer ({layers}), got {short_repr(pattern)}")
    scale = number(a + "attention.scale", None)
    if scale:
        extra["query_pre_attn_scalar"] = pre_attn_scalar(scale)
    if spec.sliding is not None:  # else the family's gguf_fields reads its window
        if window:  # 0: none (llama.cpp's phi3 files say so)
            extra.update(sliding_window=window, rope_local_theta=number(a + "rope.freq_base_swa", None),
                         layer_types=tuple("sliding" if p else "full" for p in pattern) if pattern else
                         ("sliding",) * layers)
        elif gf.get(a + "rope.freq_base_swa") is not None:
            raise UnsupportedModelError(f"{name}: metadata {a}rope.freq_base_swa without a sliding window is not "
                                        f"supported")
    if spec.qk_norm:
        extra["qk_norm"] = True
    if spec.gguf_fields is not None:
        extra.update(spec.gguf_fields(GGUFKeys(gf, name, a, integer, number, raw, hidden, heads, layers, head_dim,
                                               window, pattern, scale)))
    kv_heads = extra.pop("num_kv_heads") if "num_kv_heads" in extra else integer(a + "attention.head_count_kv", heads)
    experts = integer(a + "expert_count", 0)
    if experts:
        expert_ff = integer(a + "expert_feed_forward_length", None)
        extra.update(num_experts=experts, num_experts_per_tok=integer(a + "expert_used_count"),
                     expert_intermediate_size=None if expert_ff == integer(a + "feed_forward_length", None) else expert_ff,
                     norm_topk_prob=boolean(a + "expert_weights_norm", True))
    elif spec.requires_experts:
        raise ModelFormatError(f"{name}: missing metadata key {a}expert_count")
    keys = {"hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
            "num_layers": "block_count", "num_heads": "attention.head_count",
            "num_kv_heads": "attention.head_count_kv", "head_dim": "attention.key_length",
            "rms_norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base",
            "rope_scaling": "rope.scaling", "max_position_embeddings": "context_length",
            "query_pre_attn_scalar": "attention.scale", "sliding_window": "attention.sliding_window",
            "layer_types": "attention.sliding_window_pattern", "rope_local_theta": "rope.freq_base_swa",
            "attn_logit_softcap": "attn_logit_softcapping", "final_logit_softcap": "final_logit_softcapping",
            "num_experts": "expert_count", "num_experts_per_tok": "expert_used_count",
            "expert_intermediate_size": "expert_feed_forward_length", **spec.gguf_field_keys}
    rope_scaling = extra.pop("rope_scaling", rope_scaling)  # a family's own reading of its keys (gpt-oss)
    ff = integer(a + "feed_forward_length", None if experts else _REQUIRED)
    if ff is None:  # an MoE file may give only the experts' width
        ff = integer(a + "expert_feed_forward_length")
    try:
        return ModelConfig(
            architecture=spec.name, vocab_size=vocab, hidden_size=hidden,
            intermediate_size=ff, num_layers=layers,
            num_heads=heads, num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=number(a + "attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=number(a + "rope.freq_base", 10000.0), rope_scaling=rope_scaling,
            max_position_embeddings=context,
            tie_word_embeddings="output.weight" not in gf.tensors,
            qkv_bias="blk.0.attn_q.bias" in gf.tensors,
            bos_token_id=integer("tokenizer.ggml.bos_token_id", None),
            eos_token_ids=() if eos is None else (eos,),
            **extra)
    except ConfigError as e:
        if e.field in ("bos_token_id", "eos_token_ids"):  # "<key> <id> is outside the embedding's <n> rows"
            message = str(e).replace(e.field, "tokenizer.ggml." + e.field.removesuffix("s"), 1)
        else:
            key = "token_embd.weight rows" if e.field == "vocab_size" else a + keys.get(e.field, e.field)
            message = f"metadata {key}: {e}"
        raise ModelFormatError(f"{name}: {message}") from None


def _factors(gf: GGUFFile, tensor: str, head_dim: int) -> tuple[float, ...]:
    """A RoPE factor tensor (F32 [head_dim / 2]) as a tuple."""
    t = gf.tensors[tensor]
    if t.ggml_type.name != "F32" or t.shape != (head_dim // 2,):
        raise ModelFormatError(f"{gf.path.name}: tensor {tensor!r} must be F32 of shape ({head_dim // 2},), "
                               f"got {t.ggml_type.name} {t.shape}")
    return tuple(float(v) for v in dequantize(t.raw, t.ggml_type, t.shape).tolist())


def _rope_scaling(gf: GGUFFile, a: str, head_dim: int, context: int, integer, number) -> RopeScaling | None:
    """llama.cpp's RoPE scaling keys and tensors -> RopeScaling, in transformers' terms."""
    name = gf.path.name
    kind = gf.get(a + "rope.scaling.type", "none")
    has_freqs = "rope_freqs.weight" in gf.tensors
    has_long = "rope_factors_long.weight" in gf.tensors or "rope_factors_short.weight" in gf.tensors
    if kind not in ("none", "linear", "yarn", "longrope"):
        raise UnsupportedModelError(f"{name}: unsupported RoPE scaling: metadata {a}rope.scaling.type is "
                                    f"{short_repr(kind)} (supported: none, linear, yarn, longrope)")
    if has_freqs and (kind != "none" or has_long):
        raise UnsupportedModelError(f"{name}: rope_freqs.weight with {a}rope.scaling.type {kind} is not supported")
    original = integer(a + "rope.scaling.original_context_length", None)
    factor = number(a + "rope.scaling.factor", None)
    attn_factor = number(a + "rope.scaling.attn_factor", None)
    if attn_factor not in (None, 1.0) and not (has_long or kind == "longrope"):
        raise UnsupportedModelError(f"{name}: metadata {a}rope.scaling.attn_factor = {attn_factor} is only "
                                    f"supported with LongRoPE")
    if has_freqs:  # Llama 3.1's scaling as llama.cpp stores it: one divisor per frequency
        return RopeScaling("llama3", freq_factors=_factors(gf, "rope_freqs.weight", head_dim))
    if has_long or kind == "longrope":
        for t in ("rope_factors_short.weight", "rope_factors_long.weight"):
            if t not in gf.tensors:
                raise ModelFormatError(f"{name}: LongRoPE needs the tensor {t!r}")
        original = original or context
        return RopeScaling("longrope", factor=context / original if original > 0 else 1.0,
                           original_max_position_embeddings=original,
                           attention_factor=attn_factor,
                           short_factor=_factors(gf, "rope_factors_short.weight", head_dim),
                           long_factor=_factors(gf, "rope_factors_long.weight", head_dim))
    if kind == "linear" and factor not in (None, 1.0):
        return RopeScaling("linear", factor=factor)
    if kind == "yarn":
        # llama.cpp's attention factor is yarn_attn_factor times YaRN's own 0.1 ln(factor) + 1
        factor = 1.0 if factor is None else factor
        mscale = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
        attn = number(a + "rope.scaling.yarn_attn_factor", None)
        return RopeScaling("yarn", factor=factor, original_max_position_embeddings=original or context,
                           beta_fast=number(a + "rope.scaling.yarn_beta_fast", 32.0),
                           beta_slow=number(a + "rope.scaling.yarn_beta_slow", 1.0),
                           attention_factor=None if attn is None else attn * mscale)  # None: mscale itself
    return None


def _weight_ref(t: GGUFTensor, cfg: ModelConfig) -> WeightRef:
    heads = None
    permuted = family(cfg.architecture).rope_permuted  # the converter's interleaved-RoPE q/k rows
    if permuted and t.name.endswith(("attn_q.weight", "attn_q.bias")):
        heads = cfg.num_heads
    elif permuted and t.name.endswith(("attn_k.weight", "attn_k.bias")):
        heads = cfg.num_kv_heads

    def rows(x: torch.Tensor) -> torch.Tensor:
        return x if heads is None else llama_unpermute(x, heads)

    def load() -> torch.Tensor:
        return rows(dequantize(t.raw, t.ggml_type, t.shape))

    blocks, blocks_part = block_loaders(t, heads)
    experts = None
    if len(t.shape) == 3:  # [experts, out, in]: each expert's rows are one span of the map
        n, per = t.shape[0], int(t.raw.nbytes) // t.shape[0]
        experts = [_weight_ref(GGUFTensor(f"{t.name}[{e}]", t.ggml_type, t.shape[1:], t.raw[e * per:(e + 1) * per]),
                               cfg) for e in range(n)]
    return WeightRef(t.name, t.shape, t.ggml_type.name, int(t.raw.nbytes), load, raw=t.raw,
                     load_part=part_loader(t, heads), blocks=blocks, blocks_part=blocks_part,
                     blocks_mapped=blocks is not None and heads is None, experts=experts)
