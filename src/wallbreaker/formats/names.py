"""Tensor names: wallbreaker's canonical names are llama.cpp's GGUF names.

Hugging Face folders are mapped onto them by each family's table (formats/families.py
`hf_to_canonical_table`), so that the GGUF reader, the safetensors reader and the writers agree by
construction.

Two departures from one tensor per name, each undone by the readers: Phi-3 stores q/k/v fused
(`attn_qkv`) and gate/up fused (HF `gate_up_proj`, GGUF `ffn_up` of twice the rows), which the
readers present as the separate projections (`formats/weights.py` `row_view`); and a Hugging
Face folder stores each expert's projection on its own, which the reader presents as one
[experts, out, in] tensor, as GGUF stores it (`blk.N.ffn_gate_exps.weight`, ...).
"""
from __future__ import annotations

import re

import torch

# The fused tensors of a Phi-3 folder, as the table names them before the reader splits them.
FUSED_QKV = "attn_qkv.weight"
FUSED_GATE_UP = "ffn_gate_up.weight"

# Buffers some checkpoints carry that are recomputed from the config, never read.
_DERIVED = re.compile(r".*\.rotary_emb\.inv_freq")


def is_derived(hf_name: str) -> bool:
    """A buffer that is recomputed, not read (old checkpoints' `rotary_emb.inv_freq`)."""
    return _DERIVED.fullmatch(hf_name) is not None


def is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def llama_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF q/k rows -> llama.cpp's interleaved-RoPE row order (what convert_hf_to_gguf does)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of `llama_permute`: GGUF llama q/k rows back to HF's rotate-half order."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
