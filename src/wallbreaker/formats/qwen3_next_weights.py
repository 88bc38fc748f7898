"""Qwen3-Next's tensors brought to the layout of llama.cpp's converter (formats/qwen3_next.py says
what it is): a folder's fused in_proj_qkvz split and reordered, A_log to A, the convolution squeezed;
the multi-token prediction layers of a converted file left unread."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..errors import ModelFormatError
from .qwen3_next import qkvz_rows
from .weights import WeightRef


def drop_mtp_layers(cfg: ModelConfig, weights: dict[str, WeightRef]) -> None:
    """The converter's GGUF carries the multi-token prediction head as layers after the model's own
    (`nextn_predict_layers` of them, counted in block_count): left unread, as a folder's `mtp.*`."""
    for name in [n for n in weights if n.startswith("blk.")]:
        layer = name.split(".", 2)[1]
        if layer.isdigit() and int(layer) >= cfg.num_layers:
            del weights[name]


def _rows_of(ref: WeightRef, name: str, rows: torch.Tensor) -> WeightRef:
    return WeightRef(name, (len(rows), *ref.shape[1:]), ref.stored_type, ref.nbytes * len(rows) // ref.shape[0],
                     lambda: ref.load()[rows].contiguous())


def _transformed(ref: WeightRef, name: str, shape: tuple[int, ...], fn) -> WeightRef:
    return WeightRef(name, shape, ref.stored_type, ref.nbytes, lambda: fn(ref.load()))


def canonical_hf_weights(source: str, cfg: ModelConfig, weights: dict[str, WeightRef]) -> None:
    """A folder's tensors (under the names formats/names.py gives them) brought in place to what the
    converter writes: `ssm_in` (the fused in_proj_qkvz) split and reordered, A_log to A, the
    convolution squeezed. (The norms' + 1 is applied as they are read: formats/names.py `adds_one`.)"""
    qkv_rows, z_rows = qkvz_rows(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                 cfg.linear_value_head_dim)
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        fused = weights.pop(p + "ssm_in.weight", None)
        if fused is not None:
            if len(fused.shape) != 2 or fused.shape[0] != len(qkv_rows) + len(z_rows):
                raise ModelFormatError(f"{source}: tensor {fused.name!r} has shape {tuple(fused.shape)}, expected "
                                       f"({len(qkv_rows) + len(z_rows)}, {cfg.hidden_size})")
            weights[p + "attn_qkv.weight"] = _rows_of(fused, p + "attn_qkv.weight", qkv_rows)
            weights[p + "attn_gate.weight"] = _rows_of(fused, p + "attn_gate.weight", z_rows)
        if p + "ssm_a" in weights:
            ref = weights[p + "ssm_a"]
            weights[p + "ssm_a"] = _transformed(ref, p + "ssm_a", tuple(ref.shape), lambda w: -torch.exp(w))
        conv = weights.get(p + "ssm_conv1d.weight")
        if conv is not None and len(conv.shape) == 3 and conv.shape[1] == 1:
            shape = (conv.shape[0], conv.shape[2])
            weights[p + "ssm_conv1d.weight"] = _transformed(conv, conv.name, shape, lambda w: w.reshape(w.shape[0], -1))
