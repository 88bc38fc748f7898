"""Write a model as a GGUF file that llama.cpp (and transformers' GGUF loader) can read.

Tensors come in wallbreaker's canonical layout and are put into llama.cpp's on-disk layout here:
q/k rows of `llama` files are permuted the way convert_hf_to_gguf permutes them. Gemma norms are
already the effective multiplier (1 + w), which is also what llama.cpp stores, so they pass through.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from wallbreaker.config import ModelConfig
from wallbreaker.formats.names import hf_to_canonical_table, is_norm, llama_permute

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
    known = set(hf_to_canonical_table(arch, config.num_layers).values())
    unknown = sorted((set(tensors) | set(raw_tensors or {})) - known)
    if unknown:
        raise ValueError(f"not canonical {arch} tensor names: {unknown}")
    tensor_types = tensor_types or {}

    encoded = {n: _encode(n, _to_disk(n, t, config), tensor_types.get(n, Q.F32)) for n, t in tensors.items()}
    encoded.update(raw_tensors or {})

    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(name)
    writer.add_file_type(_file_type(encoded))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_architecture(writer, config)
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
    if config.architecture == "llama":
        if name.endswith(("attn_q.weight", "attn_q.bias")):
            t = llama_permute(t, config.num_heads)
        elif name.endswith(("attn_k.weight", "attn_k.bias")):
            t = llama_permute(t, config.num_kv_heads)
    return t.numpy()


def _encode(name: str, data: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q]:
    if data.ndim < 2 or is_norm(name):
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

    Gemma 3 gets three more that llama.cpp hardcodes for it (a sliding pattern of 6, a local RoPE
    base of 10000, 1/sqrt(head_dim) scaling) but reads under these names for other architectures,
    so a file whose model differs from those defaults still says exactly what it is.
    """
    w = writer
    for add, value in ((w.add_vocab_size, c.vocab_size), (w.add_context_length, c.max_position_embeddings),
                       (w.add_embedding_length, c.hidden_size), (w.add_block_count, c.num_layers),
                       (w.add_feed_forward_length, c.intermediate_size), (w.add_head_count, c.num_heads),
                       (w.add_head_count_kv, c.num_kv_heads), (w.add_key_length, c.head_dim),
                       (w.add_value_length, c.head_dim), (w.add_rope_dimension_count, c.head_dim),
                       (w.add_rope_freq_base, c.rope_theta), (w.add_layer_norm_rms_eps, c.rms_norm_eps)):
        add(value)
    if c.rope_scaling_factor != 1.0:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(c.rope_scaling_factor)
    if c.architecture == "gemma3":
        if c.sliding_window is not None:
            writer.add_sliding_window(c.sliding_window)
        if c.layer_types:
            writer.add_sliding_window_pattern([t == "sliding" for t in c.layer_types])
        if c.rope_local_theta is not None:
            writer.add_rope_freq_base_swa(c.rope_local_theta)
        if c.query_pre_attn_scalar is not None:
            writer.add_attention_scale(c.attn_scale)


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
