"""The Llama family: pre-norm decoder, GQA, rotate-half RoPE, SwiGLU. Llama (2, 3.x with its RoPE
scaling), SmolLM2, Mistral (a sliding window), Qwen2 (q/k/v biases), Qwen3 (q/k RMSNorm) and Phi-3
(whose fused q/k/v and gate/up the loaders present as the separate projections) are all this block.

Gemma 2 and 3 (gemma.py) reuse these pieces and change the block around them; Mixtral and
Qwen3-MoE (moe.py) replace the MLP by a mixture of experts.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import _C
from ..config import ModelConfig
from ..layers.attention import AttentionMetadata, LayerKV, paged_attention
from ..layers.direct import DirectModule
from ..layers.linear import QuantLinear
from ..layers.rotary import MRotaryEmbedding, RotaryEmbedding
from .base import CausalLM, rms_norm
from .source import WeightSource

_rope_write_kv, _gated_act = _C.rope_write_kv, _C.gated_act
_NO_QK_NORM = (None, None, 0.0)


class Attention(DirectModule):
    def __init__(self, cfg: ModelConfig, layer: int, src: WeightSource):
        super().__init__()
        p = f"blk.{layer}."
        heads = src.attention_heads(cfg.num_heads, cfg.num_kv_heads)  # this rank's, under tensor parallelism
        self.num_heads, self.num_kv_heads, self.head_dim = len(heads.q), len(heads.kv), cfg.head_dim
        q_rows, kv_rows = heads.q_rows(cfg.head_dim), heads.kv_rows(cfg.head_dim)
        biases = [p + f"attn_{x}.bias" for x in "qkv"] if cfg.qkv_bias else None
        self.qkv = src.linear([p + f"attn_{x}.weight" for x in "qkv"], biases, "column", [q_rows, kv_rows, kv_rows])
        self.o = src.linear([p + "attn_output.weight"], parallel="row", slices=[q_rows])
        self.q_norm = rms_norm(src, p + "attn_q_norm.weight", cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = rms_norm(src, p + "attn_k_norm.weight", cfg.rms_norm_eps) if cfg.qk_norm else None
        self.qk_norm = cfg.qk_norm
        sliding = cfg.is_sliding(layer)
        local = sliding and cfg.rope_local_theta is not None  # Gemma 3's sliding layers: their own plain RoPE
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_local_theta if local else cfg.rope_theta,
                                    None if local else cfg.rope_scaling) if not cfg.mrope_section else \
            MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section, cfg.mrope_interleaved)
        self.sliding_window = cfg.sliding_window if sliding else None
        self.scale = cfg.attn_scale
        self.softcap = cfg.attn_logit_softcap
        self.kv: LayerKV | None = None  # this layer's pages in the KV pool, bound by the runner

    def kv_offsets(self) -> torch.Tensor | None:
        """[2, kv_heads, head_dim]: what every token's K and V share, the projection's biases (K's as
        RoPE turns it at position 0), or None. Quantized pages round only the rest. Qwen2.5's K bias
        reaches 354 where the rest of K is ~1: left in, it sets every token's int8 scale and is itself
        rounded by fp8. It sits on the slowest channels of RoPE (1e-6 rad a token), so it stays put at
        every position; elsewhere the offset is a choice of zero point, exact whatever its value."""
        bias = self.qkv.bias
        if bias is None or self.qk_norm:  # a norm after the projection: the bias is no longer additive
            return None
        offsets = bias.float()[self.num_heads * self.head_dim:].reshape(2, self.num_kv_heads, self.head_dim).clone()
        offsets[0] *= self.rope.attention_factor
        return offsets

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        kv = self.kv
        cos, sin = meta.rotary(self.rope)
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else _NO_QK_NORM
        q = _rope_write_kv(self.qkv(x), cos, sin, kv.k, kv.v, meta.slot_mapping, self.num_heads, self.num_kv_heads,
                           *norms, kv.k_scale, kv.v_scale, kv.k_offset, kv.v_offset)  # [T, heads, head_dim]
        return self.o(paged_attention(q, kv, meta, self.scale, self.sliding_window, self.softcap).flatten(1))


class MLP(DirectModule):
    def __init__(self, cfg: ModelConfig, layer: int, src: WeightSource):
        super().__init__()
        p = f"blk.{layer}."
        self.gate_up = src.linear([p + "ffn_gate.weight", p + "ffn_up.weight"], parallel="column")
        self.down = src.linear([p + "ffn_down.weight"], parallel="row")
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(_gated_act(self.gate_up(x), self.act))


class DecoderLayer(DirectModule):
    """Pre-norm block. The residual add is deferred: a layer returns (h, delta), the output being
    h + delta, and the next norm adds delta into h in the same pass (`RMSNorm.add_and_norm`)."""

    def __init__(self, cfg: ModelConfig, layer: int, src: WeightSource):
        super().__init__()
        p = f"blk.{layer}."
        self.attn_norm = rms_norm(src, p + "attn_norm.weight", cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer, src)
        self.mlp_norm = rms_norm(src, p + "ffn_norm.weight", cfg.rms_norm_eps)
        self.mlp = feed_forward(cfg, layer, src)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata,
                delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.attn(self.attn_norm.add_and_norm(h, delta), meta)
        return h, self.mlp(self.mlp_norm.add_and_norm(h, attn))

    def plan_spec(self) -> dict | None:
        return block_spec(self.attn_norm, self.attn, self.mlp_norm, self.mlp)


def feed_forward(cfg: ModelConfig, layer: int, src: WeightSource) -> nn.Module:
    """The layer's MLP, or its mixture of experts."""
    if cfg.is_moe:
        from .moe import SparseMoE
        return SparseMoE(cfg, layer, src)
    return MLP(cfg, layer, src)


class LlamaCausalLM(CausalLM):
    layer_class = DecoderLayer


def block_spec(attn_norm: nn.Module, attn: nn.Module, mlp_norm: nn.Module, mlp: nn.Module,
               post_attn_norm: nn.Module | None = None, post_mlp_norm: nn.Module | None = None) -> dict | None:
    """What `_C.DecoderPlan` needs to run a pre-norm block (with Gemma's norms after attention and
    MLP where given) as its `forward` does (models/decoder_plan.py), or None where it cannot: experts,
    projections that are float or split over tensor-parallel ranks."""
    if type(attn) is not Attention or type(mlp) is not MLP:
        return None
    linears = {"qkv": attn.qkv, "o": attn.o, "gate_up": mlp.gate_up, "down": mlp.down}
    if any(type(m) is not QuantLinear for m in linears.values()):
        return None

    def norm(n: nn.Module | None) -> tuple[torch.Tensor, float] | None:
        return None if n is None else (n.weight, n.eps)
    def lora(m: QuantLinear) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        return None if m.lora is None else (m.lora.a, m.lora.b_t, m.lora.width)
    return {**{name: (m.blocks, m.qtypes, m._bias, lora(m)) for name, m in linears.items()},
            "attn_norm": norm(attn_norm), "mlp_norm": norm(mlp_norm), "post_attn_norm": norm(post_attn_norm),
            "post_mlp_norm": norm(post_mlp_norm), "q_norm": norm(attn.q_norm), "k_norm": norm(attn.k_norm),
            "heads": attn.num_heads, "kv_heads": attn.num_kv_heads, "scale": attn.scale,
            "window": attn.sliding_window or 0, "softcap": attn.softcap or 0.0, "act": mlp.act}
