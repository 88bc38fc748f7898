"""A GGUF file -> ModelFiles: llama.cpp's metadata keys mapped onto ModelConfig."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ..config import SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig, short_repr
from ..errors import InvalidRequestError, ModelFormatError, UnsupportedModelError
from .chat_template import ChatTemplate
from .dequant import dequantize
from .gguf_file import GGUFFile, GGUFTensor, open_gguf
from .gguf_slice import block_loaders, part_loader
from .names import llama_unpermute
from .tokenizer import Tokenizer, check_token_ids
from .weights import ModelFiles, WeightRef, check_weights

GEMMA3_SLIDING_PATTERN = 6  # every sixth layer is global, as llama.cpp and transformers assume


def read_gguf_model(path: Path) -> ModelFiles:
    gf = open_gguf(path)
    label = gf.path.name
    config = config_from_gguf(gf)
    weights = {name: _weight_ref(t, config) for name, t in gf.tensors.items()}
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
    one-line ModelFormatError naming the file and the key (ModelConfig decides what is possible)."""
    name = gf.path.name
    arch = gf.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{name}: unsupported architecture {short_repr(arch)} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def raw(key: str, default: Any) -> Any:
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

    a = f"{arch}."
    hidden = integer(a + "embedding_length")
    heads = integer(a + "attention.head_count")
    layers = integer(a + "block_count")
    if layers > len(gf.tensors):  # before anything is built per layer
        raise ModelFormatError(f"{name}: metadata {a}block_count is {layers} but the file has only "
                               f"{len(gf.tensors)} tensors")
    embed = gf.tensors.get("token_embd.weight")
    tokens = gf.get("tokenizer.ggml.tokens")
    vocab = int(embed.shape[0]) if embed is not None else (
        integer(a + "vocab_size", None) or (len(tokens) if isinstance(tokens, list) else 0))
    # head_dim defaults to hidden / heads where both are usable; else ModelConfig names the bad one
    head_dim = integer(a + "attention.key_length", hidden // heads if heads > 0 and hidden > 0 else heads)
    for key, what in (("attention.value_length", "a value head size"), ("rope.dimension_count", "partial RoPE")):
        value = integer(a + key, None)
        if value is not None and value != head_dim:  # our attention has one head size, rotated whole
            raise UnsupportedModelError(f"{name}: {what} is not supported: metadata {a}{key} is {value}, "
                                        f"{a}attention.key_length {head_dim}")
    scaling = 1.0
    if gf.get(a + "rope.scaling.type") == "linear":
        scaling = number(a + "rope.scaling.factor", 1.0)
    eos = integer("tokenizer.ggml.eos_token_id", None)
    extra = {}
    if arch == "gemma3":
        # llama.cpp hardcodes the sliding pattern, local RoPE base and attention scale of Gemma 3;
        # files may carry them explicitly (ours do), else its values apply.
        pattern = gf.get(a + "attention.sliding_window_pattern")
        if isinstance(pattern, list) and len(pattern) == layers:
            layer_types = tuple("sliding" if p else "full" for p in pattern)
        else:
            layer_types = tuple("full" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding" for i in range(layers))
        scale = number(a + "attention.scale", None)
        extra = dict(hidden_act="gelu_tanh", qk_norm=True, sandwich_norm=True, embed_scale=True,
                     query_pre_attn_scalar=_pre_attn_scalar(scale) if scale else float(head_dim),
                     sliding_window=integer(a + "attention.sliding_window", 512), layer_types=layer_types,
                     rope_local_theta=number(a + "rope.freq_base_swa", 10000.0))
    keys = {"hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
            "num_layers": "block_count", "num_heads": "attention.head_count",
            "num_kv_heads": "attention.head_count_kv", "head_dim": "attention.key_length",
            "rms_norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base",
            "rope_scaling_factor": "rope.scaling.factor", "max_position_embeddings": "context_length",
            "query_pre_attn_scalar": "attention.scale", "sliding_window": "attention.sliding_window",
            "layer_types": "attention.sliding_window_pattern", "rope_local_theta": "rope.freq_base_swa"}
    try:
        return ModelConfig(
            architecture=arch, vocab_size=vocab, hidden_size=hidden,
            intermediate_size=integer(a + "feed_forward_length"), num_layers=layers,
            num_heads=heads, num_kv_heads=integer(a + "attention.head_count_kv", heads),
            head_dim=head_dim,
            rms_norm_eps=number(a + "attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=number(a + "rope.freq_base", 10000.0), rope_scaling_factor=scaling,
            max_position_embeddings=integer(a + "context_length", 4096),
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


def _pre_attn_scalar(scale: float) -> float:
    """Gemma's attention scale 1/sqrt(s) -> s; an absurd scale gives a value ModelConfig refuses."""
    try:
        return round(scale ** -2, 3)
    except (OverflowError, ZeroDivisionError):
        return math.inf


def _weight_ref(t: GGUFTensor, cfg: ModelConfig) -> WeightRef:
    heads = None
    if cfg.architecture == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
        heads = cfg.num_heads
    elif cfg.architecture == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
        heads = cfg.num_kv_heads

    def rows(x: torch.Tensor) -> torch.Tensor:
        return x if heads is None else llama_unpermute(x, heads)

    def load() -> torch.Tensor:
        return rows(dequantize(t.raw, t.ggml_type, t.shape))

    blocks, blocks_part = block_loaders(t, heads)
    return WeightRef(t.name, t.shape, t.ggml_type.name, int(t.raw.nbytes), load, raw=t.raw,
                     load_part=part_loader(t, heads), blocks=blocks, blocks_part=blocks_part)
