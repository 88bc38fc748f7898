"""A Hugging Face folder (config.json, *.safetensors, tokenizer.json) -> ModelFiles."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from ..config import ROPE_TYPES, ConfigError, ModelConfig, PoolingConfig, RopeScaling, short_repr
from ..errors import InvalidRequestError, ModelFormatError, ModelNotFoundError, UnsupportedModelError
from ..text.chat_template import ChatTemplate
from ..text.tokenizer import Tokenizer, check_token_ids
from .checks import check_weights, split_fused
from .config_keys import layer_types, number, obj, unsupported as unsupported_key
from .families import adds_one, family, family_of_model_type, hf_expert, hf_to_canonical_table
from .multimodal import decoder_config, is_multimodal, text_tensor_name
from .names import is_derived
from .quantized_hf import QUANTIZED_PARTS, is_quantized_folder, read_quantized_weights
from .safetensors_file import safetensors_handles, tensor_ref
from .weights import ModelFiles, WeightRef, stacked_experts


def read_hf_folder(path: Path) -> ModelFiles:
    """The folder, read as its family (config.json `model_type`) says: formats/families.py."""
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
    if multimodal:
        hf = decoder_config(hf)
    spec = family_of_model_type(hf.get("model_type"), str(path))
    if spec.read_folder is not None:
        return spec.read_folder(path)
    if spec.hf_text_config and "text_config" in hf:
        if not isinstance(hf["text_config"], dict):
            raise ModelFormatError(f"{cfg_path}: text_config is not a JSON object")
        hf = {**hf["text_config"], "model_type": spec.hf_model_types[0]}
    config = config_from_hf(hf, path)
    config = with_pooling(config, path, hf)
    handles = safetensors_handles(path)
    n_tensors = sum(len(names) for _, _, names in handles)
    if config.num_layers > n_tensors:
        raise ModelFormatError(f"{cfg_path}: num_hidden_layers is {config.num_layers} but the folder has only "
                               f"{n_tensors} tensors")
    quantized = is_quantized_folder(hf)
    weights = _safetensors_weights(path, config, handles, quantized, multimodal)
    if quantized:
        weights.update(read_quantized_weights(path, config, hf["quantization_config"]))
    split_fused(str(path), config, weights)
    if spec.hf_weights_fixup is not None:
        spec.hf_weights_fixup(str(path), config, weights)
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
    "norm_topk_prob": "norm_topk_prob", "hidden_act": "hidden_act",
}
_REQUIRED = object()
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# RoPE parameters we read; any other key in them changes the rotation in a way we do not run.
_ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
                        "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "truncate",
                        "attention_factor", "mscale", "mscale_all_dim", "short_factor", "long_factor",
                        "partial_rotary_factor"})


def config_from_hf(hf: dict[str, Any], path: Path) -> ModelConfig:
    where = f"{path}/config.json"
    spec = family_of_model_type(hf.get("model_type"), str(path))
    if spec.hf_config is not None:
        return spec.hf_config(hf, path, spec.name)
    arch_fields: dict[str, Any] = {}  # what only this family has
    if spec.hf_keys is not None:  # its keys renamed to the others' (before the readers below bind `hf`)
        hf, arch_fields = spec.hf_keys(hf, where)

    def get(key: str, default: Any = _REQUIRED, within: dict[str, Any] = hf) -> Any:
        value = within.get(key, default)
        if value is _REQUIRED:
            raise ModelFormatError(f"{where}: missing key {key!r}")
        return value

    def unsupported(what: str) -> UnsupportedModelError:
        return unsupported_key(where, what)

    _refuse_unimplemented(_without(hf, spec.hf_own_keys), unsupported)
    rope = obj(hf, "rope_parameters", where)
    global_rope = obj(rope, "full_attention", where) if "full_attention" in rope else rope
    obj(rope, "sliding_attention", where)  # read by the families that have one (Gemma 3); checked for all
    scaling = obj(hf, "rope_scaling", where) if hf.get("rope_scaling") else global_rope
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
    act_key = next((k for k in spec.hf_act_keys[:-1] if hf.get(k) is not None), spec.hf_act_keys[-1])
    act = hf.get(act_key, spec.hf_act)
    if not isinstance(act, str) or act not in _ACTIVATIONS:
        raise unsupported(f"{act_key} {short_repr(act)}")
    extra: dict[str, Any] = dict(hidden_act=_ACTIVATIONS[act],
                                 attn_logit_softcap=number(hf, "attn_logit_softcapping", None),
                                 final_logit_softcap=number(hf, "final_logit_softcapping", None))
    if spec.sliding is not None and hf.get("sliding_window") is not None and \
            (spec.sliding != "max_window_layers" or hf.get("use_sliding_window")):
        # Mistral, Mixtral and Phi-3 slide every layer; Qwen only with use_sliding_window, from max_window_layers
        extra.update(sliding_window=hf.get("sliding_window"), layer_types=layer_types(hf, layers, where, spec.sliding))
    if spec.qk_norm:
        extra["qk_norm"] = True
    if isinstance(rope.get("mrope_section"), list):  # Qwen2.5-VL's and Qwen3-VL's decoders
        extra.update(mrope_section=tuple(rope["mrope_section"]),
                     mrope_interleaved=rope.get("mrope_interleaved") is True)
    if spec.hf_fields is not None:
        extra.update(spec.hf_fields(hf, where))
    extra.update(arch_fields)
    try:
        return ModelConfig(
            architecture=spec.name, vocab_size=get("vocab_size"), hidden_size=hidden,
            intermediate_size=get("intermediate_size"), num_layers=layers, num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=number(hf, "rms_norm_eps", 1e-6),
            rope_theta=number(global_rope, "rope_theta", number(hf, "rope_theta", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=hf.get("tie_word_embeddings", spec.tied_embeddings),
            qkv_bias=hf.get("attention_bias", spec.qkv_bias),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            **extra)
    except ConfigError as e:
        qwen_experts = e.field == "num_experts" and "num_experts" in hf  # transformers 4's name for Qwen3-MoE
        key = "num_experts" if qwen_experts else {**_HF_KEYS, **spec.hf_field_keys}.get(e.field, e.field)
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


def _without(hf: dict[str, Any], keys: frozenset[str]) -> dict[str, Any]:
    """config.json less `keys` (at the top and in the RoPE parameters): those its family reads itself,
    for the common refusals of the rest."""
    if not keys:
        return hf
    hf = {k: v for k, v in hf.items() if k not in keys}
    if isinstance(hf.get("rope_parameters"), dict):
        hf["rope_parameters"] = {k: v for k, v in hf["rope_parameters"].items() if k not in keys}
    return hf


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


def _safetensors_weights(path: Path, cfg: ModelConfig, handles: list[tuple[Path, Any, list[str]]],
                         quantized: bool = False, multimodal: bool = False) -> dict[str, WeightRef]:
    """Canonical WeightRefs of the folder's tensors. A tensor no table entry names is refused
    (the quantized parts of a wallbreaker-quantized folder are read by quantized_hf)."""
    spec = family(cfg.architecture)
    if spec.hf_weights is not None:
        return spec.hf_weights(path, cfg, handles)
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
                if is_derived(hf_name) or hf_name.startswith(spec.hf_unread) or (
                        quantized and hf_name.rsplit(".", 1)[-1] in QUANTIZED_PARTS):
                    continue
                raise ModelFormatError(f"{file.name}: tensor {hf_name!r} is not used by the {cfg.architecture} "
                                       f"architecture; refusing to run the model without it")
            ref = tensor_ref(handle, hf_name, name or hf_name, name is not None and adds_one(cfg.architecture, name))
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
