"""The Llama family's config keys beyond the common ones, as their entries in formats/families.py
read and write them: Llama with Mistral (a sliding window) and Mixtral (experts), Qwen2/3 (a window
only with `use_sliding_window`, from `max_window_layers` on), Qwen3-MoE, Phi-3 (q/k/v and gate/up
stored fused, LongRoPE's original context at the top level of config.json), Qwen2.5-VL's decoder as
llama.cpp's converter writes it (`qwen2vl`: Qwen2 with M-RoPE sections), and Qwen3-VL's (`qwen3vl`)."""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig, short_repr
from .config_keys import unsupported
from .names import FUSED_GATE_UP
from .weights import WeightRef


def llama_hf_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    if hf.get("model_type") == "mixtral":
        return dict(num_experts=hf.get("num_local_experts"), num_experts_per_tok=hf.get("num_experts_per_tok"))
    return {}


def qwen3moe_hf_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Qwen3-MoE may make some layers dense (mlp_only_layers, decoder_sparse_step); ours are all sparse."""
    step, only = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if step not in (1, None):
        raise unsupported(where, f"decoder_sparse_step {short_repr(step)} (dense layers between sparse ones)")
    if only:
        raise unsupported(where, f"mlp_only_layers {short_repr(only)} (dense layers between sparse ones)")
    return dict(num_experts=hf.get("num_experts", hf.get("num_local_experts")),
                num_experts_per_tok=hf.get("num_experts_per_tok"),
                expert_intermediate_size=hf.get("moe_intermediate_size"),
                norm_topk_prob=hf.get("norm_topk_prob", False))


def qwen2vl_gguf_fields(k: Any) -> dict[str, Any]:
    """`qwen2vl.rope.dimension_sections`: the (temporal, row, column) M-RoPE sections, in rotated
    pairs, padded to four by the converter (the fourth is 0 for Qwen2-VL and 2.5-VL)."""
    sections = k.raw(k.a + "rope.dimension_sections")
    if not (isinstance(sections, list) and len(sections) in (3, 4) and all(isinstance(n, int) for n in sections)):
        raise unsupported(k.name, f"{k.a}rope.dimension_sections {short_repr(sections)} (expected three or four sizes)")
    if len(sections) == 4 and sections[3]:
        raise unsupported(k.name, f"{k.a}rope.dimension_sections {short_repr(sections)} (a fourth section)")
    return dict(mrope_section=tuple(sections[:3]))


def qwen3vl_gguf_fields(k: Any) -> dict[str, Any]:
    """Qwen3-VL's decoder (`qwen3vl`): Qwen2.5-VL's sections, interleaved as llama.cpp's IMROPE is;
    `n_deepstack_layers` is checked against the mmproj's DeepStack mergers where the two meet (llm.py)."""
    n = k.integer(k.a + "n_deepstack_layers", 0)
    if n < 0 or n > k.layers:
        raise unsupported(k.name, f"{k.a}n_deepstack_layers {n} (of {k.layers} layers)")
    return dict(qwen2vl_gguf_fields(k), mrope_interleaved=True)


def llama_hf_model_type(c: ModelConfig) -> str:
    """Which transformers class a llama config is: with experts Mixtral, with a window Mistral."""
    if c.is_moe:
        return "mixtral"
    return "mistral" if c.sliding_window is not None else "llama"


def llama_label(c: ModelConfig) -> str:
    """The architecture as the user knows it: llama with experts is Mixtral's."""
    return "llama (mixture of experts)" if c.is_moe else "llama"


def _act_and_window(c: ModelConfig, hf: dict[str, Any]) -> None:
    hf["hidden_act"] = c.hidden_act
    if c.sliding_window is not None:
        hf.update(sliding_window=c.sliding_window, layer_types=[f"{t}_attention" for t in c.layer_types])


def llama_hf_write(c: ModelConfig, hf: dict[str, Any]) -> None:
    _act_and_window(c, hf)
    if c.is_moe:
        if not c.norm_topk_prob:
            raise ValueError("Mixtral always renormalizes its top-k router weights (norm_topk_prob)")
        hf.update(num_local_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok)


def qwen_hf_write(c: ModelConfig, hf: dict[str, Any]) -> None:
    _act_and_window(c, hf)
    if c.sliding_window is not None:
        hf["use_sliding_window"] = True
    else:
        hf.update(use_sliding_window=False, sliding_window=None)


def qwen3moe_hf_write(c: ModelConfig, hf: dict[str, Any]) -> None:
    qwen_hf_write(c, hf)
    hf.update(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
              moe_intermediate_size=c.expert_ffn, norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=1,
              mlp_only_layers=[])


def phi3_hf_write(c: ModelConfig, hf: dict[str, Any]) -> None:
    _act_and_window(c, hf)
    if c.sliding_window is None:
        hf.update(use_sliding_window=False, sliding_window=None)
    if c.rope_scaling is not None and c.rope_scaling.kind == "longrope":
        hf["original_max_position_embeddings"] = c.rope_scaling.original_max_position_embeddings


def phi3_gguf_weights(cfg: ModelConfig, weights: dict[str, WeightRef]) -> None:
    """Phi-3's `ffn_up` holds gate and up, as llama.cpp stores it: named as fused, for `split_fused`."""
    if "blk.0.ffn_gate.weight" in weights:
        return
    for i in range(cfg.num_layers):
        if f"blk.{i}.ffn_up.weight" in weights:
            weights[f"blk.{i}.{FUSED_GATE_UP}"] = weights.pop(f"blk.{i}.ffn_up.weight")
