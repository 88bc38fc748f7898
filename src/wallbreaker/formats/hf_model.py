"""A Hugging Face folder (config.json, *.safetensors, tokenizer.json) -> ModelFiles."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..config import ModelConfig
from ..errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError
from .chat_template import ChatTemplate
from .names import hf_to_canonical_table, is_norm
from .quantized_hf import is_quantized_folder, read_quantized_weights
from .tokenizer import Tokenizer
from .weights import ModelFiles, WeightRef, check_weights

_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3", "gemma3": "gemma3"}
_DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def read_hf_folder(path: Path) -> ModelFiles:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelNotFoundError(f"{path}: not a model folder (no config.json)")
    try:
        hf = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{cfg_path}: unreadable config.json: {e}") from None
    if hf.get("model_type") == "gemma3" and "text_config" in hf:
        hf = {**hf["text_config"], "model_type": "gemma3_text"}
    config = config_from_hf(hf, path)
    weights = _safetensors_weights(path, config)
    if is_quantized_folder(hf):
        weights.update(read_quantized_weights(path, config, hf["quantization_config"]))
    check_weights(str(path), config, weights)
    tokenizer = Tokenizer.from_hf_folder(path)
    template_src = _chat_template_source(path)
    template = ChatTemplate(template_src, tokenizer.bos_token, tokenizer.eos_token)
    return ModelFiles(path, "hf", config, weights, tokenizer, template, hf)


def config_from_hf(hf: dict[str, Any], path: Path) -> ModelConfig:
    arch = _MODEL_TYPES.get(hf.get("model_type"))
    if arch is None:
        raise UnsupportedModelError(f"{path}: unsupported model_type {hf.get('model_type')!r} "
                                    f"(supported: {', '.join(_MODEL_TYPES)})")
    rope = hf.get("rope_parameters") or {}
    global_rope = rope.get("full_attention", rope)
    local_rope = rope.get("sliding_attention", {})
    scaling = hf.get("rope_scaling") or global_rope
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise UnsupportedModelError(f"{path}: unsupported RoPE scaling {rope_type!r}")
    heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    extra: dict[str, Any] = {}
    if arch == "gemma3":
        layer_types = hf.get("layer_types") or []
        extra = dict(hidden_act="gelu_tanh", qk_norm=True, sandwich_norm=True, embed_scale=True,
                     query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", hf.get("head_dim", 256))),
                     sliding_window=hf.get("sliding_window"),
                     layer_types=tuple("sliding" if t == "sliding_attention" else "full" for t in layer_types),
                     rope_local_theta=float(local_rope.get("rope_theta", hf.get("rope_local_base_freq", 10000.0))))
    try:
        return ModelConfig(
            architecture=arch, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"], num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(global_rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rope_scaling_factor=float(scaling.get("factor", 1.0)) if rope_type == "linear" else 1.0,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch == "gemma3")),
            qkv_bias=bool(hf.get("attention_bias", arch == "qwen2")),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            **extra)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFormatError(f"{path}/config.json: incomplete or inconsistent config: {e}") from None


def _safetensors_weights(path: Path, cfg: ModelConfig) -> dict[str, WeightRef]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path}: no *.safetensors files")
    table = hf_to_canonical_table(cfg.architecture, cfg.num_layers)
    weights: dict[str, WeightRef] = {}
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
            names = list(handle.keys())
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ModelFormatError(f"{file.name}: unreadable safetensors file: {e}") from None
        for hf_name in names:
            name = table.get(hf_name)
            if name is None:
                continue
            sl = handle.get_slice(hf_name)
            dtype = getattr(torch, {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(sl.get_dtype(), "float32"))
            shape = tuple(sl.get_shape())
            add_one = cfg.architecture == "gemma3" and is_norm(name)
            weights[name] = WeightRef(name, shape, _DTYPE_NAMES.get(dtype, sl.get_dtype()),
                                      _numel(shape) * dtype.itemsize,
                                      _loader(handle, hf_name, add_one),
                                      load_part=_part_loader(handle, hf_name, add_one))
    if cfg.tie_word_embeddings:
        weights.pop("output.weight", None)
    elif "output.weight" not in weights:
        raise ModelFormatError(f"{path}: config says untied output head but lm_head.weight is missing")
    return weights


def _loader(handle, hf_name: str, add_one: bool):
    def load() -> torch.Tensor:
        w = handle.get_tensor(hf_name).float()
        return w + 1.0 if add_one else w
    return load


def _part_loader(handle, hf_name: str, add_one: bool):
    """Rows or columns read through `get_slice`: only those bytes come off the disk."""
    def load_part(dim: int, lo: int, hi: int) -> torch.Tensor:
        sl = handle.get_slice(hf_name)
        w = (sl[lo:hi] if dim == 0 else sl[:, lo:hi]).float()
        return w + 1.0 if add_one else w
    return load_part


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _chat_template_source(path: Path) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    tc = path / "tokenizer_config.json"
    if tc.is_file():
        template = json.loads(tc.read_text()).get("chat_template")
        if isinstance(template, list):  # named templates: take the default
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return template
    return None
