"""A GGUF file -> ModelFiles: llama.cpp's metadata keys mapped onto ModelConfig."""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import SUPPORTED_ARCHITECTURES, ModelConfig
from ..errors import ModelFormatError, UnsupportedModelError
from ..quant.int4 import GGUF_INT4_TYPES, int4_from_gguf
from .chat_template import ChatTemplate
from .dequant import dequantize
from .gguf_file import GGUFFile, GGUFTensor, open_gguf
from .gguf_slice import part_loaders
from .names import llama_unpermute
from .tokenizer import Tokenizer
from .weights import ModelFiles, WeightRef, check_weights

GEMMA3_SLIDING_PATTERN = 6  # every sixth layer is global, as llama.cpp and transformers assume


def read_gguf_model(path: Path) -> ModelFiles:
    gf = open_gguf(path)
    config = config_from_gguf(gf)
    weights = {name: _weight_ref(t, config) for name, t in gf.tensors.items()}
    check_weights(gf.path.name, config, weights)
    tokenizer = Tokenizer.from_gguf_metadata(gf.metadata)
    template = ChatTemplate(gf.get("tokenizer.chat_template"), tokenizer.bos_token, tokenizer.eos_token)
    return ModelFiles(Path(path), "gguf", config, weights, tokenizer, template, gf.metadata)


def config_from_gguf(gf: GGUFFile) -> ModelConfig:
    arch = gf.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{gf.path.name}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

    def key(name: str, default=None, required: bool = False):
        value = gf.get(f"{arch}.{name}", default)
        if required and value is None:
            raise ModelFormatError(f"{gf.path.name}: missing metadata key {arch}.{name}")
        return value

    hidden = int(key("embedding_length", required=True))
    heads = int(key("attention.head_count", required=True))
    layers = int(key("block_count", required=True))
    tokens = gf.get("tokenizer.ggml.tokens") or []
    embed = gf.tensors.get("token_embd.weight")
    vocab = int(embed.shape[0]) if embed is not None else int(key("vocab_size", 0) or len(tokens))
    scaling = 1.0
    if gf.get(f"{arch}.rope.scaling.type") == "linear":
        scaling = float(key("rope.scaling.factor", 1.0))
    eos = gf.get("tokenizer.ggml.eos_token_id")
    extra = {}
    if arch == "gemma3":
        # llama.cpp hardcodes the sliding pattern, local RoPE base and attention scale of Gemma 3;
        # files may carry them explicitly (ours do), else its values apply.
        pattern = key("attention.sliding_window_pattern")
        if isinstance(pattern, list) and len(pattern) == layers:
            layer_types = tuple("sliding" if p else "full" for p in pattern)
        else:
            layer_types = tuple("full" if (i + 1) % GEMMA3_SLIDING_PATTERN == 0 else "sliding" for i in range(layers))
        scale = key("attention.scale")
        extra = dict(hidden_act="gelu_tanh", qk_norm=True, sandwich_norm=True, embed_scale=True,
                     query_pre_attn_scalar=round(float(scale) ** -2, 3) if scale else float(key("attention.key_length", hidden // heads)),
                     sliding_window=int(key("attention.sliding_window", 512)), layer_types=layer_types,
                     rope_local_theta=float(key("rope.freq_base_swa", 10000.0)))
    try:
        return ModelConfig(
            architecture=arch, vocab_size=vocab, hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length", required=True)), num_layers=layers,
            num_heads=heads, num_kv_heads=int(key("attention.head_count_kv", heads)),
            head_dim=int(key("attention.key_length", hidden // heads)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)), rope_scaling_factor=scaling,
            max_position_embeddings=int(key("context_length", 4096)),
            tie_word_embeddings="output.weight" not in gf.tensors,
            qkv_bias="blk.0.attn_q.bias" in gf.tensors,
            bos_token_id=gf.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            **extra)
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"{gf.path.name}: inconsistent model metadata: {e}") from None


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

    def int4():
        return int4_from_gguf(t.raw, t.ggml_type, t.shape).map_rows(rows)

    is_int4 = t.ggml_type in GGUF_INT4_TYPES and len(t.shape) == 2
    load_part, int4_part = part_loaders(t, heads)
    return WeightRef(t.name, t.shape, t.ggml_type.name, int(t.raw.nbytes), load, int4 if is_int4 else None, t.raw,
                     load_part=load_part, int4_part=int4_part if is_int4 else None)
