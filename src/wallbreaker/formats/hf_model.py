"""A Hugging Face folder (config.json, *.safetensors, tokenizer.json) -> ModelFiles."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..config import MAMBA2_ARCHITECTURES, ROPE_TYPES, ConfigError, ModelConfig, PoolingConfig, RopeScaling, short_repr
from ..errors import InvalidRequestError, ModelFormatError, ModelNotFoundError, UnsupportedModelError
from .chat_template import ChatTemplate
from . import qwen3_next, qwen3_next_weights
from .multimodal import decoder_config, is_multimodal, text_tensor_name
from .lfm2 import hf_config_keys as lfm2_config_keys, squeeze_conv_weights
from .names import GEMMA_ARCHITECTURES, adds_one, hf_expert, hf_to_canonical_table, is_derived
from .quantized_hf import QUANTIZED_PARTS, is_quantized_folder, read_quantized_weights
from .tokenizer import Tokenizer, check_token_ids
from .weights import ModelFiles, WeightRef, check_weights, split_fused, stacked_experts

# model_type -> ModelConfig.architecture (llama.cpp's names: Mistral and Mixtral are llama)
_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                "qwen3_moe": "qwen3moe", "phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3",
                "lfm2": "lfm2", "qwen3_next": "qwen3next"}
_MODEL_TYPES.update({"mamba2": "mamba2", "granitemoehybrid": "granitehybrid"})  # formats/mamba.py
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
    multimodal = is_multimodal(hf)  # its decoder read here, its vision side by wallbreaker.vision
    if hf.get("model_type") in ("gemma3", "idefics3", "smolvlm", "qwen2_5_vl") and "text_config" in hf:
        if not isinstance(hf["text_config"], dict):
            raise ModelFormatError(f"{cfg_path}: text_config is not a JSON object")
        hf = decoder_config(hf)
    config = config_from_hf(hf, path)
    config = with_pooling(config, path, hf)
    handles = _safetensors_handles(path)
    n_tensors = sum(len(names) for _, _, names in handles)
    if config.num_layers > n_tensors:
        raise ModelFormatError(f"{cfg_path}: num_hidden_layers is {config.num_layers} but the folder has only "
                               f"{n_tensors} tensors")
    quantized = is_quantized_folder(hf)
    weights = _safetensors_weights(path, config, handles, quantized, multimodal)
    if quantized:
        weights.update(read_quantized_weights(path, config, hf["quantization_config"]))
    split_fused(str(path), config, weights)
    if config.architecture == "lfm2":
        squeeze_conv_weights(weights)
    if config.architecture == qwen3_next.ARCH:
        qwen3_next_weights.canonical_hf_weights(str(path), config, weights)
    check_weights(str(path), config, weights)
    tokenizer = Tokenizer.from_hf_folder(path)
    check_token_ids(tokenizer, config.vocab_size, str(path), "the embedding (config.json vocab_size)")
    template_src = _chat_template_source(path)
    try:
        template = ChatTemplate(template_src, tokenizer.bos_token, tokenizer.eos_token)
    except InvalidRequestError as e:
        raise ModelFormatError(f"{path}: {e}") from e
    return ModelFiles(path, "hf", config, weights, tokenizer, template, hf)


def with_pooling(config: ModelConfig, path: Path, hf: dict[str, Any]) -> ModelConfig:
    """A decoder embedding model (Qwen3-Embedding: sentence-transformers' modules.json beside it)
    gets its pooling config; so does a decoder cross-encoder (`*ForSequenceClassification`, e.g.
    Qwen3-Reranker converted to a score head, as vLLM and llama.cpp take it): the last token's final
    hidden state through `score` gives `num_labels` logits. It has no LM head (the embedding stands
    in, unused: it cannot generate). A folder with neither only generates."""
    from .sentence_transformers import read_pooling_config
    architectures = hf.get("architectures") or []
    if isinstance(architectures, list) and any(str(a).endswith("ForSequenceClassification") for a in architectures):
        labels = hf.get("id2label")
        num_labels = len(labels) if isinstance(labels, dict) and labels else hf.get("num_labels", 2)
        if not isinstance(num_labels, int) or isinstance(num_labels, bool) or num_labels < 1:
            raise ModelFormatError(f"{path}: num_labels must be a positive integer, got {num_labels!r}")
        return dataclasses.replace(config, pooling=PoolingConfig("last", task="score"), num_labels=num_labels,
                                   tie_word_embeddings=True)
    pooling, _ = read_pooling_config(path, default=None)
    return config if pooling is None else dataclasses.replace(config, pooling=pooling)


# ModelConfig field -> the config.json key it is read from, to name the key in errors.
_HF_KEYS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim", "rms_norm_eps": "rms_norm_eps", "rope_theta": "rope_theta",
    "rope_scaling": "rope_parameters", "max_position_embeddings": "max_position_embeddings",
    "tie_word_embeddings": "tie_word_embeddings", "qkv_bias": "attention_bias",
    "query_pre_attn_scalar": "query_pre_attn_scalar", "sliding_window": "sliding_window",
    "layer_types": "layer_types", "rope_local_theta": "rope_local_base_freq", "bos_token_id": "bos_token_id",
    "eos_token_ids": "eos_token_id", "attn_logit_softcap": "attn_logit_softcapping",
    "final_logit_softcap": "final_logit_softcapping", "num_experts": "num_local_experts",
    "num_experts_per_tok": "num_experts_per_tok", "expert_intermediate_size": "moe_intermediate_size",
    "norm_topk_prob": "norm_topk_prob", "hidden_act": "hidden_act", "conv_kernel": "conv_L_cache",
}
_HF_KEYS.update(qwen3_next.HF_FIELD_KEYS)
_REQUIRED = object()
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# RoPE parameters we read; any other key in them changes the rotation in a way we do not run.
_ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
                        "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "truncate",
                        "attention_factor", "mscale", "mscale_all_dim", "short_factor", "long_factor",
                        "partial_rotary_factor"})


def config_from_hf(hf: dict[str, Any], path: Path) -> ModelConfig:
    where = f"{path}/config.json"
    model_type = hf.get("model_type") if isinstance(hf.get("model_type"), str) else None
    arch = _MODEL_TYPES.get(model_type)
    if arch is None:
        raise UnsupportedModelError(f"{path}: unsupported model_type {short_repr(hf.get('model_type'))} "
                                    f"(supported: {', '.join(_MODEL_TYPES)})")
    if arch in MAMBA2_ARCHITECTURES:
        from .mamba import mamba_config_from_hf
        return mamba_config_from_hf(hf, path, arch)
    arch_fields: dict[str, Any] = {}  # what only this architecture has
    if arch == "lfm2":  # its keys renamed to the others' (before the readers below bind `hf`)
        hf, arch_fields = lfm2_config_keys(hf, where)

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

    def number(key: str, default: Any, within: dict[str, Any] = hf) -> Any:
        value = within.get(key, default)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value

    def unsupported(what: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{where}: {what} is not supported")

    _refuse_unimplemented(qwen3_next.without_own_keys(hf) if arch == qwen3_next.ARCH else hf, unsupported)
    rope = obj("rope_parameters")
    global_rope = obj("full_attention", rope) if "full_attention" in rope else rope
    local_rope = obj("sliding_attention", rope)
    scaling = obj("rope_scaling") if hf.get("rope_scaling") else global_rope
    heads = get("num_attention_heads")
    hidden = get("hidden_size")
    head_dim = hf.get("head_dim")
    if head_dim is None:  # hidden_size / heads, where both are usable (else ModelConfig names the bad one)
        usable = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (heads, hidden))
        head_dim = hidden // heads if usable else heads
    max_positions = hf.get("max_position_embeddings", 4096)
    rope_scaling = _rope_scaling(scaling, hf, max_positions, where, unsupported)
    eos = hf.get("eos_token_id")
    layers = get("num_hidden_layers")
    gemma = arch in GEMMA_ARCHITECTURES
    act_key = "hidden_activation" if gemma and hf.get("hidden_activation") is not None else "hidden_act"
    act = hf.get(act_key, "gelu_pytorch_tanh" if gemma else "silu")
    if not isinstance(act, str) or act not in _ACTIVATIONS:
        raise unsupported(f"{act_key} {short_repr(act)}")
    extra: dict[str, Any] = dict(hidden_act=_ACTIVATIONS[act],
                                 attn_logit_softcap=number("attn_logit_softcapping", None),
                                 final_logit_softcap=number("final_logit_softcapping", None))
    if gemma:
        extra.update(sandwich_norm=True, embed_scale=True, qk_norm=arch == "gemma3",
                     query_pre_attn_scalar=number("query_pre_attn_scalar", 256.0 if arch == "gemma2" else
                                                  hf.get("head_dim", 256)),
                     sliding_window=hf.get("sliding_window", 4096 if arch == "gemma2" else None),
                     layer_types=_layer_types(hf, layers, where, "alternate" if arch == "gemma2" else "none"))
        if arch == "gemma3":
            extra["rope_local_theta"] = number("rope_theta", number("rope_local_base_freq", 10000.0), local_rope)
    elif hf.get("sliding_window") is not None and not (arch in ("qwen2", "qwen3", "qwen3moe")
                                                       and not hf.get("use_sliding_window")):
        # Mistral, Mixtral and Phi-3 slide every layer; Qwen only with use_sliding_window, from max_window_layers
        extra.update(sliding_window=hf.get("sliding_window"),
                     layer_types=_layer_types(hf, layers, where, "qwen" if arch.startswith("qwen") else "all"))
    if arch in ("qwen3", "qwen3moe"):
        extra["qk_norm"] = True
    if isinstance(rope.get("mrope_section"), list):  # Qwen2.5-VL's decoder
        extra["mrope_section"] = tuple(rope["mrope_section"])
    if arch == qwen3_next.ARCH:
        extra.update(qwen3_next.config_from_hf(hf, where, unsupported))
    if model_type == "mixtral":
        extra.update(num_experts=hf.get("num_local_experts"), num_experts_per_tok=hf.get("num_experts_per_tok"))
    if arch == "qwen3moe":
        _refuse_dense_layers(hf, layers, unsupported)
        extra.update(num_experts=hf.get("num_experts", hf.get("num_local_experts")),
                     num_experts_per_tok=hf.get("num_experts_per_tok"),
                     expert_intermediate_size=hf.get("moe_intermediate_size"),
                     norm_topk_prob=hf.get("norm_topk_prob", False))
    extra.update(arch_fields)
    try:
        return ModelConfig(
            architecture=arch, vocab_size=get("vocab_size"), hidden_size=hidden,
            intermediate_size=get("intermediate_size"), num_layers=layers, num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=number("rms_norm_eps", 1e-6),
            rope_theta=number("rope_theta", number("rope_theta", 10000.0), global_rope),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=hf.get("tie_word_embeddings", gemma),
            qkv_bias=hf.get("attention_bias", arch == "qwen2"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            **extra)
    except ConfigError as e:
        qwen_experts = e.field == "num_experts" and "num_experts" in hf  # transformers 4's name for Qwen3-MoE
        key = "num_experts" if qwen_experts else _HF_KEYS.get(e.field, e.field)
        raise ModelFormatError(f"{where}: {key}: {e}") from None


def _refuse_unimplemented(hf: dict[str, Any], unsupported) -> None:
    """Keys that would change the math, set to what we do not run: refused, never ignored."""
    places = [hf] + [r for r in (hf.get("rope_parameters"), hf.get("rope_scaling")) if isinstance(r, dict)]
    for place in places:
        partial = place.get("partial_rotary_factor", 1.0)
        if partial not in (1, 1.0, None):
            raise unsupported(f"partial RoPE (partial_rotary_factor {short_repr(partial)})")
    for key, harmless in (("mlp_bias", (False, None)), ("use_bidirectional_attention", (False, None)),
                          ("is_causal", (True, None)), ("attn_output_gate", (False, None)),
                          ("shared_expert_intermediate_size", (0, None)), ("use_qk_norm", (False, None))):
        if key in hf and hf[key] not in harmless:
            raise unsupported(f"{key} {short_repr(hf[key])}")


def _refuse_dense_layers(hf: dict[str, Any], layers: Any, unsupported) -> None:
    """Qwen3-MoE may make some layers dense (mlp_only_layers, decoder_sparse_step); ours are all sparse."""
    step, only = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if step not in (1, None):
        raise unsupported(f"decoder_sparse_step {short_repr(step)} (dense layers between sparse ones)")
    if only:
        raise unsupported(f"mlp_only_layers {short_repr(only)} (dense layers between sparse ones)")


def _layer_types(hf: dict[str, Any], layers: Any, where: str, default: str) -> tuple[str, ...]:
    """Per layer "sliding" | "full": config.json's `layer_types`, else the architecture's rule."""
    given = hf.get("layer_types")
    if given is not None:
        if not isinstance(given, list):
            raise ModelFormatError(f"{where}: layer_types must be a list, got {short_repr(given)}")
        for t in given:
            if t not in ("sliding_attention", "full_attention"):
                raise UnsupportedModelError(f"{where}: layer type {short_repr(t)} is not supported")
        return tuple("sliding" if t == "sliding_attention" else "full" for t in given)
    if default == "none" or not isinstance(layers, int) or isinstance(layers, bool) or not 0 < layers <= 1 << 20:
        return ()
    if default == "alternate":  # Gemma 2: even layers slide
        return tuple("sliding" if i % 2 == 0 else "full" for i in range(layers))
    if default == "qwen":  # layers from max_window_layers on slide
        first = hf.get("max_window_layers", layers)
        first = first if isinstance(first, int) and not isinstance(first, bool) else layers
        return tuple("sliding" if i >= first else "full" for i in range(layers))
    return ("sliding",) * layers


def _float_list(value: Any, key: str, where: str) -> tuple[float, ...]:
    if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise ModelFormatError(f"{where}: rope_parameters.{key} must be a list of numbers, got {short_repr(value)}")
    return tuple(float(v) for v in value)


def _rope_scaling(scaling: dict[str, Any], hf: dict[str, Any], max_positions: Any, where: str,
                  unsupported) -> RopeScaling | None:
    """transformers' RoPE parameters -> RopeScaling (None: plain RoPE)."""
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "su":  # Phi-3's old name
        rope_type = "longrope"
    if rope_type == "default":
        return None
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(f"{where}: unsupported RoPE scaling {short_repr(rope_type)} "
                                    f"(supported: default, {', '.join(ROPE_TYPES)})")
    unknown = sorted(k for k in scaling if k not in _ROPE_KEYS)
    if unknown:
        raise unsupported(f"RoPE parameter {short_repr(unknown[0])} (of {rope_type} scaling)")

    def num(key: str, default: Any = None) -> Any:
        value = scaling.get(key, default)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise ModelFormatError(f"{where}: rope_parameters.{key} must be a number, got {short_repr(value)}")
        return None if value is None else float(value)

    original = hf.get("original_max_position_embeddings") if rope_type == "longrope" else None
    original = original if original is not None else scaling.get("original_max_position_embeddings")
    if rope_type in ("yarn", "longrope") and original is None:
        original = max_positions
    usable = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (original, max_positions))
    factor = num("factor")
    if factor is None and rope_type in ("yarn", "longrope") and usable:
        factor = max_positions / original
    kw: dict[str, Any] = dict(kind=rope_type, factor=1.0 if factor is None else factor,
                              original_max_position_embeddings=original)
    if rope_type == "llama3":
        kw.update(low_freq_factor=num("low_freq_factor"), high_freq_factor=num("high_freq_factor"))
    elif rope_type == "yarn":
        attention = num("attention_factor")
        mscale, mscale_all = num("mscale"), num("mscale_all_dim")
        if attention is None and mscale and mscale_all and kw["factor"] > 0:
            def m(scale: float, k: float) -> float:
                return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0
            attention = m(kw["factor"], mscale) / m(kw["factor"], mscale_all)
        truncate = scaling.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ModelFormatError(f"{where}: rope_parameters.truncate must be true or false, got {short_repr(truncate)}")
        kw.update(beta_fast=num("beta_fast") or 32.0, beta_slow=num("beta_slow") or 1.0, truncate=truncate,
                  attention_factor=attention)
    elif rope_type == "longrope":
        kw.update(attention_factor=num("attention_factor"),
                  short_factor=_float_list(scaling.get("short_factor"), "short_factor", where),
                  long_factor=_float_list(scaling.get("long_factor"), "long_factor", where))
    try:
        return RopeScaling(**kw)
    except TypeError as e:  # a value of the wrong kind where RopeScaling.check compares it
        raise ModelFormatError(f"{where}: rope_parameters: {e}") from None


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


def _safetensors_weights(path: Path, cfg: ModelConfig, handles: list[tuple[Path, Any, list[str]]],
                         quantized: bool = False, multimodal: bool = False) -> dict[str, WeightRef]:
    """Canonical WeightRefs of the folder's tensors. A tensor no table entry names is refused
    (the quantized parts of a wallbreaker-quantized folder are read by quantized_hf)."""
    if cfg.architecture in MAMBA2_ARCHITECTURES:
        from .mamba import mamba_hf_weights
        return mamba_hf_weights(path, cfg, handles)
    table = hf_to_canonical_table(cfg.architecture, cfg.num_layers, cfg.is_moe)
    weights: dict[str, WeightRef] = {}
    experts: dict[str, dict[int, WeightRef]] = {}
    for file, handle, names in handles:
        for hf_name in names:
            text_name = text_tensor_name(hf_name) if multimodal else hf_name
            if text_name is None:
                continue
            name = table.get(text_name)
            expert = hf_expert(cfg.architecture, hf_name) if name is None and cfg.is_moe else None
            if name is None and expert is None:
                if is_derived(hf_name) or qwen3_next.is_mtp(cfg.architecture, hf_name) or (
                        quantized and hf_name.rsplit(".", 1)[-1] in QUANTIZED_PARTS):
                    continue
                raise ModelFormatError(f"{file.name}: tensor {hf_name!r} is not used by the {cfg.architecture} "
                                       f"architecture; refusing to run the model without it")
            ref = _tensor_ref(handle, hf_name, name or hf_name, name is not None and adds_one(cfg.architecture, name))
            if expert is None:
                weights[name] = ref
            else:
                experts.setdefault(expert[0], {})[expert[1]] = ref
    for name, parts in experts.items():
        missing = next(e for e in range(len(parts) + 1) if e not in parts)  # bounded by what is stored
        if missing < min(len(parts), cfg.num_experts) or len(parts) != cfg.num_experts:
            raise ModelFormatError(f"{path}: {name}: expert {missing} of the config's {cfg.num_experts} is missing"
                                   if missing < cfg.num_experts else
                                   f"{path}: {name}: {len(parts)} experts stored, the config says {cfg.num_experts}")
        weights[name] = stacked_experts(name, [parts[e] for e in range(cfg.num_experts)])
    if cfg.tie_word_embeddings:
        weights.pop("output.weight", None)  # tied: the embedding is the head, as transformers ties it
    elif "output.weight" not in weights:
        raise ModelFormatError(f"{path}: config says untied output head but lm_head.weight is missing")
    return weights


def _tensor_ref(handle, hf_name: str, name: str, add_one: bool) -> WeightRef:
    sl = handle.get_slice(hf_name)
    dtype = getattr(torch, {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(sl.get_dtype(), "float32"))
    shape = tuple(sl.get_shape())
    return WeightRef(name, shape, _DTYPE_NAMES.get(dtype, sl.get_dtype()), _numel(shape) * dtype.itemsize,
                     _loader(handle, hf_name, add_one), load_part=_part_loader(handle, hf_name, add_one))


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
