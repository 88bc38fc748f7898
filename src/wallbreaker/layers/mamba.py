"""The Mamba (v1) mixer (Mamba, Falcon-Mamba): a selective state space layer with a state per channel.

The input projection gives, per token, x and the gate z [intermediate]. x goes through a causal
depthwise convolution (kernel K, with bias) and SiLU; a projection of it gives the time step's
rank-R input, B and C [d_state] (Falcon-Mamba RMS-normalizes each of the three, without weights).
Per channel d the state S [d_state] then follows

    dt = softplus(W_dt r + b_dt);  S <- exp(dt A) * S + dt x B;  y = S . C + D x

with A = -exp(A_log) < 0 [intermediate, d_state], and the output y * silu(z) is projected back to
the hidden size (transformers' MambaMixer, its torch path).

Two states per sequence, float32: the last K - 1 conv inputs [K - 1, intermediate] and S
[intermediate, d_state], each run through `scan_spans` on its own (the convolution's output feeds a
projection between the two). Decode and verification steps run both on the pool itself in C++
(`_C.conv_step`, `_C.ssm1_step`: no gather or scatter of the states, the exp and the update on
whole vectors); a prompt's scan is in PyTorch, token by token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import _C
from ..config import ModelConfig
from .attention import AttentionMetadata
from .recurrent import RecurrentMixer, scan_spans


@dataclass
class MambaWeights:
    """A mixer's small float32 tensors (the projections in and out and x_proj are modules of their own)."""

    conv_weight: torch.Tensor  # [intermediate, K]
    conv_bias: torch.Tensor | None  # [intermediate]
    dt_weight: torch.Tensor  # [intermediate, rank]
    dt_bias: torch.Tensor  # [intermediate]
    A: torch.Tensor  # [intermediate, d_state]: -exp(A_log)
    D: torch.Tensor  # [intermediate]


class MambaMixer(RecurrentMixer):
    in_pool = True  # short spans through the `*_in_pool` forms (C++); False: the torch forms they are tested against

    def __init__(self, cfg: ModelConfig, in_proj: nn.Module, x_proj: nn.Module, out_proj: nn.Module, w: MambaWeights):
        """`in_proj`: hidden -> x | z (intermediate each); `x_proj`: intermediate -> rank | B | C;
        `out_proj`: intermediate -> hidden."""
        super().__init__()
        self.inner, self.state_size = cfg.intermediate_size, cfg.ssm_state_size
        self.kernel, self.rank = cfg.ssm_conv_kernel, cfg.ssm_time_step_rank
        self.bc_eps = cfg.ssm_bc_norm_eps
        self.in_proj, self.x_proj, self.out_proj = in_proj, x_proj, out_proj
        f32 = torch.float32
        self.conv_weight = w.conv_weight.to(f32).t().contiguous()  # [K, intermediate]
        self.conv_bias = w.conv_bias.to(f32) if w.conv_bias is not None else torch.zeros(self.inner)
        self.dt_weight, self.dt_bias = w.dt_weight.to(f32), w.dt_bias.to(f32).reshape(self.inner)
        self.A, self.D = w.A.to(f32).reshape(self.inner, self.state_size), w.D.to(f32).reshape(self.inner)

    def state_shapes(self) -> list[tuple[int, ...]]:
        return [(self.kernel - 1, self.inner), (self.inner, self.state_size)]

    def forward(self, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x, z = self.in_proj(h).float().chunk(2, dim=-1)  # [T, intermediate] each
        conv, ssm = self.state
        pooled = self.in_pool
        x = scan_spans(meta.state, [conv], (x,), self.conv_step, self.conv_chunk,
                       self.conv_in_pool if pooled else None)  # after SiLU
        r, b, c = self.x_proj(x).float().split([self.rank, self.state_size, self.state_size], dim=-1)
        if self.bc_eps is not None:
            r, b, c = (F.rms_norm(t, (t.shape[-1],), eps=self.bc_eps) for t in (r, b, c))
        dt = F.softplus(F.linear(r, self.dt_weight, self.dt_bias))  # [T, intermediate]
        y = scan_spans(meta.state, [ssm], (x, dt, b, c), self.ssm_step, self.ssm_chunk,
                       self.ssm_in_pool if pooled else None)  # [T, intermediate]
        return self.out_proj((y + x * self.D) * F.silu(z))

    def conv_step(self, inputs: tuple[torch.Tensor, ...], states: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One token of each of B sequences: x [B, intermediate], conv [B, K-1, intermediate]."""
        (x,), (conv,) = inputs, states
        window = torch.cat([conv, x[:, None]], dim=1)  # [B, K, intermediate]
        return F.silu((window * self.conv_weight).sum(1) + self.conv_bias), [window[:, 1:]]

    def conv_chunk(self, inputs: tuple[torch.Tensor, ...], states: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """L tokens of one sequence: x [L, intermediate], conv [1, K-1, intermediate]."""
        (x,), (conv,) = inputs, states
        length = x.shape[0]
        seq = torch.cat([conv[0], x])  # [K-1+L, intermediate]
        out = self.conv_bias + sum(seq[k:k + length] * self.conv_weight[k] for k in range(self.kernel))
        return F.silu(out), [seq[None, length:]]

    def ssm_step(self, inputs: tuple[torch.Tensor, ...], states: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One token of each of B sequences: x, dt [B, intermediate], b, c [B, d_state]; S [B, intermediate,
        d_state]. Returns y [B, intermediate] (before the D skip and the gate) and the new S."""
        x, dt, b, c = inputs
        (s,) = states
        s = s * torch.exp(dt[..., None] * self.A) + (dt * x)[..., None] * b[:, None, :]
        return (s @ c[..., None])[..., 0], [s]

    def conv_in_pool(self, inputs: tuple[torch.Tensor, ...], src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """T tokens of each of B sequences on the pool: x [B, T, intermediate]; states from slots `src`
        [B], the state after token t to slot dst[b, t] where that is not -1. After SiLU."""
        (x,) = inputs
        return _C.conv_step(self.state[0], src, dst, x.contiguous(), self.conv_weight, self.conv_bias, True)

    def ssm_in_pool(self, inputs: tuple[torch.Tensor, ...], src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """As `conv_in_pool`, for the selective scan: x, dt [B, T, intermediate], b, c [B, T, d_state]."""
        x, dt, b, c = (t.contiguous() for t in inputs)
        return _C.ssm1_step(self.state[1], src, dst, x, dt, b, c, self.A)

    def ssm_chunk(self, inputs: tuple[torch.Tensor, ...], states: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """L tokens of one sequence, one after the other (inputs [L, ...], S [1, intermediate, d_state])."""
        ys = []
        for t in range(inputs[0].shape[0]):
            y, states = self.ssm_step(tuple(v[t:t + 1] for v in inputs), states)
            ys.append(y)
        return torch.cat(ys), states
