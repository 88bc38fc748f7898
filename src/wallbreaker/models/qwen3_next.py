"""Qwen3-Next: gated delta net layers (layers/gated_delta.py) with a gated attention layer every few
(`layer_types`), each followed by a mixture of experts with a shared expert.

The attention differs from Llama's in three ways: q_proj gives, per head, the query and a gate
(the output is multiplied by sigmoid(gate) before o_proj); q and k have an RMS norm; and RoPE turns
only the first `rotary_dim` channels of a head (rotate-half within them), the rest pass. The
fused cache write pairs channel i with i + head_dim / 2, so the rotation is done here and the
write is given the identity rotation.

Every RMS norm weight is stored as the effective multiplier (transformers' 1 + w, as the converter
writes it), but the delta net's gated norm, which is w itself.
"""
from __future__ import annotations

import torch

from .. import _C
from ..config import ModelConfig
from ..layers.attention import AttentionMetadata, LayerKV, paged_attention
from ..layers.direct import DirectModule
from ..layers.gated_delta import GatedDeltaNet
from ..layers.rotary import RotaryEmbedding
from .base import CausalLM, rms_norm
from .moe import SparseMoE
from .source import WeightSource

_rope_write_kv, _gated_act = _C.rope_write_kv, _C.gated_act


def _identity_rotation(meta: AttentionMetadata, rows: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos = 1, sin = 0 [T, head_dim], once per step: the fused write then only writes."""
    key = ("identity rotation", head_dim)
    if key not in meta._memo:
        device = meta.positions.device
        meta._memo[key] = (torch.ones(rows, head_dim, device=device), torch.zeros(rows, head_dim, device=device))
    return meta._memo[key]


class GatedAttention(DirectModule):
    def __init__(self, cfg: ModelConfig, layer: int, src: WeightSource):
        super().__init__()
        p = f"blk.{layer}."
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv = src.linear([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"])
        self.o = src.linear([p + "attn_output.weight"])
        self.q_norm = rms_norm(src, p + "attn_q_norm.weight", cfg.rms_norm_eps)
        self.k_norm = rms_norm(src, p + "attn_k_norm.weight", cfg.rms_norm_eps)
        self.rotary_dim = cfg.rotary_dim or cfg.head_dim
        self.rope = RotaryEmbedding(self.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        self.scale = cfg.head_dim ** -0.5
        self.kv: LayerKV | None = None  # this layer's pages in the KV pool, bound by the runner

    def kv_offsets(self) -> None:
        """No biases: nothing every token's K and V share (see llama.Attention.kv_offsets)."""
        return None

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim]: its first rotary_dim channels turned (sin comes sign-folded)."""
        r = self.rotary_dim
        turned = x[..., :r] * cos + torch.roll(x[..., :r], r // 2, dims=-1) * sin
        return turned if r == self.head_dim else torch.cat([turned, x[..., r:]], dim=-1)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        rows, h, d, kvh = x.shape[0], self.num_heads, self.head_dim, self.num_kv_heads
        q_gate, k, v = self.qkv(x).float().split([2 * h * d, kvh * d, kvh * d], dim=-1)
        q_gate = q_gate.view(rows, h, 2 * d)
        cos, sin = meta.rotary(self.rope)
        cos, sin = cos[:, None], sin[:, None]
        q = self._rotate(self.q_norm(q_gate[..., :d]), cos, sin)
        k = self._rotate(self.k_norm(k.view(rows, kvh, d)), cos, sin)
        kv = self.kv
        q = _rope_write_kv(torch.cat([q.flatten(1), k.flatten(1), v], dim=-1), *_identity_rotation(meta, rows, d),
                           kv.k, kv.v, meta.slot_mapping, h, kvh, None, None, 0.0, kv.k_scale, kv.v_scale,
                           kv.k_offset, kv.v_offset)
        out = paged_attention(q, kv, meta, self.scale).flatten(1)
        return self.o(out * torch.sigmoid(q_gate[..., d:].reshape(rows, h * d)))


def gated_delta_net(cfg: ModelConfig, layer: int, src: WeightSource) -> GatedDeltaNet:
    p = f"blk.{layer}."
    small = {name: src.weights[p + name].load().float()
             for name in ("ssm_conv1d.weight", "ssm_a", "ssm_dt.bias", "ssm_norm.weight")}
    return GatedDeltaNet(src.linear([p + "attn_qkv.weight", p + "attn_gate.weight", p + "ssm_ba.weight"]),
                         src.linear([p + "ssm_out.weight"]), small["ssm_conv1d.weight"], small["ssm_a"],
                         small["ssm_dt.bias"], small["ssm_norm.weight"], cfg.linear_num_key_heads,
                         cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                         cfg.rms_norm_eps)


class SharedExpertMoE(DirectModule):
    """The routed experts (models/moe.py) plus a shared SwiGLU expert weighted by sigmoid(x . w)."""

    def __init__(self, cfg: ModelConfig, layer: int, src: WeightSource):
        super().__init__()
        p = f"blk.{layer}."
        self.routed = SparseMoE(cfg, layer, src)
        self.gate_up = src.linear([p + "ffn_gate_shexp.weight", p + "ffn_up_shexp.weight"])
        self.down = src.linear([p + "ffn_down_shexp.weight"])
        self.shared_gate = src.router(p + "ffn_gate_inp_shexp.weight")  # [1, hidden], float32
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.down(_gated_act(self.gate_up(x), self.act)).float()
        return self.routed(x) + torch.sigmoid(self.shared_gate(x.float())) * shared


class Qwen3NextLayer(DirectModule):
    """A pre-norm block whose mixer is attention (`attn`) or a gated delta net (`linear_attn`)."""

    def __init__(self, cfg: ModelConfig, layer: int, src: WeightSource):
        super().__init__()
        p = f"blk.{layer}."
        self.attn_norm = rms_norm(src, p + "attn_norm.weight", cfg.rms_norm_eps)
        self.attn = GatedAttention(cfg, layer, src) if cfg.is_attention(layer) else None
        self.linear_attn = None if cfg.is_attention(layer) else gated_delta_net(cfg, layer, src)
        self.mlp_norm = rms_norm(src, p + "post_attention_norm.weight", cfg.rms_norm_eps)
        self.mlp = SharedExpertMoE(cfg, layer, src)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata,
                delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        mixer = self.attn if self.attn is not None else self.linear_attn
        mixed = mixer(self.attn_norm.add_and_norm(h, delta), meta)
        return h, self.mlp(self.mlp_norm.add_and_norm(h, mixed))


class Qwen3NextCausalLM(CausalLM):
    layer_class = Qwen3NextLayer

    def __init__(self, cfg: ModelConfig, src: WeightSource):
        if src.shard is not None:
            raise NotImplementedError("tensor parallelism is not supported for Qwen3-Next")
        super().__init__(cfg, src)

