"""The gated delta net (Qwen3-Next's linear attention): a causal depthwise convolution over q, k, v,
then a recurrence that keeps one [k_dim, v_dim] matrix per value head instead of a KV cache.

Per token, with q and k L2-normalized (q also scaled by k_dim ** -0.5), beta = sigmoid(b) and
g = A * softplus(a + dt_bias) (A = -exp(A_log) < 0, so exp(g) is a decay in (0, 1)):

    S = exp(g) * S
    S = S + k (beta * (v - S^T k))^T        (the delta rule: write the correction of what S predicts)
    o = S^T q

A sequence's state is the last kernel - 1 inputs of the convolution and S for each value head.
Decode runs the recurrence one token at a time for every sequence at once (`step`); prefill runs
the chunked form (`chunk`): within a chunk of CHUNK tokens the sequential updates are condensed by
a triangular solve (the WY / UT form of DeltaNet) into matrix products, and only the chunks are
visited in order. Both read their states and return new ones (layers/recurrent.py's contract).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _C
from .recurrent import RecurrentMixer, scan_spans

_delta_step = _C.delta_step

CHUNK = 64  # tokens a chunk of the chunked form condenses into matrix products
L2_EPS = 1e-6  # as transformers' (and FLA's) l2norm: x * rsqrt(sum(x^2) + eps)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


class GatedDeltaNet(RecurrentMixer):
    """The mixer of a linear-attention layer. `in_proj` maps the hidden state to the convolution's
    input [q | k | v] (heads in order), the output gate z, and the per-value-head b and a (llama.cpp's
    `ssm_ba` layout: for each key head, its value heads' b then their a); `out_proj` maps the
    gated-normed output back. `a_coef` is A = -exp(A_log), `conv_weight` [channels, kernel]."""

    def __init__(self, in_proj, out_proj, conv_weight: torch.Tensor, a_coef: torch.Tensor, dt_bias: torch.Tensor,
                 norm_weight: torch.Tensor, num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int, eps: float):
        super().__init__()
        self.in_proj, self.out_proj = in_proj, out_proj
        for name, value in (("conv_weight", conv_weight), ("a_coef", a_coef), ("dt_bias", dt_bias),
                            ("norm_weight", norm_weight)):  # float32 on every path, as the states
            self.register_buffer(name, value.float(), persistent=False)
        self.num_k_heads, self.num_v_heads, self.k_dim, self.v_dim, self.eps = num_k_heads, num_v_heads, k_dim, v_dim, eps
        self.key_size, self.value_size = num_k_heads * k_dim, num_v_heads * v_dim
        self.channels = 2 * self.key_size + self.value_size
        self.kernel = conv_weight.shape[1]
        if conv_weight.shape[0] != self.channels or self.kernel < 2:
            raise ValueError(f"conv weight {tuple(conv_weight.shape)}: expected ({self.channels}, kernel >= 2)")
        if num_v_heads % num_k_heads:
            raise ValueError(f"{num_v_heads} value heads do not divide among {num_k_heads} key heads")

    def state_shapes(self) -> list[tuple[int, ...]]:
        """The convolution's last kernel - 1 inputs, and the recurrent matrix of each value head."""
        return [(self.channels, self.kernel - 1), (self.num_v_heads, self.k_dim, self.v_dim)]

    def forward(self, x: torch.Tensor, meta) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `meta` an AttentionMetadata whose `state` places the rows."""
        rows = x.shape[0]
        mixed = self.in_proj(x).float()
        qkv, z, ba = mixed.split([self.channels, self.value_size, 2 * self.num_v_heads], dim=-1)
        ba = ba.view(rows, self.num_k_heads, 2, self.num_v_heads // self.num_k_heads)
        b, a = ba[:, :, 0].reshape(rows, -1), ba[:, :, 1].reshape(rows, -1)
        g = self.a_coef * F.softplus(a + self.dt_bias)  # [T, v_heads], log of the decay
        out = scan_spans(meta.state, self.state, (qkv, g, torch.sigmoid(b)), self.step, self.chunk, self.step_in_pool)
        return self.out_proj(self._gated_norm(out, z))

    def _gated_norm(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMS norm over each head's values (weight as stored, not 1 + w), times silu(z)."""
        o = out.view(out.shape[0], self.num_v_heads, self.v_dim)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        return o.flatten(1) * F.silu(z)

    def _heads(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., channels] after the convolution -> q, k [..., v_heads, k_dim] (normalized, q scaled,
        each key head shared by its value heads) and v [..., v_heads, v_dim]."""
        lead = conv_out.shape[:-1]
        q, k, v = conv_out.split([self.key_size, self.key_size, self.value_size], dim=-1)
        q = _l2norm(q.reshape(*lead, self.num_k_heads, self.k_dim)) * self.k_dim ** -0.5
        k = _l2norm(k.reshape(*lead, self.num_k_heads, self.k_dim))
        group = self.num_v_heads // self.num_k_heads
        if group > 1:
            q, k = q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2)
        return q, k, v.reshape(*lead, self.num_v_heads, self.v_dim)

    def step(self, inputs: tuple[torch.Tensor, ...], states: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One token for each of B sequences: qkv [B, channels], g and beta [B, v_heads]."""
        qkv, g, beta = inputs
        conv, s = states  # [B, channels, kernel - 1], [B, v_heads, k_dim, v_dim]
        window = torch.cat([conv, qkv[:, :, None]], dim=-1)  # [B, channels, kernel]
        q, k, v = self._heads(F.silu((window * self.conv_weight).sum(-1)))
        s = s * g.exp()[:, :, None, None]
        predicted = (s * k[..., None]).sum(-2)  # [B, v_heads, v_dim]: S^T k
        s = s + k[..., None] * ((v - predicted) * beta[..., None])[:, :, None, :]
        out = (s * q[..., None]).sum(-2)
        return out.flatten(1), [window[:, :, 1:], s]

    def step_in_pool(self, inputs: tuple[torch.Tensor, ...], src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """T tokens of each of B sequences on the pool itself: qkv [B, T, channels], g and beta
        [B, T, v_heads]; states read from slots `src` [B], the state after token t written to slot
        dst[b, t] where that is not -1. The recurrence runs in C++ (`_C.delta_step`), without
        gathering and scattering the matrices; outputs [B, T, v_heads * v_dim]."""
        qkv, g, beta = inputs
        conv, s = self.state
        x = torch.cat([conv[src], qkv.transpose(1, 2)], dim=-1)  # [B, channels, kernel - 1 + T]
        conv_out = (x.unfold(-1, self.kernel, 1) * self.conv_weight[:, None, :]).sum(-1)  # [B, channels, T]
        keep = dst >= 0
        after = x.unfold(-1, self.kernel - 1, 1)[:, :, 1:]  # [B, channels, T, kernel - 1]: after each token
        conv[dst[keep]] = after.transpose(1, 2)[keep]
        q, k, v = (t.contiguous() for t in self._heads(F.silu(conv_out.transpose(1, 2))))
        return _delta_step(s, src, dst, q, k, v, g.contiguous(), beta.contiguous()).flatten(2)

    def chunk(self, inputs: tuple[torch.Tensor, ...], states: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """L tokens of one sequence: qkv [L, channels], g and beta [L, v_heads]; states [1, ...]."""
        qkv, g, beta = inputs
        conv, s = states
        length = qkv.shape[0]
        x = torch.cat([conv[0], qkv.T], dim=-1)  # [channels, kernel - 1 + L]
        conv_out = F.silu(F.conv1d(x[None], self.conv_weight[:, None, :], groups=self.channels)[0].T)  # [L, channels]
        q, k, v = (t.transpose(0, 1) for t in self._heads(conv_out))  # [v_heads, L, dim]
        out, s = chunked_delta_rule(q, k, v, g.T, beta.T, s[0])
        return out.transpose(0, 1).reshape(length, -1), [x[None, :, -(self.kernel - 1):], s[None]]


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       s: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over L tokens, chunk by chunk. q, k [H, L, dk]; v [H, L, dv]; g, beta [H, L];
    s [H, dk, dv] the state before. Returns (outputs [H, L, dv], the state after).

    Within a chunk, with c the cumulative log decay from its start and D[i, j] = exp(c_i - c_j) for
    j <= i: the token-by-token updates amount to u = T (beta v) and w = T (beta exp(c) k), T the
    inverse of I + strictly_lower((beta k) k^T * D); then, from the chunk's incoming state S,
    v' = u - w S, o = exp(c) q S + ((q k^T) * D) v', and S' = exp(c_last) S + (exp(c_last - c) k)^T v'.
    Padding tokens have k = v = 0 and g = 0: they change neither outputs nor the state."""
    heads, length, _ = k.shape
    pad = -length % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (length + pad) // chunk
    q, k, v = (t.reshape(heads, n, chunk, t.shape[-1]) for t in (q, k, v))
    c = g.reshape(heads, n, chunk).cumsum(-1)  # [H, n, C]
    beta = beta.reshape(heads, n, chunk, 1)
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).triu(1)
    decay = (c[..., :, None] - c[..., None, :]).masked_fill(future, float("-inf")).exp()  # [H, n, C, C]
    k_beta = k * beta
    eye = torch.eye(chunk, dtype=k.dtype, device=k.device)
    system = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1) + eye  # I + strictly lower part
    u = torch.linalg.solve_triangular(system, v * beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * c.exp()[..., None], upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * decay  # [H, n, C, C], the diagonal included
    q_in = q * c.exp()[..., None]
    last = c[..., -1:]  # [H, n, 1]
    k_out = k * (last - c).exp()[..., None]
    out = torch.empty_like(v)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = q_in[:, i] @ s + inner[:, i] @ v_new
        s = s * last[:, i, :, None].exp() + k_out[:, i].transpose(-1, -2) @ v_new
    return out.reshape(heads, n * chunk, -1)[:, :length], s
