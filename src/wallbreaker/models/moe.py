"""Mixture of experts (Mixtral, Qwen3-MoE): the MLP of the Llama block replaced by a softmax router
over `num_experts` SwiGLU experts, of which each token runs the top `num_experts_per_tok`, their
outputs summed weighted by the router's probabilities (renormalized over the chosen ones with
`norm_topk_prob`, as Mixtral always does).

Dispatch is batched by expert: the (token, slot) pairs are sorted by expert once, and each expert
that was chosen runs one matmul over all of its tokens, so the Python loop is over experts, never
tokens. Quantized experts stay packed: one QuantLinear per expert over its rows of the stored
[experts, out, in] tensor (models/source.py)."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .. import _C
from ..config import ModelConfig
from .source import WeightSource


class SparseMoE(nn.Module):
    runs_row_subsets = True  # each expert sees some of the step's rows (models/base.py `_per_token_linears`)

    def __init__(self, cfg: ModelConfig, layer: int, src: WeightSource):
        super().__init__()
        p = f"blk.{layer}."
        self.router = src.router(p + "ffn_gate_inp.weight")  # [experts, hidden], float32
        gate_up, down = src.experts(p)
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)
        self.num_experts, self.top_k, self.norm_topk_prob = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.act = cfg.hidden_act
        self.reduce = src.all_reduce()  # tensor parallelism: every expert's partial sums, reduced once

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] float32, experts [T, k]): transformers' router."""
        probs = torch.softmax(self.router(x.float()), dim=-1)  # [T, experts]
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e over its tokens' rows x [n, hidden] -> [n, hidden] float32."""
        return self.down[e](_C.gated_act(self.gate_up[e](x), self.act)).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(dispatch(x, *self.route(x), self.num_experts, self.expert))


def dispatch(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, num_experts: int,
             expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [T, hidden], each token's chosen experts [T, k] and their weights [T, k] -> [T, hidden] float32:
    the weighted sum of each token's experts, one `expert(e, rows)` call per chosen expert."""
    top_k = experts.shape[1]
    flat = experts.flatten()  # [T * k]: token t's j-th choice at t * k + j
    order = torch.argsort(flat, stable=True)  # the pairs grouped by expert, tokens ascending
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # one host sync a layer
    pair_weights = weights.flatten()
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        pairs = order[start:start + n]
        start += n
        tokens = pairs // top_k
        out.index_add_(0, tokens, expert(e, x[tokens]) * pair_weights[pairs, None])
    return out
