"""Mamba2 (transformers' Mamba2ForCausalLM): embeddings, a stack of pre-norm Mamba2 mixers with
residuals, a final norm. No attention at all, so the engine keeps no KV pages for it; each layer's
state lives in the state pool (layers/mamba2.py)."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..layers.attention import AttentionMetadata
from ..layers.direct import DirectModule
from ..layers.mamba2 import Mamba2Mixer, Mamba2Weights
from .base import CausalLM, rms_norm
from .source import WeightSource


def mamba2_mixer(cfg: ModelConfig, layer: int, src: WeightSource) -> Mamba2Mixer:
    """Layer `layer`'s mixer: its projections through `src.linear` (our kernels on the packed path),
    the rest float32 (canonical names and layouts: formats/mamba.py).

    Under tensor parallelism a rank holds a run of the heads, split as attention's query heads are
    over their KV heads (layers/shard.py), the groups in the KV heads' place: whole groups where
    there are at least as many as ranks, else its share of one group's heads (that group's B and C
    replicated, its norm summed across the ranks that share it)."""
    p = f"blk.{layer}."
    heads = src.attention_heads(cfg.ssm_num_heads, cfg.ssm_num_groups)
    inner, gn = cfg.ssm_num_heads * cfg.ssm_head_dim, cfg.ssm_num_groups * cfg.ssm_state_size
    x_rows = range(heads.q.start * cfg.ssm_head_dim, heads.q.stop * cfg.ssm_head_dim)
    bc_rows = range(heads.kv.start * cfg.ssm_state_size, heads.kv.stop * cfg.ssm_state_size)
    conv_rows = [x_rows, shifted(bc_rows, inner), shifted(bc_rows, inner + gn)]  # of xBC: x, B, C

    def small(name: str, rows: list[range]) -> torch.Tensor:
        """`rows` of a tensor, one row per channel (the norm's weight, stored [groups, inner / groups],
        and A and D, [heads] or [heads, 1], taken flat)."""
        whole = src.weights[p + name].load().float()
        whole = whole if name == "ssm_conv1d.weight" else whole.reshape(-1)
        return torch.cat([whole[r.start:r.stop] for r in rows])
    bias = src.weights.get(p + "ssm_conv1d.bias")
    weights = Mamba2Weights(small("ssm_conv1d.weight", conv_rows),
                            None if bias is None else small("ssm_conv1d.bias", conv_rows),
                            small("ssm_a", [heads.q]), small("ssm_d", [heads.q]), small("ssm_dt.bias", [heads.q]),
                            small("ssm_norm.weight", [x_rows]))
    if src.shard is None:
        return Mamba2Mixer(cfg, src.linear([p + "ssm_in.weight"]), src.linear([p + "ssm_out.weight"]), weights)
    in_rows = [x_rows, *(shifted(r, inner) for r in conv_rows), shifted(heads.q, inner + inner + 2 * gn)]  # z, xBC, dt
    return Mamba2Mixer(cfg, src.linear_of([src.weights[p + "ssm_in.weight"]] * len(in_rows), parallel="column",
                                          slices=in_rows),
                       src.linear([p + "ssm_out.weight"], parallel="row", slices=[x_rows]), weights, heads, src.shard)


def shifted(r: range, by: int) -> range:
    return range(r.start + by, r.stop + by)


class Mamba2Layer(DirectModule):
    def __init__(self, cfg: ModelConfig, layer: int, src: WeightSource):
        super().__init__()
        self.norm = rms_norm(src, f"blk.{layer}.attn_norm.weight", cfg.rms_norm_eps)
        self.mixer = mamba2_mixer(cfg, layer, src)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata,
                delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return h, self.mixer(self.norm.add_and_norm(h, delta), meta)


class Mamba2CausalLM(CausalLM):
    layer_class = Mamba2Layer
