"""The Mamba2 mixer (Mamba2, Granite-4.0-H): a selective state space layer in its SSD form.

One input projection gives, per token, the gate z, the conv input xBC and the time step dt. xBC
goes through a causal depthwise convolution (kernel K, with bias) and SiLU, and splits into x
[heads, head_dim] and B, C [groups, d_state] (each group's B and C shared by heads / groups heads).
Per head h the state S [head_dim, d_state] then follows

    dt = clamp(softplus(dt + dt_bias), time_step_limit);  S <- exp(dt * A) S + dt x B^T;  y = S C + D x

with A = -exp(A_log) < 0. The output is RMS-normed in groups after the gate, norm(y * silu(z)) * w,
and projected back to the hidden size.

Two states per sequence, float32: the last K - 1 conv inputs [K - 1, conv_dim] and S [heads,
head_dim, d_state]. The one-token `step` runs all sequences of a decode step at once; `chunk` runs
a prefill piece of one sequence in the chunked SSD form (transformers' `mamba2_chunk_scan`, from a
given initial state): within a chunk of Q tokens the output is a masked (Q x Q) product, chunks
are linked by their end states. Both are pure functions: they return new states, never write theirs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.distributed as dist
from torch import nn

from .. import _C
from ..config import ModelConfig
from .attention import AttentionMetadata
from .recurrent import RecurrentMixer, scan_spans
from .shard import HeadShard, Shard


# The SSD chunk is a blocking choice: any length gives the same outputs up to rounding. Models
# train with 256 (GPU kernels' tile); on a CPU the intra-chunk part, quadratic in the chunk, then
# dominates: a 512-token prefill of Granite-4.0-H-1B's mixer takes 106 ms a layer at 256, 41 at 64.
CPU_CHUNK = 64
_ssm_step, _conv_step = _C.ssm_step, _C.conv_step


@dataclass
class Mamba2Weights:
    """A mixer's small float32 tensors (the projections are modules of their own)."""

    conv_weight: torch.Tensor  # [conv_dim, K]
    conv_bias: torch.Tensor | None  # [conv_dim]
    A: torch.Tensor  # [heads]: -exp(A_log)
    D: torch.Tensor  # [heads]
    dt_bias: torch.Tensor  # [heads]
    norm_weight: torch.Tensor  # [inner]


class Mamba2Mixer(RecurrentMixer):
    in_pool = True  # short spans through `step_in_pool` (C++); False: `step`, the torch form it is tested against

    def __init__(self, cfg: ModelConfig, in_proj: nn.Module, out_proj: nn.Module, w: Mamba2Weights,
                 heads: HeadShard | None = None, shard: Shard | None = None):
        """`in_proj`: hidden -> z (inner) | xBC (conv_dim) | dt (heads); `out_proj`: inner -> hidden.
        Under tensor parallelism (models/mamba2.py `mamba2_mixer`): `heads.q` the heads this rank
        holds, `heads.kv` their groups; the weights are this rank's."""
        super().__init__()
        self.head_dim, self.state_size = cfg.ssm_head_dim, cfg.ssm_state_size
        self.num_heads, self.num_groups = (cfg.ssm_num_heads, cfg.ssm_num_groups) if heads is None \
            else (len(heads.q), len(heads.kv))
        # fewer groups than ranks: a group's heads may be split across ranks, so its norm's sum of squares
        # is all-reduced (by every rank, whether or not its own group is split)
        self.split_group = None
        if heads is not None and cfg.ssm_num_groups < shard.world_size:
            self.split_group = (heads.kv.start, cfg.ssm_num_groups, cfg.ssm_num_heads // cfg.ssm_num_groups, shard.group)
        self.inner = self.num_heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.num_groups * self.state_size
        self.kernel = cfg.ssm_conv_kernel
        self.chunk_size = min(cfg.ssm_chunk_size, CPU_CHUNK)
        self.dt_min, self.dt_max = cfg.ssm_time_step_limit
        self.eps = cfg.rms_norm_eps
        self.in_proj, self.out_proj = in_proj, out_proj
        f32 = torch.float32
        self.conv_weight = w.conv_weight.to(f32).t().contiguous()  # [K, conv_dim]
        self.conv_bias = w.conv_bias.to(f32) if w.conv_bias is not None else torch.zeros(self.conv_dim)
        self.A, self.D, self.dt_bias = (t.to(f32).reshape(self.num_heads) for t in (w.A, w.D, w.dt_bias))
        self.norm_weight = w.norm_weight.to(f32).reshape(self.inner)

    def state_shapes(self) -> list[tuple[int, ...]]:
        return [(self.kernel - 1, self.conv_dim), (self.num_heads, self.head_dim, self.state_size)]

    @property
    def logs_drafts(self) -> int:
        """How many drafts' inputs a slot's SSM state can hold as a log in its own room (`_C.ssm_step`:
        x and dt of each head, B of each group, in a head's head_dim x d_state floats), a
        verification then writing one whole state as a decode step does (the conv state stays
        whole); 0 on the torch path, which writes whole states."""
        return (self.head_dim * self.state_size) // (self.head_dim + self.state_size + 1) if self.in_pool else 0

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        zxbcdt = self.in_proj(x).float()  # [T, inner + conv_dim + heads]
        z, xbc, dt = zxbcdt.split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        y = scan_spans(meta.state, self.state, (xbc, dt), self.step, self.chunk,
                       self.step_in_pool if self.in_pool else None, self.logs_drafts > 0)  # [T, inner]
        return self.out_proj(self.gated_norm(y, z))

    def gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of y * silu(z) over each group of inner / groups channels, times the weight."""
        g = (y * F.silu(z)).view(-1, self.num_groups, self.inner // self.num_groups)
        if self.split_group is None:
            return F.rms_norm(g, (g.shape[-1],), eps=self.eps).view(-1, self.inner) * self.norm_weight
        group, num_groups, heads_per_group, process_group = self.split_group
        squares = g.new_zeros(g.shape[0], num_groups)  # [T, all groups]: this rank's share of its group's
        squares[:, group] = g.square().sum((1, 2))
        dist.all_reduce(squares, group=process_group)
        mean = squares[:, group, None, None] / (heads_per_group * self.head_dim)
        return (g * torch.rsqrt(mean + self.eps)).view(-1, self.inner) * self.norm_weight

    def _time_step(self, dt: torch.Tensor) -> torch.Tensor:
        dt = F.softplus(dt + self.dt_bias)
        return dt if (self.dt_min, self.dt_max) == (0.0, math.inf) else dt.clamp(self.dt_min, self.dt_max)

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, conv_dim] -> x [T, heads, head_dim]; B, C [T, heads, d_state] (each group's repeated)."""
        x, b, c = xbc.split([self.inner, self.num_groups * self.state_size, self.num_groups * self.state_size], -1)
        rep = self.num_heads // self.num_groups
        b = b.view(-1, self.num_groups, self.state_size).repeat_interleave(rep, dim=1)
        c = c.view(-1, self.num_groups, self.state_size).repeat_interleave(rep, dim=1)
        return x.view(-1, self.num_heads, self.head_dim), b, c

    def step(self, inputs: tuple[torch.Tensor, ...], states: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One token of each of B sequences: xbc [B, conv_dim], dt [B, heads]; conv [B, K-1, conv_dim],
        ssm [B, heads, head_dim, d_state]. Heads are taken as [groups, heads / groups], so that each
        group's B and C broadcast over its heads without a copy."""
        xbc, dt = inputs
        conv, ssm = states
        batch, g, r = xbc.shape[0], self.num_groups, self.num_heads // self.num_groups
        window = torch.cat([conv, xbc[:, None]], dim=1)  # [B, K, conv_dim]
        x, b, c = F.silu((window * self.conv_weight).sum(1) + self.conv_bias).split(
            [self.inner, g * self.state_size, g * self.state_size], -1)
        x = x.view(batch, g, r, self.head_dim, 1)
        b, c = b.view(batch, g, 1, 1, self.state_size), c.view(batch, g, 1, self.state_size, 1)
        dt = self._time_step(dt).view(batch, g, r, 1, 1)
        # [B, groups, heads / groups, head_dim, d_state]: the decayed state, then (x dt) B^T added in place
        # (to the new tensor, never the state given): the state is the step's largest traffic
        new_ssm = ssm.reshape(batch, g, r, self.head_dim, self.state_size) * torch.exp(dt * self.A.view(g, r, 1, 1))
        flat = new_ssm.view(-1, self.head_dim, self.state_size)
        outer_b = b.expand(batch, g, r, 1, self.state_size).reshape(-1, 1, self.state_size)
        flat.baddbmm_((x * dt).view(-1, self.head_dim, 1), outer_b)
        y = new_ssm @ c + x * self.D.view(g, r, 1, 1)  # [B, groups, heads / groups, head_dim, 1]
        return y.view(batch, self.inner), [window[:, 1:], new_ssm.view(ssm.shape)]

    def step_in_pool(self, inputs: tuple[torch.Tensor, ...], src: torch.Tensor, dst: torch.Tensor,
                     logged: torch.Tensor | None = None) -> torch.Tensor:
        """T tokens of each of B sequences on the pool itself: xbc [B, T, conv_dim], dt [B, T, heads];
        states read from slots `src` [B], the state after token t written to slot dst[b, t] where that
        is not -1 (`logged`: which SSM states are logs, StateMetadata.logged). The convolution and the
        SSM recurrence run in C++ (`_C.conv_step`, `_C.ssm_step`), without gathering and scattering
        the states; outputs [B, T, inner]."""
        xbc, dt = inputs
        conv, ssm = self.state
        batch, steps, g = xbc.shape[0], xbc.shape[1], self.num_groups
        conv_out = _conv_step(conv, src, dst, xbc, self.conv_weight, self.conv_bias, True)  # after SiLU
        x, b, c = conv_out.split([self.inner, g * self.state_size, g * self.state_size], -1)
        y = _ssm_step(ssm, src, dst, x.contiguous().view(batch, steps, self.num_heads, self.head_dim),
                      b.contiguous().view(batch, steps, g, self.state_size),
                      c.contiguous().view(batch, steps, g, self.state_size),
                      self._time_step(dt).contiguous(), self.A, self.D, logged)
        return y.view(batch, steps, self.inner)

    def chunk(self, inputs: tuple[torch.Tensor, ...], states: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """L tokens of one sequence: xbc [L, conv_dim], dt [L, heads]; states [1, ...]."""
        xbc, dt = inputs
        conv, ssm = states
        length = xbc.shape[0]
        seq = torch.cat([conv[0], xbc])  # [K-1+L, conv_dim]
        conv_out = self.conv_bias + sum(seq[k:k + length] * self.conv_weight[k] for k in range(self.kernel))  # [L, conv_dim]
        x, b, c = self._split(F.silu(conv_out))
        y, new_ssm = ssd_scan(x, self._time_step(dt), self.A, b, c, ssm[0], min(self.chunk_size, length))
        y = y + x * self.D[:, None]
        return y.reshape(length, self.inner), [seq[None, length:], new_ssm[None]]


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """a [..., Q] -> [..., Q, Q]: out[l, s] = a[s+1] + ... + a[l] for l >= s, -inf above the diagonal
    (summed from the masked terms rather than as a difference of cumulative sums, which would
    cancel catastrophically far into a chunk; transformers' `segment_sum`)."""
    q = a.shape[-1]
    strict = torch.tril(torch.ones(q, q, dtype=torch.bool, device=a.device), diagonal=-1)
    sums = a[..., None].expand(*a.shape, q).masked_fill(~strict, 0).cumsum(dim=-2)
    return sums.masked_fill(~torch.tril(torch.ones(q, q, dtype=torch.bool, device=a.device)), -torch.inf)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             initial: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD chunked scan of one sequence, without the D skip.

    x [L, H, P], dt [L, H] (after softplus and clamp), A [H], b, c [L, H, N], initial [H, P, N] ->
    (y [L, H, P], the state after the last token [H, P, N])."""
    length = x.shape[0]
    pad = (chunk - length % chunk) % chunk
    xd = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad))  # zero-padded tokens: no input, no decay
    a = F.pad(dt * A, (0, 0, 0, pad))
    b, c = F.pad(b, (0, 0, 0, 0, 0, pad)), F.pad(c, (0, 0, 0, 0, 0, pad))
    n = (length + pad) // chunk
    xd, b, c = (t.view(n, chunk, *t.shape[1:]) for t in (xd, b, c))  # [n, Q, H, .]
    a = a.view(n, chunk, -1).permute(0, 2, 1)  # [n, H, Q]
    a_cum = a.cumsum(-1)  # [n, H, Q]

    # within each chunk: y[l] = sum_{s <= l} (C[l] . B[s]) exp(a[s+1..l]) xd[s]
    decay = torch.exp(_segment_sum(a))  # [n, H, Q(l), Q(s)]
    scores = torch.einsum("nlhs,nmhs->nhlm", c, b) * decay  # [n, H, l, s]
    y = torch.einsum("nhlm,nmhp->nlhp", scores, xd)  # [n, Q, H, P]

    # each chunk's own contribution to the state at its end, then the states at chunk starts
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [n, H, Q]
    chunk_states = torch.einsum("nhl,nlhs,nlhp->nhps", to_end, b, xd)  # [n, H, P, N]
    states = torch.cat([initial[None], chunk_states])  # [n+1, H, P, N]
    link = torch.exp(_segment_sum(F.pad(a_cum[..., -1], (0, 0, 1, 0)).t()))  # [H, n+1, n+1]
    starts = torch.einsum("hzw,whps->zhps", link, states)  # state at the start of chunk z; [n+1, H, P, N]

    # the state before each chunk, carried to each of its tokens
    y = y + torch.einsum("nlhs,nhps,nhl->nlhp", c, starts[:-1], torch.exp(a_cum))
    return y.reshape(n * chunk, *x.shape[1:])[:length], starts[-1]
