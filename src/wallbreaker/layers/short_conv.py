"""LFM2's gated short convolution: in_proj -> (B, C, x); B * x through a depthwise causal
convolution of a few taps (no bias); C * its output; out_proj.

The state a sequence keeps is the convolution's last `kernel - 1` inputs per channel (B * x of the
tokens before the next one), [kernel - 1, hidden], oldest first. Everything but the convolution is
per token, so the projections and gates run once over all rows of a step, and only the
convolution goes through `scan_spans`: as `step_in_pool` for spans of a few tokens (decode,
verification, short prompts: every sequence of a length at once), else `step` and `chunk`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _C
from .attention import AttentionMetadata
from .recurrent import RecurrentMixer, scan_spans


_conv_step = _C.conv_step


class ShortConv(RecurrentMixer):
    def __init__(self, in_proj: torch.nn.Module, conv_weight: torch.Tensor, out_proj: torch.nn.Module):
        """`in_proj`: hidden -> 3 * channels (B, C, x); `conv_weight`: [channels, kernel], tap k
        multiplying the input k - (kernel - 1) tokens back; `out_proj`: channels -> hidden."""
        super().__init__()
        self.in_proj, self.out_proj = in_proj, out_proj
        self.channels, self.kernel = conv_weight.shape
        if self.kernel < 2:
            raise ValueError(f"a short convolution needs at least 2 taps, got {self.kernel}")
        weight = conv_weight.float().contiguous()
        self.taps = weight.t().contiguous()  # [kernel, channels]: the step's and step_in_pool's
        self.conv1d_weight = weight.unsqueeze(1)  # [channels, 1, kernel]: the chunk's

    def state_shapes(self) -> list[tuple[int, ...]]:
        return [(self.kernel - 1, self.channels)]

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        b, c, v = self.in_proj(x).float().chunk(3, dim=-1)  # each [T, channels]
        conv = scan_spans(meta.state, self.state, (b * v,), self.step, self.chunk, self.step_in_pool)
        return self.out_proj((c * conv).to(x.dtype))

    def step(self, inputs: tuple[torch.Tensor, ...], states: list[torch.Tensor]
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One token per sequence: inputs ([B, channels],), states [B, kernel - 1, channels]."""
        window = torch.cat([states[0], inputs[0].unsqueeze(1)], dim=1)  # [B, kernel, channels]
        return (window * self.taps).sum(1), [window[:, 1:]]

    def chunk(self, inputs: tuple[torch.Tensor, ...], states: list[torch.Tensor]
              ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """L tokens of one sequence: inputs ([L, channels],), states [1, kernel - 1, channels]."""
        window = torch.cat([states[0][0], inputs[0]])  # [kernel - 1 + L, channels]
        out = F.conv1d(window.t().unsqueeze(0), self.conv1d_weight, groups=self.channels)  # [1, channels, L]
        return out[0].t(), [window[-(self.kernel - 1):].unsqueeze(0)]

    def step_in_pool(self, inputs: tuple[torch.Tensor, ...], src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """T tokens of each of B sequences (decode: 1; verification: 1 + drafts): inputs ([B, T, channels],),
        states read from the pool's `src` slots [B], the state after token t written to slot dst[b, t]
        (-1: not kept), in C++ (`_C.conv_step`): no gather, scatter or window copies."""
        return _conv_step(self.state[0], src, dst, inputs[0], self.taps, None, False)
