"""Write a model as a GGUF file that llama.cpp (and transformers' GGUF loader) can read.

Tensors come in wallbreaker's canonical layout and are put into llama.cpp's on-disk layout here:
q/k rows of `llama` files are permuted the way convert_hf_to_gguf permutes them; Phi-3's q/k/v are
fused into `attn_qkv` and its gate and up into `ffn_up`; experts are [experts, out, in] tensors as
they come. Gemma norms are already the effective multiplier (1 + w), which is also what llama.cpp
stores, so they pass through. RoPE scaling is written the way llama.cpp reads it: Llama 3's as
`rope_freqs.weight`, LongRoPE's as `rope_factors_{short,long}.weight`.
"""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from wallbreaker.config import ModelConfig, RopeScaling
from wallbreaker.formats.checks import layer_tensors, top_tensors
from wallbreaker.formats.families import family
from wallbreaker.formats.names import is_norm, llama_permute

Q = gguf.GGMLQuantizationType

_FILE_TYPES: dict[Q, gguf.LlamaFileType] = {
    Q.F32: gguf.LlamaFileType.ALL_F32,
    Q.F16: gguf.LlamaFileType.MOSTLY_F16,
    Q.BF16: gguf.LlamaFileType.MOSTLY_BF16,
    Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
    Q.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
    Q.Q5_0: gguf.LlamaFileType.MOSTLY_Q5_0,
    Q.Q5_1: gguf.LlamaFileType.MOSTLY_Q5_1,
    Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
    Q.Q2_K: gguf.LlamaFileType.MOSTLY_Q2_K,
    Q.Q3_K: gguf.LlamaFileType.MOSTLY_Q3_K_M,
    Q.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_M,
    Q.Q5_K: gguf.LlamaFileType.MOSTLY_Q5_K_M,
    Q.Q6_K: gguf.LlamaFileType.MOSTLY_Q6_K,
    Q.IQ1_S: gguf.LlamaFileType.MOSTLY_IQ1_S, Q.IQ1_M: gguf.LlamaFileType.MOSTLY_IQ1_M,
    Q.IQ2_XXS: gguf.LlamaFileType.MOSTLY_IQ2_XXS, Q.IQ2_XS: gguf.LlamaFileType.MOSTLY_IQ2_XS,
    Q.IQ2_S: gguf.LlamaFileType.MOSTLY_IQ2_S, Q.IQ3_XXS: gguf.LlamaFileType.MOSTLY_IQ3_XXS,
    Q.IQ3_S: gguf.LlamaFileType.MOSTLY_IQ3_S, Q.IQ4_NL: gguf.LlamaFileType.MOSTLY_IQ4_NL,
    Q.IQ4_XS: gguf.LlamaFileType.MOSTLY_IQ4_XS, Q.TQ1_0: gguf.LlamaFileType.MOSTLY_TQ1_0,
    Q.TQ2_0: gguf.LlamaFileType.MOSTLY_TQ2_0, Q.MXFP4: gguf.LlamaFileType.MOSTLY_MXFP4_MOE,
    Q.NVFP4: gguf.LlamaFileType.MOSTLY_NVFP4,
}


def write_gguf(
    path: str | Path,
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    tokenizer_metadata: dict[str, Any],
    tensor_types: dict[str, gguf.GGMLQuantizationType] | None = None,
    chat_template: str | None = None,
    name: str = "wallbreaker",
    raw_tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
) -> Path:
    """Write `tensors` (canonical names and layout) with `config` and the tokenizer as a GGUF file.

    `tensor_types` picks each tensor's stored type (default F32); 1-D tensors and norms are always
    F32, as llama.cpp keeps them. Quantization is gguf-py's reference `gguf.quants.quantize`.
    `raw_tensors` are already encoded blocks ([rows, bytes per row] uint8) in llama.cpp's on-disk
    layout (q/k rows permuted for `llama`), written as they are.
    """
    path = Path(path)
    arch = config.architecture
    known = set(top_tensors(config)).union(*(layer_tensors(config, i) for i in range(config.num_layers)))
    if not config.tie_word_embeddings:
        known.add("output.weight")
    unknown = sorted((set(tensors) | set(raw_tensors or {})) - known)
    if unknown:
        raise ValueError(f"not canonical {arch} tensor names: {unknown}")
    tensor_types = dict(tensor_types or {})

    on_disk = _fuse(config, {n: _to_disk(n, t, config) for n, t in tensors.items()}, tensor_types)
    encoded = {n: _encode(n, t, tensor_types.get(n, Q.F32)) for n, t in on_disk.items()}
    encoded.update(raw_tensors or {})
    encoded.update({n: (t, Q.F32) for n, t in _rope_tensors(config).items()})

    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name)
    writer.add_file_type(_file_type(encoded))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    spec = family(arch)
    if spec.gguf_write_keys is not None:
        spec.gguf_write_keys(writer, config)
    else:
        _add_architecture(writer, config)
        if spec.gguf_write_more_keys is not None:
            spec.gguf_write_more_keys(writer, config)
    for key, value in tokenizer_metadata.items():
        _add_value(writer, key, value)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for tensor_name, (data, qtype) in encoded.items():
        writer.add_tensor(tensor_name, data, raw_dtype=qtype)

    path.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _to_disk(name: str, tensor: torch.Tensor, config: ModelConfig) -> np.ndarray:
    t = tensor.detach().to("cpu", torch.float32).contiguous()
    if family(config.architecture).rope_permuted:  # interleaved-RoPE q/k rows, as the converter writes
        if name.endswith(("attn_q.weight", "attn_q.bias")):
            t = llama_permute(t, config.num_heads)
        elif name.endswith(("attn_k.weight", "attn_k.bias")):
            t = llama_permute(t, config.num_kv_heads)
    return t.numpy()


def _fuse(config: ModelConfig, tensors: dict[str, np.ndarray], types: dict[str, Q]) -> dict[str, np.ndarray]:
    """Phi-3's layout: q/k/v as one `attn_qkv`, gate and up as one `ffn_up` (each stored as its
    first part's type)."""
    if not family(config.architecture).writes_fused:
        return tensors
    out = dict(tensors)
    for i in range(config.num_layers):
        p = f"blk.{i}."
        for fused, parts in (("attn_qkv.weight", ("attn_q.weight", "attn_k.weight", "attn_v.weight")),
                             ("ffn_up.weight", ("ffn_gate.weight", "ffn_up.weight"))):
            if all(p + n in out for n in parts):
                first = types.get(p + parts[0])
                arrays = [out.pop(p + n) for n in parts]
                out[p + fused] = np.concatenate(arrays, axis=0)
                if first is not None:
                    types[p + fused] = first
    return out


def _rope_tensors(c: ModelConfig) -> dict[str, np.ndarray]:
    """Llama 3's scaling as one divisor per frequency (`rope_freqs.weight`), LongRoPE's two sets."""
    s = c.rope_scaling
    if s is None:
        return {}
    if s.kind == "longrope":
        return {"rope_factors_short.weight": np.array(s.short_factor, dtype=np.float32),
                "rope_factors_long.weight": np.array(s.long_factor, dtype=np.float32)}
    if s.kind != "llama3":
        return {}
    factors = s.freq_factors or llama3_freq_factors(s, c.head_dim, c.rope_theta)
    return {"rope_freqs.weight": np.array(factors, dtype=np.float32)}


def llama3_freq_factors(s: RopeScaling, head_dim: int, theta: float) -> list[float]:
    """Llama 3's scaling as one divisor per frequency, computed as convert_hf_to_gguf does."""
    old, low, high = s.original_max_position_embeddings, s.low_freq_factor, s.high_freq_factor
    factors = []
    for i in range(head_dim // 2):
        wavelen = 2 * math.pi * theta ** (2 * i / head_dim)
        if wavelen < old / high:
            factors.append(1.0)  # high frequencies keep their speed
        elif wavelen > old / low:
            factors.append(s.factor)  # low ones are slowed by the factor
        else:  # between: a blend of the two speeds, smooth in 1 / wavelength
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / s.factor + smooth))
    return factors


def _encode(name: str, data: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q]:
    if data.ndim < 2 or is_norm(name) or name.endswith("ffn_gate_inp.weight"):  # routers stay F32, as llama.cpp's
        qtype = Q.F32
    try:
        return gguf.quants.quantize(data, qtype), qtype
    except NotImplementedError:
        raise ValueError(f"gguf-py cannot quantize to {qtype.name} ({name})") from None
    except gguf.quants.QuantError as e:
        raise ValueError(f"{name} {tuple(data.shape)} cannot be stored as {qtype.name}: {e}") from None


def _file_type(encoded: dict[str, tuple[np.ndarray, Q]]) -> int:
    """llama.cpp's `general.file_type`: the type holding most of the 2-D weights."""
    elements: Counter[Q] = Counter()
    for data, qtype in encoded.values():
        if qtype != Q.F32:
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            elements[qtype] += data.nbytes // type_size * block
    if not elements:
        return gguf.LlamaFileType.ALL_F32
    dominant = elements.most_common(1)[0][0]
    return _FILE_TYPES.get(dominant, gguf.LlamaFileType.GUESSED)


def _add_architecture(writer: gguf.GGUFWriter, c: ModelConfig) -> None:
    """Every hyperparameter key llama.cpp reads for these architectures.

    Gemma gets three more that llama.cpp hardcodes for it (a sliding pattern of 6 or 2, a local RoPE
    base of 10000, 1/sqrt(head_dim) scaling) but reads under these names for other architectures,
    so a file whose model differs from those defaults still says exactly what it is. A sliding
    window is written with its per-layer pattern whatever the architecture (llama.cpp reads it for
    Gemma; for llama and Phi-3 it runs without one).
    """
    w = writer
    # a hybrid's recurrent layers have no KV heads: one count a layer, 0 for them, as llama.cpp's LFM2 files
    # (its Qwen3-Next files keep one count, their layers' kinds in attention.recurrent_layers)
    per_layer = c.is_recurrent and family(c.architecture).gguf_kv_heads_per_layer
    kv_heads = [c.num_kv_heads if c.is_attention(i) else 0 for i in range(c.num_layers)] if per_layer \
        else c.num_kv_heads
    for add, value in ((w.add_vocab_size, c.vocab_size), (w.add_context_length, c.max_position_embeddings),
                       (w.add_embedding_length, c.hidden_size), (w.add_block_count, c.num_layers),
                       (w.add_feed_forward_length, c.intermediate_size), (w.add_head_count, c.num_heads),
                       (w.add_head_count_kv, kv_heads), (w.add_key_length, c.head_dim),
                       (w.add_value_length, c.head_dim), (w.add_rope_dimension_count, c.rotary_dim or c.head_dim),
                       (w.add_rope_freq_base, c.rope_theta), (w.add_layer_norm_rms_eps, c.rms_norm_eps)):
        add(value)
    s = c.rope_scaling
    if s is not None and s.kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(s.factor)
    elif s is not None and s.kind == "yarn":
        if not s.truncate:
            raise ValueError("llama.cpp's YaRN always truncates its correction range")
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(s.factor)
        writer.add_rope_scaling_orig_ctx_len(s.original_max_position_embeddings)
        writer.add_rope_scaling_yarn_beta_fast(s.beta_fast)
        writer.add_rope_scaling_yarn_beta_slow(s.beta_slow)
        if s.attention_factor is not None:  # llama.cpp multiplies it by YaRN's own 0.1 ln(factor) + 1
            mscale = 1.0 if s.factor <= 1 else 0.1 * math.log(s.factor) + 1.0
            writer.add_rope_scaling_yarn_attn_factor(s.attention_factor / mscale)
    elif s is not None and s.kind == "longrope":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        writer.add_rope_scaling_orig_ctx_len(s.original_max_position_embeddings)
        factor = s.factor if s.factor > 1.0 else 1.0
        attention = s.attention_factor if s.attention_factor is not None else (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(s.original_max_position_embeddings)))
        writer.add_rope_scaling_attn_factors(attention)
    if c.sliding_window is not None and c.layer_types:
        writer.add_sliding_window(c.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding" for t in c.layer_types])
    if c.rope_local_theta is not None:
        writer.add_rope_freq_base_swa(c.rope_local_theta)
    if c.query_pre_attn_scalar is not None:
        writer.add_attention_scale(c.attn_scale)
    if c.attn_logit_softcap is not None:
        writer.add_attn_logit_softcapping(c.attn_logit_softcap)
    if c.final_logit_softcap is not None:
        writer.add_final_logit_softcapping(c.final_logit_softcap)
    if c.is_moe:
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.expert_ffn)
        writer.add_expert_weights_norm(c.norm_topk_prob)
    if c.conv_kernel:
        writer.add_shortconv_l_cache(c.conv_kernel)


def _add_value(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    """Scalars typed the way llama.cpp reads them (ids as uint32); arrays typed by their items
    (int32, float32, string), `bytes` as a uint8 array (`tokenizer.ggml.precompiled_charsmap`)."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, bytes):
        writer.add_array(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        writer.add_array(key, list(value))
    else:
        raise TypeError(f"cannot store {key} of type {type(value).__name__} in GGUF metadata")
