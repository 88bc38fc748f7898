"""Rotary position embeddings, every variant: plain, linear, Llama 3, YaRN and Phi-3's LongRoPE.

A variant only changes how the inverse frequencies are built (and, for YaRN and LongRoPE, a factor
on cos and sin, which scales the attention scores by its square); the fused q/k step
(`_C.rope_write_kv`) takes the resulting cos/sin [T, head_dim] whatever the variant. The arithmetic
follows transformers' `modeling_rope_utils` operation for operation, so float32 results agree.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..config import RopeScaling


def _exponents(head_dim: int) -> torch.Tensor:
    """2i / head_dim for each pair of channels, float32."""
    return torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    if s.freq_factors:  # llama.cpp's form: one divisor per frequency
        return inv_freq / torch.tensor(s.freq_factors, dtype=torch.float32)
    old_context = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old_context / s.low_freq_factor, old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(head_dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of the extrapolated (unscaled) frequency
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    factor = s.attention_factor if s.attention_factor is not None else _yarn_mscale(s.factor)
    return inv_freq, factor


def _longrope_factor(s: RopeScaling) -> float:
    if s.attention_factor is not None:
        return s.attention_factor
    if s.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_position_embeddings))


def frequencies(head_dim: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """(inverse frequencies [head_dim/2], those from `original_max_position_embeddings` on or None,
    the factor on cos and sin)."""
    base = 1.0 / (theta ** _exponents(head_dim))
    if scaling is None:
        return base, None, 1.0
    if scaling.kind == "linear":
        return base / scaling.factor, None, 1.0
    if scaling.kind == "llama3":
        return _llama3(base, scaling), None, 1.0
    if scaling.kind == "yarn":
        inv_freq, factor = _yarn(head_dim, theta, scaling)
        return inv_freq, None, factor
    if scaling.kind == "longrope":
        shape = theta ** _exponents(head_dim)

        def inv(ext: tuple[float, ...]) -> torch.Tensor:
            return 1.0 / (torch.tensor(ext, dtype=torch.float32) * shape)
        return inv(scaling.short_factor), inv(scaling.long_factor), _longrope_factor(scaling)
    raise ValueError(f"unknown RoPE scaling {scaling.kind!r}")  # ModelConfig admits none other


_KEYS: dict[tuple, int] = {}  # (head_dim, theta, scaling) -> its key


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (Hugging Face layout), computed for the positions at hand.

    Angles are built per call from `positions`, so no table sized by the maximum context exists;
    float32 inverse frequencies times float32 positions, as transformers computes them.

    LongRoPE picks its factors per position: short below `original_max_position_embeddings`, long
    from there. (transformers picks one set for a whole forward pass by its longest position, so a
    cached sequence that grows past that length has its earlier keys under the short factors there
    too; here a token's rotation never depends on what else is computed with it.)
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None):
        super().__init__()
        inv_freq, inv_freq_long, self.attention_factor = frequencies(head_dim, theta, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("inv_freq_long", inv_freq_long, persistent=False)
        self.long_from = scaling.original_max_position_embeddings if inv_freq_long is not None else None
        # layers with equal keys share one cos/sin per step; a small int, so that the per-layer lookup
        # never hashes a scaling's factor lists
        self.key = _KEYS.setdefault((head_dim, theta, scaling), len(_KEYS))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin, [T, head_dim]: the rotation is then x * cos + roll(x, half) * sin,
        which the fused q/k step (`_C.rope_write_kv`) applies."""
        inv_freq = self.inv_freq[None, :]  # [1, head_dim/2]
        if self.inv_freq_long is not None:
            inv_freq = torch.where((positions >= self.long_from)[:, None], self.inv_freq_long[None, :], inv_freq)
        freqs = positions.float()[:, None] * inv_freq  # [T, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        half = emb.shape[-1] // 2
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        sin[:, :half].neg_()  # rotate_half(x) = cat(-x2, x1) = roll(x, half) * [-1.., 1..]; the sign is exact
        return cos, sin


class MRotaryEmbedding(RotaryEmbedding):
    """Qwen2.5-VL's and Qwen3-VL's multimodal RoPE: positions [3, T] (temporal, row, column); each
    rotated pair takes one of the three positions' angles. Qwen2.5-VL cuts the pairs into `section`
    (summing to head_dim / 2): the first run temporal, the second row, the third column. Qwen3-VL
    (`interleaved`) deals them out in turn, pair i taking row where i % 3 == 1 and i < 3 * section[1],
    column where i % 3 == 2 and i < 3 * section[2], temporal otherwise (transformers'
    `recomposition_frequencies` of each). Plain positions [T] are all three alike, which is plain RoPE."""

    def __init__(self, head_dim: int, theta: float, section: tuple[int, ...], interleaved: bool = False):
        super().__init__(head_dim, theta)
        if sum(section) != head_dim // 2:
            raise ValueError(f"mrope_section {section} does not sum to head_dim / 2 = {head_dim // 2}")
        self.section = tuple(section)
        if interleaved:
            pair = torch.arange(head_dim // 2)
            axis = torch.zeros(head_dim // 2, dtype=torch.long)
            for a in (1, 2):
                axis[(pair % 3 == a) & (pair < 3 * section[a])] = a
        else:
            axis = torch.cat([torch.full((n,), a, dtype=torch.long) for a, n in enumerate(section)])
        self.axis = axis  # [head_dim/2]: which position each rotated pair takes
        self.key = _KEYS.setdefault((head_dim, theta, None, self.section, interleaved), len(_KEYS))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().cos_sin(positions)
        freqs = positions.float()[..., None] * self.inv_freq  # [3, T, head_dim/2]
        axis = self.axis.to(freqs.device)
        freqs = freqs.gather(0, axis.expand(1, freqs.shape[1], -1))[0]  # [T, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        half = emb.shape[-1] // 2
        cos, sin = emb.cos(), emb.sin()
        sin[:, :half].neg_()
        return cos, sin
