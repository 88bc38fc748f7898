"""BERT encoders -> ModelFiles: a Hugging Face folder (`BertModel`, with sentence-transformers'
pooling config beside it, or `BertForSequenceClassification`, a cross-encoder) and a GGUF file as
llama.cpp's converter writes `bert`. Tensors take llama.cpp's names (`token_embd`, `position_embd`,
`token_types`, `blk.N.attn_q`, ..., `layer_output_norm`); the classifier's pooler and output are
`cls.pooler` and `cls.output`."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..config import ConfigError, ModelConfig, PoolingConfig, short_repr
from ..errors import ModelFormatError, UnsupportedModelError
from ..text.chat_template import ChatTemplate
from ..text.tokenizer import check_token_ids
from ..text.wordpiece import bert_hf_tokenizer, gguf_wordpiece_tokenizer
from .dequant import dequantize
from .gguf_file import GGUFFile, GGUFTensor
from .gguf_slice import block_loaders, part_loader
from .safetensors_file import safetensors_handles, tensor_ref
from .sentence_transformers import read_pooling_config
from .weights import ModelFiles, WeightRef

_LAYER_NAMES = {
    "attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm",
}
_TOP_NAMES = {
    "embeddings.word_embeddings": "token_embd", "embeddings.position_embeddings": "position_embd",
    "embeddings.token_type_embeddings": "token_types", "embeddings.LayerNorm": "token_embd_norm",
    "pooler.dense": "cls.pooler", "classifier": "cls.output",
}
_SKIPPED = re.compile(r"^(embeddings\.position_ids|cls\.predictions\..*|cls\.seq_relationship\..*)$")
_LAYER = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias|gamma|beta)$")
_TOP = re.compile(r"^(.+)\.(weight|bias|gamma|beta)$")
_SUFFIX = {"gamma": "weight", "beta": "bias"}
# llama.cpp's pooling_type values (LLAMA_POOLING_TYPE_*)
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}

def canonical_name(hf_name: str) -> str | None:
    """A BERT checkpoint's tensor name -> ours; None for what the encoder never reads."""
    name = hf_name.removeprefix("bert.")
    if _SKIPPED.match(name):
        return None
    if m := _LAYER.match(name):
        part = _LAYER_NAMES.get(m.group(2))
        return None if part is None else f"blk.{m.group(1)}.{part}.{_SUFFIX.get(m.group(3), m.group(3))}"
    if m := _TOP.match(name):
        part = _TOP_NAMES.get(m.group(1))
        return None if part is None else f"{part}.{_SUFFIX.get(m.group(2), m.group(2))}"
    return None

def _config(where: str, **fields: Any) -> ModelConfig:
    try:
        return ModelConfig(architecture="bert", num_kv_heads=fields["num_heads"],
                           head_dim=fields["hidden_size"] // fields["num_heads"], **fields)
    except ConfigError as e:
        raise ModelFormatError(f"{where}: {e}") from None
    except (TypeError, ZeroDivisionError) as e:
        raise ModelFormatError(f"{where}: {e}") from None

def read_bert_folder(path: Path) -> ModelFiles:
    """A Hugging Face BERT folder. Its limit is the smaller of `max_position_embeddings` and
    sentence-transformers' `max_seq_length` (what the model was trained to, and where
    sentence-transformers cuts)."""
    where = f"{path}/config.json"
    hf = json.loads((path / "config.json").read_text())
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedModelError(f"{where}: position_embedding_type {short_repr(hf['position_embedding_type'])} "
                                    "is not supported (absolute only)")
    if hf.get("hidden_act", "gelu") != "gelu":
        raise UnsupportedModelError(f"{where}: hidden_act {short_repr(hf['hidden_act'])} is not supported (gelu only)")
    architectures = hf.get("architectures") or ["BertModel"]
    classifier = "BertForSequenceClassification" in architectures
    pooling, max_seq_length = read_pooling_config(path)
    if classifier:
        pooling = PoolingConfig("cls", task="score")
    tokenizer = bert_hf_tokenizer(path)
    context = min(hf.get("max_position_embeddings", 512), max_seq_length or 1 << 62)
    num_labels = len(hf.get("id2label") or {}) or int(hf.get("num_labels", 2)) if classifier else 0
    config = _config(where, vocab_size=hf.get("vocab_size"), hidden_size=hf.get("hidden_size"),
                     intermediate_size=hf.get("intermediate_size"), num_layers=hf.get("num_hidden_layers"),
                     num_heads=hf.get("num_attention_heads"), rms_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
                     max_position_embeddings=context, hidden_act="gelu", pooling=pooling,
                     type_vocab_size=int(hf.get("type_vocab_size", 2)), sep_token_id=tokenizer.eos_token_id,
                     num_labels=num_labels)
    weights: dict[str, WeightRef] = {}
    for _, handle, names in safetensors_handles(path):
        for hf_name in names:
            name = canonical_name(hf_name)
            if name is None or (name.startswith("cls.") and not classifier):
                continue
            weights[name] = tensor_ref(handle, hf_name, name)
    _check_weights(str(path), config, weights, classifier)
    check_token_ids(tokenizer, config.vocab_size, str(path), "the embedding (config.json vocab_size)")
    return ModelFiles(path, "hf", config, weights, tokenizer, ChatTemplate(None, None, None), hf)

def _check_weights(source: str, cfg: ModelConfig, weights: dict[str, WeightRef], classifier: bool) -> None:
    h, ff = cfg.hidden_size, cfg.intermediate_size
    expected = {"token_embd.weight": (cfg.vocab_size, h), "position_embd.weight": (None, h),
                "token_embd_norm.weight": (h,), "token_embd_norm.bias": (h,)}
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        for x in ("attn_q", "attn_k", "attn_v", "attn_output"):
            expected[p + x + ".weight"] = (h, h)
            expected[p + x + ".bias"] = (h,)
        for x in ("attn_output_norm", "layer_output_norm"):
            expected[p + x + ".weight"] = (h,)
            expected[p + x + ".bias"] = (h,)
        expected.update({p + "ffn_up.weight": (ff, h), p + "ffn_up.bias": (ff,),
                         p + "ffn_down.weight": (h, ff), p + "ffn_down.bias": (h,)})
    if cfg.type_vocab_size:
        expected["token_types.weight"] = (cfg.type_vocab_size, h)
    if classifier:
        expected.update({"cls.pooler.weight": (h, h), "cls.pooler.bias": (h,),
                         "cls.output.weight": (cfg.num_labels, h), "cls.output.bias": (cfg.num_labels,)})
    for name, shape in expected.items():
        ref = weights.get(name)
        if ref is None:
            raise ModelFormatError(f"{source}: tensor {name!r} is missing")
        if len(ref.shape) != len(shape) or any(s is not None and s != r for s, r in zip(shape, ref.shape)):
            raise ModelFormatError(f"{source}: tensor {name!r} has shape {list(ref.shape)}, expected {list(shape)}")
    if weights["position_embd.weight"].shape[0] < cfg.max_position_embeddings:
        raise ModelFormatError(f"{source}: position_embd has {weights['position_embd.weight'].shape[0]} rows, "
                               f"fewer than the context ({cfg.max_position_embeddings})")

def read_bert_gguf(gf: GGUFFile) -> ModelFiles:
    """llama.cpp's `bert` GGUF: its keys, its WordPiece vocabulary in "phantom space" form (a word's
    first piece written with a leading U+2581, a continuation bare, control tokens as they are),
    turned back into the tokenizer BERT's own folder has. The file does not say whether the
    embeddings are normalized (sentence-transformers' Normalize module is not converted); they are,
    as llama.cpp's embedding server normalizes them by default."""
    label = gf.path.name

    def key(name: str, default: Any = None) -> Any:
        return gf.get(f"bert.{name}", default)

    if key("attention.causal", False):
        raise UnsupportedModelError(f"{label}: a causal bert is not supported")
    pooling_type = key("pooling_type", 0)
    if pooling_type not in _GGUF_POOLING:
        raise UnsupportedModelError(f"{label}: bert.pooling_type {short_repr(pooling_type)} is not supported "
                                    f"(supported: {', '.join(f'{k} ({v})' for k, v in _GGUF_POOLING.items())})")
    tokenizer = gguf_wordpiece_tokenizer(gf.metadata, label)
    types = gf.tensors.get("token_types.weight")
    config = _config(label, vocab_size=len(gf.get("tokenizer.ggml.tokens") or ()), hidden_size=key("embedding_length"),
                     intermediate_size=key("feed_forward_length"), num_layers=key("block_count"),
                     num_heads=key("attention.head_count"),
                     rms_norm_eps=float(key("attention.layer_norm_epsilon", 1e-12)),
                     max_position_embeddings=key("context_length", 512), hidden_act="gelu",
                     pooling=PoolingConfig(_GGUF_POOLING[pooling_type], normalize=True),
                     type_vocab_size=types.shape[0] if types is not None else 0,
                     sep_token_id=tokenizer.eos_token_id)
    weights = {name: _gguf_weight(t) for name, t in gf.tensors.items()}
    _check_weights(label, config, weights, False)
    check_token_ids(tokenizer, weights["token_embd.weight"].shape[0], label, "token_embd.weight")
    return ModelFiles(gf.path, "gguf", config, weights, tokenizer, ChatTemplate(None, None, None), gf.metadata)

def _gguf_weight(t: GGUFTensor) -> WeightRef:
    """A bert tensor as stored (no row permutation: that is llama's alone), its blocks for the kernels."""
    blocks, blocks_part = block_loaders(t, None)
    return WeightRef(t.name, t.shape, t.ggml_type.name, int(t.raw.nbytes), lambda: dequantize(t.raw, t.ggml_type, t.shape),
                     raw=t.raw, load_part=part_loader(t, None), blocks=blocks, blocks_part=blocks_part,
                     blocks_mapped=blocks is not None)
