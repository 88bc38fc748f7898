"""RWKV-7 ("Goose"): a time mix whose WKV state is updated by a generalized delta rule, and a channel
mix, each fed its input mixed with the previous token's (the token shift). As llama.cpp's
`build_rwkv7_time_mix` and BlinkDL's `RWKV_x070_TMix_seq`, per token with x the normed input and
xx = x_prev - x:

    x_r, x_w, x_k, x_v, x_a, x_g = x + xx * mix_{r,w,k,v,a,g}
    r = R x_r;  k = K x_k;  v = V x_v
    w = exp(-e^-0.5 sigmoid(w0 + W2 tanh(W1 x_w)))        (the decay, in (0.545, 1))
    a = sigmoid(a0 + A2 A1 x_a);  g = G2 sigmoid(G1 x_g)
    kk = l2norm(k * k_k) per head;  k = k * (1 + (a - 1) k_a)
    v = v + (v_first - v) sigmoid(v0 + V2 V1 x_v)          (v_first: layer 0's v; layer 0 keeps its own)
    per head, S [values, keys]:  S <- S diag(w) + (S (-kk)) (kk a)^T + v k^T;  y = S r
    out = O ((group_norm(y) + (sum(r k r_k) per head) v) * g)

and the channel mix: k = x + xx * mix_k; out = V relu(K k)^2.

The elementwise work between the low-rank pairs and the WKV update (decay, rate, kk, k, v, a, b),
and after it (group norm, bonus, gate), is one C++ op each (`_C.rwkv7_mix`, `_C.rwkv7_out`): at
decode its ~30 small PyTorch ops a layer cost more in dispatch than in arithmetic.

Three states per sequence, float32: the time mix's last input [1, hidden], S [heads, N, N], the
channel mix's last input [1, hidden]. The WKV update runs in C++ (`_C.wkv7_step`): on the pool itself
for decode, verification and prompt spans up to MAX_STEP_TOKENS, from a copy of the state for longer
prompt chunks; the token shifts are `_C.conv_step` with two taps (1 on the previous input, 0 on the
token's own).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .. import _C
from .direct import DirectModule
from .recurrent import scan_spans

_conv_step = _C.conv_step
_wkv7_step = _C.wkv7_step
_rwkv7_mix = _C.rwkv7_mix
_rwkv7_out = _C.rwkv7_out

GROUP_NORM_EPS = 64e-5  # llama.cpp's and BlinkDL's, whatever the head size


class LayerNorm(DirectModule):
    """LayerNorm with bias in float32, with the residual add the next norm takes (`add_and_norm`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("weight", weight.float(), persistent=False)
        self.register_buffer("bias", bias.float(), persistent=False)
        self.eps, self._shape = eps, tuple(weight.shape)
        self._weight, self._bias = self.weight, self.bias  # read on every call: plain attributes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.layer_norm(x.float(), self._shape, self._weight, self._bias, self.eps)

    def add_and_norm(self, h: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        if delta is not None:
            h += delta
        return self.forward(h)


class TokenShift(DirectModule):
    """The previous token's input [T, hidden] for each row, from the last input kept in `pool`
    [num_slots, 1, hidden]."""

    def __init__(self, hidden: int):
        super().__init__()
        taps = torch.zeros(2, hidden)
        taps[0] = 1.0  # the input one token back
        self.register_buffer("taps", taps, persistent=False)

    def forward(self, x: torch.Tensor, meta, pool: torch.Tensor) -> torch.Tensor:
        def in_pool(inputs: tuple[torch.Tensor, ...], src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
            return _conv_step(pool, src, dst, inputs[0], self.taps, None, False)
        return scan_spans(meta.state, [pool], (x.contiguous(),), self.step, self.chunk, in_pool)

    @staticmethod
    def step(inputs: tuple[torch.Tensor, ...], states: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One token of each of B sequences: x [B, hidden], the last inputs [B, 1, hidden]."""
        (x,), (last,) = inputs, states
        return last[:, 0], [x[:, None]]

    @staticmethod
    def chunk(inputs: tuple[torch.Tensor, ...], states: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """L tokens of one sequence: x [L, hidden], the last input [1, 1, hidden]."""
        (x,), (last,) = inputs, states
        seq = torch.cat([last[0], x])  # [1 + L, hidden]
        return seq[:-1], [seq[None, -1:]]


@dataclass
class TimeMixWeights:
    """A time mix's float32 vectors and its decay's low-rank pair, which llama.cpp's converter keeps in
    float32 (the other pairs, quantized like the projections, are `LowRank` modules)."""

    lerp: torch.Tensor  # [6, 1, hidden]: r, w, k, v, a, g
    w0: torch.Tensor
    w1: torch.Tensor  # [rank, hidden]
    w2: torch.Tensor  # [hidden, rank]
    a0: torch.Tensor
    k_k: torch.Tensor
    k_a: torch.Tensor
    r_k: torch.Tensor  # [hidden]: [heads, N] flattened
    ln_weight: torch.Tensor
    ln_bias: torch.Tensor
    v0: torch.Tensor | None = None  # the value residual's bias; None in layer 0


class LowRank(DirectModule):
    """A low-rank pair as two linear modules (`down` [rank, hidden], `up` [hidden, rank]), so a quantized
    file's pair runs in its stored blocks, as llama.cpp runs it, rather than read as float32 at four
    times the bytes each token; `inner` is applied between them."""

    def __init__(self, down: nn.Module, up: nn.Module, inner=None):
        super().__init__()
        self.down, self.up, self.inner = down, up, inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(x).float()
        return self.up(h if self.inner is None else self.inner(h)).float()


class ValueFirst:
    """Layer 0's value rows of the step, which the later layers' values mix in (one per model)."""

    v: torch.Tensor | None = None


class WKV7:
    """The WKV update of a time mix on its pool [num_slots, heads, N values, N keys]: in C++ whatever the
    span's length (`step` is the same update in PyTorch, for single tokens cut from a long span)."""

    @staticmethod
    def forward(inputs: tuple[torch.Tensor, ...], meta, pool: torch.Tensor) -> torch.Tensor:
        """r, w, k, v, a, b [T, heads, N] -> y [T, heads, N]."""
        def in_pool(inputs: tuple[torch.Tensor, ...], src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
            return _wkv7_step(pool, src, dst, *(x.contiguous() for x in inputs))
        return scan_spans(meta.state, [pool], inputs, WKV7.step, WKV7.chunk, in_pool)

    @staticmethod
    def step(inputs: tuple[torch.Tensor, ...], states: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One token of each of B sequences: inputs [B, heads, N], S [B, heads, N, N]."""
        r, w, k, v, a, b = inputs
        (s,) = states
        s = s * w[:, :, None, :] + (s @ a[..., None]) * b[:, :, None, :] + v[..., None] * k[:, :, None, :]
        return (s @ r[..., None])[..., 0], [s]

    @staticmethod
    def chunk(inputs: tuple[torch.Tensor, ...], states: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """L tokens of one sequence (inputs [L, heads, N], S [1, heads, N, N]) by the C++ update on a pool of
        two slots: the state read from the first, the one after the last token written to the second."""
        (s,) = states
        pool = torch.cat([s, torch.empty_like(s)])
        dst = torch.full((1, inputs[0].shape[0]), -1, dtype=torch.long)
        dst[0, -1] = 1
        y = _wkv7_step(pool, torch.zeros(1, dtype=torch.long), dst, *(x[None].contiguous() for x in inputs))
        return y[0], [pool[1:]]


class TimeMix(DirectModule):
    def __init__(self, heads: int, head_size: int, r: nn.Module, k: nn.Module, v: nn.Module, o: nn.Module,
                 w: TimeMixWeights, a_lora: LowRank, g_lora: LowRank, v_lora: LowRank | None, first: ValueFirst):
        super().__init__()
        self.heads, self.n = heads, head_size
        self.r_proj, self.k_proj, self.v_proj, self.o_proj = r, k, v, o
        self.a_lora, self.g_lora, self.v_lora = a_lora, g_lora, v_lora  # v_lora: None in layer 0
        self.w, self.first = w, first
        self.shift = TokenShift(heads * head_size)

    def forward(self, x: torch.Tensor, meta, shift_pool: torch.Tensor, wkv_pool: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (after the layer's first norm) -> [T, hidden]."""
        w, rows = self.w, x.shape[0]
        mixed = torch.addcmul(x, self.shift(x, meta, shift_pool) - x, w.lerp)  # [6, T, hidden]
        xr, xw, xk, xv, xa, xg = mixed.unbind(0)
        r, k, v = self.r_proj(xr).float(), self.k_proj(xk).float(), self.v_proj(xv).float()
        w_low = F.linear(torch.tanh(F.linear(xw, w.w1)), w.w2)
        if self.v_lora is None:
            self.first.v = v
            residual = (None, None, None)
        else:
            residual = (self.v_lora(xv), self.first.v, w.v0)
        v_low, v_first, v0 = residual
        mixed = _rwkv7_mix(k, v, w_low, self.a_lora(xa), v_low, v_first, w.w0, w.a0, v0, w.k_k, w.k_a, self.n)
        decay, k, v, a, b = mixed.view(5, rows, self.heads, self.n).unbind(0)  # [T, heads, N] each
        y = WKV7.forward((r.view(rows, self.heads, self.n), decay, k, v, a, b), meta, wkv_pool)
        y = _rwkv7_out(y.reshape(rows, -1), r, k.reshape(rows, -1), v.reshape(rows, -1), self.g_lora(xg),
                       w.ln_weight, w.ln_bias, w.r_k, self.n, GROUP_NORM_EPS)
        return self.o_proj(y)


class ChannelMix(DirectModule):
    def __init__(self, hidden: int, lerp_k: torch.Tensor, key: nn.Module, value: nn.Module):
        super().__init__()
        self.register_buffer("lerp_k", lerp_k.float(), persistent=False)
        self.key, self.value = key, value
        self.shift = TokenShift(hidden)

    def forward(self, x: torch.Tensor, meta, shift_pool: torch.Tensor) -> torch.Tensor:
        k = torch.addcmul(x, self.shift(x, meta, shift_pool) - x, self.lerp_k)
        h = torch.relu_(self.key(k).float())  # the key's output is the step's own: changed in place
        return self.value(h.mul_(h))
