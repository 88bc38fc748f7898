"""gpt-oss (transformers' GptOssForCausalLM): the Llama block with biases on q/k/v and the output,
attention sinks (a learned logit per head in the softmax's denominator: layers/attention.py, and the
paged kernel's `sinks`), sliding-window (even) and full layers, YaRN, and a mixture of experts whose
router has a bias and softmaxes only its top k logits, and whose experts have biases and a clamped
SwiGLU: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit). Canonical names
and layouts: formats/gpt_oss.py."""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..formats.gpt_oss import SWIGLU_ALPHA, SWIGLU_LIMIT
from ..layers.attention import AttentionMetadata, paged_attention
from ..layers.direct import DirectModule
from ..layers.linear import Linear
from .base import CausalLM, rms_norm
from .llama import Attention, _rope_write_kv
from .moe import dispatch
from .source import WeightSource


class SinkAttention(Attention):
    """Llama's attention with an output bias and a sink per head."""

    def __init__(self, cfg: ModelConfig, layer: int, src: WeightSource):
        super().__init__(cfg, layer, src)
        p = f"blk.{layer}."
        bias = [p + "attn_output.bias"] if cfg.qkv_bias else None
        self.o = src.linear([p + "attn_output.weight"], bias)
        self.sinks = src.weights[p + "attn_sinks.weight"].load().float().contiguous()  # [heads]

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        kv = self.kv
        cos, sin = meta.rotary(self.rope)
        q = _rope_write_kv(self.qkv(x), cos, sin, kv.k, kv.v, meta.slot_mapping, self.num_heads, self.num_kv_heads,
                           None, None, 0.0, kv.k_scale, kv.v_scale, kv.k_offset, kv.v_offset)  # [T, heads, head_dim]
        out = paged_attention(q, kv, meta, self.scale, self.sliding_window, sinks=self.sinks)
        return self.o(out.flatten(1))


def clamped_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[rows, 2 ff] (gate | up) -> [rows, ff], gpt-oss's activation."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate = gate.clamp(max=SWIGLU_LIMIT)
    up = up.clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))


class GptOssMoE(nn.Module):
    """Experts dispatched by models/moe.py's `dispatch`, as SparseMoE's are."""

    runs_row_subsets = True  # each expert sees some of the step's rows (models/base.py `_per_token_linears`)

    def __init__(self, cfg: ModelConfig, layer: int, src: WeightSource):
        super().__init__()
        p = f"blk.{layer}."
        self.router = Linear(src.weights[p + "ffn_gate_inp.weight"].load().float(),
                             src.weights[p + "ffn_gate_inp.bias"].load().float())  # float32 on every path
        gate_up, down = src.experts(p)
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)
        biases = {x: src.weights[f"{p}ffn_{x}_exps.bias"].load().float() for x in ("gate", "up", "down")}
        self.register_buffer("gate_up_bias", torch.cat([biases["gate"], biases["up"]], dim=1))  # [experts, 2 ff]
        self.register_buffer("down_bias", biases["down"])  # [experts, hidden]
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] float32, experts [T, k]): the softmax of the top k logits."""
        logits, experts = torch.topk(self.router(x.float()), self.top_k, dim=-1)
        return torch.softmax(logits, dim=-1), experts

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e over its tokens' rows x [n, hidden] -> [n, hidden] float32."""
        h = clamped_swiglu(self.gate_up[e](x).float() + self.gate_up_bias[e])
        return self.down[e](h.to(x.dtype)).float() + self.down_bias[e]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        if x.shape[0] == 1:
            return self._one_token(x, weights, experts)
        return dispatch(x, weights, experts, self.num_experts, self.expert)

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """A decode step's token: its k experts in turn, without `dispatch`'s grouping (a dozen small
        ops a layer, a few percent of a step at batch 1), summed in `dispatch`'s order (ascending expert,
        from zero), so that the bits are those of the token in a batch."""
        out = torch.zeros(1, x.shape[1], dtype=torch.float32, device=x.device)
        for e, w in sorted(zip(experts[0].tolist(), weights[0].tolist())):
            out += self.expert(e, x) * w
        return out


class GptOssLayer(DirectModule):
    def __init__(self, cfg: ModelConfig, layer: int, src: WeightSource):
        super().__init__()
        p = f"blk.{layer}."
        self.attn_norm = rms_norm(src, p + "attn_norm.weight", cfg.rms_norm_eps)
        self.attn = SinkAttention(cfg, layer, src)
        self.mlp_norm = rms_norm(src, p + "post_attention_norm.weight", cfg.rms_norm_eps)
        self.mlp = GptOssMoE(cfg, layer, src)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata,
                delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.attn(self.attn_norm.add_and_norm(h, delta), meta)
        return h, self.mlp(self.mlp_norm.add_and_norm(h, attn))


class GptOssCausalLM(CausalLM):
    layer_class = GptOssLayer
