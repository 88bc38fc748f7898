"""A Hugging Face folder (config.json, *.safetensors, tokenizer.json) -> ModelFiles."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..config import ConfigError, ModelConfig, short_repr
from ..errors import InvalidRequestError, ModelFormatError, ModelNotFoundError, UnsupportedModelError
from .chat_template import ChatTemplate
from .names import hf_to_canonical_table, is_norm
from .quantized_hf import is_quantized_folder, read_quantized_weights
from .tokenizer import Tokenizer, check_token_ids
from .weights import ModelFiles, WeightRef, check_weights

_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3", "gemma3": "gemma3"}
_DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def read_hf_folder(path: Path) -> ModelFiles:
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise ModelNotFoundError(f"{path}: not a model folder (no config.json)")
    try:
        hf = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise ModelFormatError(f"{cfg_path}: unreadable config.json: {e}") from None
    if not isinstance(hf, dict):
        raise ModelFormatError(f"{cfg_path}: config.json is not a JSON object")
    if hf.get("model_type") == "gemma3" and "text_config" in hf:
        if not isinstance(hf["text_config"], dict):
            raise ModelFormatError(f"{cfg_path}: text_config is not a JSON object")
        hf = {**hf["text_config"], "model_type": "gemma3_text"}
    config = config_from_hf(hf, path)
    handles = _safetensors_handles(path)
    n_tensors = sum(len(names) for _, _, names in handles)
    if config.num_layers > n_tensors:
        raise ModelFormatError(f"{cfg_path}: num_hidden_layers is {config.num_layers} but the folder has only "
                               f"{n_tensors} tensors")
    weights = _safetensors_weights(path, config, handles)
    if is_quantized_folder(hf):
        weights.update(read_quantized_weights(path, config, hf["quantization_config"]))
    check_weights(str(path), config, weights)
    tokenizer = Tokenizer.from_hf_folder(path)
    check_token_ids(tokenizer, config.vocab_size, str(path), "the embedding (config.json vocab_size)")
    template_src = _chat_template_source(path)
    try:
        template = ChatTemplate(template_src, tokenizer.bos_token, tokenizer.eos_token)
    except InvalidRequestError as e:
        raise ModelFormatError(f"{path}: {e}") from e
    return ModelFiles(path, "hf", config, weights, tokenizer, template, hf)


# ModelConfig field -> the config.json key it is read from, to name the key in errors.
_HF_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim", "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
    "rope_scaling_factor": "rope_scaling.factor", "max_position_embeddings": "max_position_embeddings",
    "tie_word_embeddings": "tie_word_embeddings", "qkv_bias": "attention_bias",
    "query_pre_attn_scalar": "query_pre_attn_scalar", "sliding_window": "sliding_window",
    "layer_types": "layer_types", "rope_local_theta": "rope_local_base_freq", "bos_token_id": "bos_token_id",
    "eos_token_ids": "eos_token_id",
}
_REQUIRED = object()


def config_from_hf(hf: dict[str, Any], path: Path) -> ModelConfig:
    where = f"{path}/config.json"
    arch = _MODEL_TYPES.get(hf.get("model_type")) if isinstance(hf.get("model_type"), str) else None
    if arch is None:
        raise UnsupportedModelError(f"{path}: unsupported model_type {short_repr(hf.get('model_type'))} "
                                    f"(supported: {', '.join(_MODEL_TYPES)})")

    def get(key: str, default: Any = _REQUIRED, within: dict[str, Any] = hf) -> Any:
        value = within.get(key, default)
        if value is _REQUIRED:
            raise ModelFormatError(f"{where}: missing key {key!r}")
        return value

    def obj(key: str, within: dict[str, Any] = hf) -> dict[str, Any]:
        value = within.get(key) or {}
        if not isinstance(value, dict):
            raise ModelFormatError(f"{where}: {key} must be a JSON object, got {short_repr(value)}")
        return value

    def number(key: str, default: float, within: dict[str, Any] = hf) -> Any:
        value = within.get(key, default)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value

    rope = obj("rope_parameters")
    global_rope = obj("full_attention", rope) if "full_attention" in rope else rope
    local_rope = obj("sliding_attention", rope)
    scaling = obj("rope_scaling") if hf.get("rope_scaling") else global_rope
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise UnsupportedModelError(f"{path}: unsupported RoPE scaling {short_repr(rope_type)}")
    heads = get("num_attention_heads")
    hidden = get("hidden_size")
    head_dim = hf.get("head_dim")
    if head_dim is None:  # hidden_size / heads, where both are usable (else ModelConfig names the bad one)
        usable = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (heads, hidden))
        head_dim = hidden // heads if usable else heads
    eos = hf.get("eos_token_id")
    extra: dict[str, Any] = {}
    if arch == "gemma3":
        layer_types = hf.get("layer_types") or []
        if not isinstance(layer_types, list):
            raise ModelFormatError(f"{where}: layer_types must be a list, got {short_repr(layer_types)}")
        extra = dict(hidden_act="gelu_tanh", qk_norm=True, sandwich_norm=True, embed_scale=True,
                     query_pre_attn_scalar=number("query_pre_attn_scalar", hf.get("head_dim", 256)),
                     sliding_window=hf.get("sliding_window"),
                     layer_types=tuple("sliding" if t == "sliding_attention" else "full" for t in layer_types),
                     rope_local_theta=number("rope_theta", number("rope_local_base_freq", 10000.0), local_rope))
    try:
        return ModelConfig(
            architecture=arch, vocab_size=get("vocab_size"), hidden_size=hidden,
            intermediate_size=get("intermediate_size"), num_layers=get("num_hidden_layers"), num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=number("rms_norm_eps", 1e-6),
            rope_theta=number("rope_theta", number("rope_theta", 10000.0), global_rope),
            rope_scaling_factor=number("factor", 1.0, scaling) if rope_type == "linear" else 1.0,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=hf.get("tie_word_embeddings", arch == "gemma3"),
            qkv_bias=hf.get("attention_bias", arch == "qwen2"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            **extra)
    except ConfigError as e:
        raise ModelFormatError(f"{where}: {_HF_KEYS.get(e.field, e.field)}: {e}") from None


def _safetensors_handles(path: Path) -> list[tuple[Path, Any, list[str]]]:
    """(file, handle, tensor names) of every *.safetensors file: only their headers are read."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{path}: no *.safetensors files")
    handles = []
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
            names = list(handle.keys())
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ModelFormatError(f"{file.name}: unreadable safetensors file: {e}") from None
        handles.append((file, handle, names))
    return handles


def _safetensors_weights(path: Path, cfg: ModelConfig, handles: list[tuple[Path, Any, list[str]]]) -> dict[str, WeightRef]:
    table = hf_to_canonical_table(cfg.architecture, cfg.num_layers)
    weights: dict[str, WeightRef] = {}
    for file, handle, names in handles:
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
        try:
            return jinja.read_text()
        except (OSError, ValueError) as e:
            raise ModelFormatError(f"{jinja}: unreadable chat template: {e}") from None
    tc = path / "tokenizer_config.json"
    if tc.is_file():
        try:
            config = json.loads(tc.read_text())
        except (OSError, ValueError) as e:
            raise ModelFormatError(f"{tc}: unreadable tokenizer_config.json: {e}") from None
        template = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(template, list):  # named templates: take the default
            default = next((t for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
            template = None if default is None else default.get("template", default)
        if template is not None and not isinstance(template, str):
            raise ModelFormatError(f"{tc}: chat_template must be a template or a list of named templates, "
                                   f"got {short_repr(template)}")
        return template
    return None
