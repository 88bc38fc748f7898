import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (Hugging Face layout), computed for the positions at hand.

    Angles are built per call from `positions`, so no table sized by the maximum context exists;
    the arithmetic matches transformers' (float32 inverse frequencies times float32 positions).
    """

    def __init__(self, head_dim: int, theta: float, scaling_factor: float = 1.0):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq / scaling_factor, persistent=False)
        self.key = (head_dim, theta, scaling_factor)  # layers with equal keys share one cos/sin per step

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin, [T, head_dim]: the rotation is then x * cos + roll(x, half) * sin,
        which the fused q/k step (`_C.rope_write_kv`) applies."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        half = emb.shape[-1] // 2
        sin = emb.sin()
        sin[:, :half].neg_()  # rotate_half(x) = cat(-x2, x1) = roll(x, half) * [-1.., 1..]; the sign is exact
        return emb.cos(), sin
