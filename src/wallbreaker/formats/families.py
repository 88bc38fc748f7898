"""The model families: one `ArchSpec` each, in one table (`FAMILIES`). Everything that differs by
family is said here, or in a function of the family's module that its entry names: how its files
name it (config.json `model_type`, GGUF `general.architecture`), how its config and tensors are read,
how it is written back, which class of models/ runs it and which engine features it supports. The
readers, writers and the engine ask the spec; none of them names a family. docs/adding-a-family.md
says how to add one.

Canonical tensor names are llama.cpp's (formats/names.py); a Hugging Face folder's are mapped onto
them by `hf_to_canonical_table`, which builds each family's table from the common Llama-style names
and what its spec adds.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..config import ModelConfig, short_repr
from ..errors import UnsupportedModelError
from . import bert, gemma, gpt_oss, lfm2, llama, mamba, mamba1, mamba_tensors, qwen3_next, qwen3_next_weights, rwkv7
from .names import FUSED_GATE_UP, FUSED_QKV, is_norm

# Engine features a family may lack (a recurrent state is not sharded across ranks, nor rolled back
# as a draft model's must be; it is written to the disk tier and saved sessions beside the blocks).
TENSOR_PARALLEL, DISK_TIER, SESSIONS, DRAFT_MODEL = "tensor_parallel", "disk_tier", "sessions", "draft_model"
ALL_FEATURES = frozenset({TENSOR_PARALLEL, DISK_TIER, SESSIONS, DRAFT_MODEL})


@dataclass(frozen=True)
class HFExperts:
    """How a folder stores a mixture's experts: `model.layers.N.{prefix}.experts.E.{part}.weight`,
    each part one expert's slice of a canonical [experts, out, in] tensor; the router is
    `{prefix}.gate.weight`."""

    prefix: str
    parts: Mapping[str, str]

    @property
    def pattern(self) -> re.Pattern[str]:
        return re.compile(rf"model\.layers\.(\d+)\.{re.escape(self.prefix)}\.experts\.(\d+)\."
                          rf"({'|'.join(map(re.escape, self.parts))})\.weight")


_MLP_EXPERTS = HFExperts("mlp", {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight",
                                 "down_proj": "ffn_down_exps.weight"})


@dataclass(frozen=True)
class ArchSpec:
    """One model family. Fields left at their defaults are the Llama-style family's behaviour."""

    name: str  # ModelConfig.architecture, the same as GGUF's general.architecture
    model: str  # the class that runs it: "module.Class" in models/ (models/__init__.py resolves it)
    hf_model_types: tuple[str, ...] = ()  # config.json model_types read as this family
    # -- features -------------------------------------------------------------------------------
    features: frozenset[str] = ALL_FEATURES
    # -- config: whole readers of their own (the generic ones in hf_model.py, gguf_model.py are skipped)
    read_folder: Callable[[Path], Any] | None = None  # a Hugging Face folder -> ModelFiles
    read_gguf: Callable[[Any], Any] | None = None  # an open GGUF file -> ModelFiles
    hf_config: Callable[[dict[str, Any], Path, str], ModelConfig] | None = None  # (config.json, path, name)
    gguf_config: Callable[[Any], ModelConfig] | None = None
    # -- config: what the generic readers read differently
    hf_text_config: bool = False  # config.json may nest the model in `text_config` (a multimodal wrapper)
    hf_keys: Callable[[dict[str, Any], str], tuple[dict[str, Any], dict[str, Any]]] | None = None  # renamed keys, own fields
    hf_fields: Callable[[dict[str, Any], str], dict[str, Any]] | None = None  # (config.json, where) -> fields
    hf_own_keys: frozenset[str] = frozenset()  # keys the generic reader would refuse that hf_fields reads
    hf_field_keys: Mapping[str, str] = field(default_factory=dict)  # ModelConfig field -> key, for errors
    hf_act_keys: tuple[str, ...] = ("hidden_act",)  # the activation's keys, the first one given wins
    hf_act: str = "silu"  # the activation where config.json names none
    tied_embeddings: bool = False  # tie_word_embeddings where config.json does not say
    qkv_bias: bool = False  # attention_bias where config.json does not say
    qk_norm: bool = False  # RMSNorm on each head's q and k
    sliding: str | None = "all"  # the common window rule (config_keys.layer_types); None: hf/gguf_fields say
    gguf_keys: frozenset[str] = frozenset()  # `<arch>.*` keys read beyond the common ones
    gguf_fields: Callable[[Any], dict[str, Any]] | None = None  # (config_keys.GGUFKeys) -> fields
    gguf_field_keys: Mapping[str, str] = field(default_factory=dict)  # ModelConfig field -> key, for errors
    gguf_extra_blocks: str | None = None  # key counting blocks after the model's own (left unread)
    partial_rope: bool = False  # rope.dimension_count may be below the head size (read by gguf_fields)
    requires_experts: bool = False  # a GGUF without expert_count is refused
    # -- tensors
    hf_tensor_names: Callable[[int], dict[str, str]] | None = None  # the whole HF -> canonical table
    hf_layer_names: Mapping[str, str] = field(default_factory=dict)  # per-layer names beside the common ones
    hf_experts: HFExperts | None = None
    hf_unread: tuple[str, ...] = ()  # prefixes of folder tensors the model never reads
    hf_weights: Callable[[Path, ModelConfig, list], dict] | None = None  # a folder's tensors read whole
    hf_weights_fixup: Callable[[str, ModelConfig, dict], None] | None = None  # (source, config, weights)
    gguf_weights_fixup: Callable[[ModelConfig, dict], None] | None = None
    norm_adds_one: Callable[[str], bool] | None = None  # norms stored as w and applied as 1 + w
    layer_tensors: Callable[[ModelConfig, int], dict[str, tuple[int, ...]]] | None = None  # none: Llama's
    final_norm: str = "output_norm.weight"
    split_fused: bool = True  # q/k/v or gate/up stored fused (attn_qkv, ffn_gate_up) are split when read
    # -- writers
    writes_fused: bool = False  # written fused: q/k/v as attn_qkv, gate and up as one ffn_up (Phi-3)
    rope_permuted: bool = False  # GGUF q/k rows in llama.cpp's interleaved-RoPE order
    hf_classes: Mapping[str, str] = field(default_factory=dict)  # model_type -> transformers class written
    hf_model_type: Callable[[ModelConfig], str] | None = None  # which of them a config is (else the first)
    hf_write: Callable[[ModelConfig, dict[str, Any]], None] | None = None  # config.json's keys beyond the common
    gguf_write_keys: Callable[[Any, ModelConfig], None] | None = None  # all hyperparameter keys, its own way
    gguf_write_more_keys: Callable[[Any, ModelConfig], None] | None = None  # after the common ones
    gguf_kv_heads_per_layer: bool = False  # a hybrid's head_count_kv as one count a layer (0: recurrent)
    label: Callable[[ModelConfig], str] | None = None  # the name errors use, where it is not `name`

    def supports(self, feature: str) -> bool:
        return feature in self.features

    def describe(self, c: ModelConfig) -> str:
        return self.label(c) if self.label is not None else self.name


# a recurrent state is kept in RAM, on disk and in sessions, and never rolled back; split across ranks where
# the family's mixers say how (LFM2's convolutions by channels, Mamba2's heads: TENSOR_PARALLEL below)
_RECURRENT = frozenset({DISK_TIER, SESSIONS})
_QWEN3_NEXT_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "linear_attn.in_proj_qkvz.weight": "ssm_in.weight",  # brought to the converter's form: qwen3_next_weights.py
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_GEMMA_NAMES = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
_GEMMA = dict(hf_act_keys=("hidden_activation", "hidden_act"), hf_act="gelu_pytorch_tanh", tied_embeddings=True,
              sliding=None, hf_layer_names=_GEMMA_NAMES, norm_adds_one=is_norm, model="gemma.GemmaCausalLM")
_QWEN = dict(model="llama.LlamaCausalLM", sliding="max_window_layers", hf_write=llama.qwen_hf_write)
_MAMBA2 = dict(features=_RECURRENT | {TENSOR_PARALLEL}, hf_config=mamba.mamba_config_from_hf, gguf_config=mamba.mamba_config_from_gguf,
               hf_weights=mamba.mamba_hf_weights, layer_tensors=mamba_tensors.mamba_layer_tensors,
               gguf_write_keys=mamba.add_mamba2_metadata)

FAMILIES: tuple[ArchSpec, ...] = (
    # llama.cpp's names: Mistral and Mixtral are "llama" (a sliding window, experts), as in their GGUF files
    ArchSpec("llama", "llama.LlamaCausalLM", ("llama", "mistral", "mixtral"), hf_fields=llama.llama_hf_fields,
             hf_experts=HFExperts("block_sparse_moe", {"w1": "ffn_gate_exps.weight", "w2": "ffn_down_exps.weight",
                                                       "w3": "ffn_up_exps.weight"}),
             rope_permuted=True, label=llama.llama_label, hf_model_type=llama.llama_hf_model_type,
             hf_classes={"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                         "mixtral": "MixtralForCausalLM"}, hf_write=llama.llama_hf_write),
    ArchSpec("qwen2", hf_model_types=("qwen2",), qkv_bias=True, hf_classes={"qwen2": "Qwen2ForCausalLM"}, **_QWEN),
    # Qwen2.5-VL's and Qwen3-VL's decoders in llama.cpp's GGUF (their folders read as qwen2 and qwen3,
    # formats/multimodal.py)
    ArchSpec("qwen2vl", qkv_bias=True, gguf_keys=frozenset({"rope.dimension_sections"}),
             gguf_fields=llama.qwen2vl_gguf_fields, **_QWEN),
    ArchSpec("qwen3vl", qk_norm=True, gguf_keys=frozenset({"rope.dimension_sections", "n_deepstack_layers"}),
             gguf_fields=llama.qwen3vl_gguf_fields, **_QWEN),
    ArchSpec("qwen3", hf_model_types=("qwen3",), qk_norm=True, hf_classes={"qwen3": "Qwen3ForCausalLM"}, **_QWEN),
    ArchSpec("qwen3moe", hf_model_types=("qwen3_moe",), qk_norm=True, hf_fields=llama.qwen3moe_hf_fields,
             hf_experts=_MLP_EXPERTS, requires_experts=True, hf_classes={"qwen3_moe": "Qwen3MoeForCausalLM"},
             **{**_QWEN, "hf_write": llama.qwen3moe_hf_write}),
    ArchSpec("phi3", "llama.LlamaCausalLM", ("phi3",),
             hf_layer_names={"self_attn.qkv_proj.weight": FUSED_QKV, "mlp.gate_up_proj.weight": FUSED_GATE_UP},
             gguf_weights_fixup=llama.phi3_gguf_weights, writes_fused=True, hf_classes={"phi3": "Phi3ForCausalLM"},
             hf_write=llama.phi3_hf_write),
    ArchSpec("gemma2", hf_model_types=("gemma2",), hf_fields=gemma.gemma2_hf_fields,
             gguf_fields=gemma.gemma2_gguf_fields, hf_classes={"gemma2": "Gemma2ForCausalLM"},
             hf_write=gemma.gemma2_hf_write, **_GEMMA),
    ArchSpec("gemma3", hf_model_types=("gemma3_text", "gemma3"), hf_text_config=True, qk_norm=True,
             hf_fields=gemma.gemma3_hf_fields, gguf_fields=gemma.gemma3_gguf_fields,
             hf_classes={"gemma3_text": "Gemma3ForCausalLM"}, hf_write=gemma.gemma3_hf_write, **_GEMMA),
    ArchSpec("bert", "bert.BertModel", ("bert",), read_folder=bert.read_bert_folder, read_gguf=bert.read_bert_gguf),
    ArchSpec("lfm2", "lfm2.Lfm2CausalLM", ("lfm2",), features=_RECURRENT | {TENSOR_PARALLEL}, hf_keys=lfm2.hf_config_keys, qk_norm=True,
             hf_field_keys={"conv_kernel": "conv_L_cache"}, gguf_keys=frozenset({"shortconv.l_cache"}),
             gguf_fields=lfm2.gguf_fields, gguf_field_keys={"conv_kernel": "shortconv.l_cache"},
             hf_tensor_names=lfm2.hf_tensor_names, hf_weights_fixup=lfm2.squeeze_conv_weights,
             final_norm=lfm2.FINAL_NORM, gguf_kv_heads_per_layer=True),
    ArchSpec("qwen3next", "qwen3_next.Qwen3NextCausalLM", ("qwen3_next",), features=_RECURRENT,
             hf_fields=qwen3_next.config_from_hf, hf_own_keys=qwen3_next.HF_OWN_KEYS,
             hf_field_keys=qwen3_next.HF_FIELD_KEYS, qk_norm=True, gguf_keys=qwen3_next.GGUF_KEYS,
             gguf_fields=qwen3_next.config_from_gguf, gguf_field_keys=qwen3_next.GGUF_FIELD_KEYS,
             gguf_extra_blocks="nextn_predict_layers", partial_rope=True, requires_experts=True,
             hf_layer_names=_QWEN3_NEXT_NAMES, hf_experts=_MLP_EXPERTS, hf_unread=("mtp.",),
             hf_weights_fixup=qwen3_next_weights.canonical_hf_weights,
             gguf_weights_fixup=qwen3_next_weights.drop_mtp_layers, norm_adds_one=qwen3_next.norm_adds_one,
             layer_tensors=qwen3_next.layer_tensors, split_fused=False,
             gguf_write_more_keys=qwen3_next.add_gguf_keys),
    ArchSpec("mamba2", "mamba2.Mamba2CausalLM", ("mamba2",), **_MAMBA2),
    ArchSpec("granitehybrid", "granite_hybrid.GraniteHybridCausalLM", ("granitemoehybrid",), rope_permuted=True,
             **_MAMBA2),
    # Mamba (v1); Falcon-Mamba is GGUF mamba with ssm.dt_b_c_rms
    ArchSpec("mamba", "mamba.MambaCausalLM", ("mamba", "falcon_mamba"), features=_RECURRENT,
             hf_config=mamba1.config_from_hf, gguf_config=mamba1.config_from_gguf,
             hf_tensor_names=mamba1.hf_tensor_names, hf_weights_fixup=mamba1.canonical_hf_weights,
             layer_tensors=mamba1.layer_tensors, gguf_write_keys=mamba1.add_gguf_keys),
    # gpt-oss: sinks, even layers sliding, YaRN untruncated, biased router and experts (formats/gpt_oss.py)
    ArchSpec("gpt-oss", "gpt_oss.GptOssCausalLM", ("gpt_oss",), features=ALL_FEATURES - {TENSOR_PARALLEL},
             qkv_bias=True, sliding=None, hf_fields=gpt_oss.hf_fields, hf_own_keys=frozenset({"swiglu_alpha", "swiglu_limit"}),
             hf_field_keys=gpt_oss.HF_FIELD_KEYS, gguf_keys=gpt_oss.GGUF_KEYS, gguf_fields=gpt_oss.gguf_fields,
             requires_experts=True, hf_tensor_names=gpt_oss.hf_tensor_names,
             hf_weights_fixup=gpt_oss.canonical_hf_weights, layer_tensors=gpt_oss.layer_tensors),
    # RWKV-7 (formats/rwkv7.py): fla-hub's folders, llama.cpp's GGUF; LayerNorms with bias, no attention
    ArchSpec("rwkv7", "rwkv7.Rwkv7CausalLM", ("rwkv7",), features=_RECURRENT, hf_config=rwkv7.config_from_hf,
             gguf_config=rwkv7.config_from_gguf, hf_tensor_names=rwkv7.hf_tensor_names, hf_unread=rwkv7.HF_UNREAD,
             hf_weights_fixup=rwkv7.canonical_hf_weights, gguf_weights_fixup=rwkv7.drop_first_value_pair,
             layer_tensors=rwkv7.layer_tensors, gguf_write_keys=rwkv7.add_gguf_keys),
)


_BY_NAME = {s.name: s for s in FAMILIES}
_BY_MODEL_TYPE = {t: s for s in FAMILIES for t in s.hf_model_types}
ARCHITECTURES = tuple(_BY_NAME)
HF_MODEL_TYPES = tuple(_BY_MODEL_TYPE)


def family(architecture: str, where: str = "") -> ArchSpec:
    """The spec of `architecture` (ModelConfig's, GGUF's general.architecture); an
    UnsupportedModelError, naming `where`, for one we do not run."""
    spec = _BY_NAME.get(architecture) if isinstance(architecture, str) else None
    if spec is None:
        prefix = f"{where}: " if where else ""
        raise UnsupportedModelError(f"{prefix}unsupported architecture {short_repr(architecture)} "
                                    f"(supported: {', '.join(ARCHITECTURES)})")
    return spec


def family_of_model_type(model_type: Any, where: str) -> ArchSpec:
    """The spec that reads config.json's `model_type`."""
    spec = _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if spec is None:
        raise UnsupportedModelError(f"{where}: unsupported model_type {short_repr(model_type)} "
                                    f"(supported: {', '.join(HF_MODEL_TYPES)})")
    return spec


# --- Hugging Face tensor names ---------------------------------------------------------------

_HF_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "score.weight": "cls.output.weight",  # *ForSequenceClassification: a reranker's head, as llama.cpp names it
}
_HF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_HF_QK_NORM = {"self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}


def hf_to_canonical_table(architecture: str, num_layers: int, moe: bool = False) -> dict[str, str]:
    """HF name -> canonical name of every tensor but the experts' (`hf_expert`)."""
    spec = family(architecture)
    if spec.hf_tensor_names is not None:
        return spec.hf_tensor_names(num_layers)
    per_layer = {**_HF_LAYER, **spec.hf_layer_names, **(_HF_QK_NORM if spec.qk_norm else {})}
    if moe:
        for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
            del per_layer[name]
        per_layer[f"{spec.hf_experts.prefix if spec.hf_experts else 'mlp'}.gate.weight"] = "ffn_gate_inp.weight"
    table = dict(_HF_TOP)
    for i in range(num_layers):
        for hf, gg in per_layer.items():
            table[f"model.layers.{i}.{hf}"] = f"blk.{i}.{gg}"
    return table


def hf_expert(architecture: str, hf_name: str) -> tuple[str, int] | None:
    """An expert's projection -> (the canonical 3-D tensor, the expert's index); else None."""
    experts = family(architecture).hf_experts
    m = experts.pattern.fullmatch(hf_name) if experts is not None else None
    if m is None:
        return None
    return f"blk.{int(m.group(1))}.{experts.parts[m.group(3)]}", int(m.group(2))


def hf_expert_name(architecture: str, name: str, expert: int) -> str:
    """The inverse of `hf_expert`: the HF name of expert `expert`'s part of canonical `name`."""
    experts = family(architecture).hf_experts
    layer, part = name.split(".", 2)[1], name.split(".", 2)[2]
    hf = {v: k for k, v in experts.parts.items()}[part]
    return f"model.layers.{layer}.{experts.prefix}.experts.{expert}.{hf}.weight"


def adds_one(architecture: str, name: str) -> bool:
    """Whether the folder stores this norm as w where it is applied as 1 + w (Gemma's; Qwen3-Next's but
    its delta net's gated norm): the readers give the effective multiplier."""
    rule = family(architecture).norm_adds_one
    return rule is not None and rule(name)
