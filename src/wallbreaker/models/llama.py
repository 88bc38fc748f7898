"""The Llama family: pre-norm decoder, GQA, rotate-half RoPE, SwiGLU. Llama (2, 3.x with its RoPE
scaling), SmolLM2, Mistral (a sliding window), Qwen2 (q/k/v biases), Qwen3 (q/k RMSNorm) and Phi-3
(whose fused q/k/v and gate/up the loaders present as the separate projections) are all this block.

Gemma 2 and 3 (gemma.py) reuse these pieces and change the block around them; Mixtral and
Qwen3-MoE (moe.py) replace the MLP by a mixture of experts.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from .. import _C
from .. import kernels as qk
from ..config import ModelConfig
from ..layers.attention import AttentionMetadata, LayerKV, paged_attention
from ..layers.direct import DirectModule
from ..layers.linear import QuantLinear
from ..layers.rotary import RotaryEmbedding
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
                                    None if local else cfg.rope_scaling)
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


def feed_forward(cfg: ModelConfig, layer: int, src: WeightSource) -> nn.Module:
    """The layer's MLP, or its mixture of experts."""
    if cfg.is_moe:
        from .moe import SparseMoE
        return SparseMoE(cfg, layer, src)
    return MLP(cfg, layer, src)


class LlamaCausalLM(CausalLM):
    """On the `auto` path, steps of a few tokens per sequence (decode, speculative verification) run
    the layer stack from C++ (`_C.DecoderPlan`, csrc/decoder_plan.cpp): the same ops as the layers'
    `forward`, bit-identical, without Python between them. `WALLBREAKER_DECODER_PLAN=0` turns it off."""

    layer_class = DecoderLayer

    def __init__(self, cfg: ModelConfig, src: WeightSource):
        super().__init__(cfg, src)
        self.use_decoder_plan = os.environ.get("WALLBREAKER_DECODER_PLAN", "1") != "0" and _plannable(self.layers)
        self._plan: _C.DecoderPlan | None = None
        self._plan_kv: list[LayerKV] = []  # the pages the plan holds: a new binding rebuilds it

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        plan = self._decoder_plan(meta)
        if plan is None:
            return super().forward(input_ids, meta)
        cos, sin = meta.rotary(self.layers[0].attn.rope)
        dense_min_rows = qk.DENSE_MIN_ROWS if qk.dense_path() else 0
        h, delta = plan.run(self.embed_tokens(input_ids), None, cos, sin, meta.slot_mapping, meta.block_tables,
                            meta.query_start, meta.context_lens, meta.block_size, dense_min_rows, qk.DENSE_TILE_ROWS)
        return self.norm.add_and_norm(h, delta)

    def _decoder_plan(self, meta: AttentionMetadata) -> _C.DecoderPlan | None:
        """The plan, where this step can take it: every token goes to the paged kernel."""
        if not self.use_decoder_plan or meta.prefills or meta.num_paged_tokens != meta.slot_mapping.shape[0]:
            return None
        kv = [layer.attn.kv for layer in self.layers]
        if any(pages is None for pages in kv):
            return None
        if self._plan is None or any(a is not b for a, b in zip(kv, self._plan_kv)):
            self._plan, self._plan_kv = _C.DecoderPlan(list(self.layers)), kv
        return self._plan


def _plannable(layers: nn.ModuleList) -> bool:
    """Whether `_C.DecoderPlan` runs these layers as their `forward` would: plain Llama blocks (no
    experts), every projection quantized in one piece (no tensor-parallel split) and one RoPE."""
    return all(type(layer) is DecoderLayer and type(layer.mlp) is MLP and type(layer.attn) is Attention
               and all(type(m) is QuantLinear for m in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up,
                                                        layer.mlp.down))
               and layer.attn.rope.key == layers[0].attn.rope.key for layer in layers)
