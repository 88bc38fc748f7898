"""LFM2 (Liquid AI): pre-norm blocks whose mixer is a gated short convolution
(layers/short_conv.py) in most layers and GQA attention with q/k RMSNorm and RoPE in the others;
a SwiGLU FFN in every layer; the final norm is the one its files call `embedding_norm`
(GGUF `token_embd_norm`). Attention and FFN are the Llama family's (llama.py)."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..formats.lfm2 import FINAL_NORM
from ..layers.attention import AttentionMetadata
from ..layers.direct import DirectModule
from ..layers.short_conv import ShortConv
from .base import CausalLM, rms_norm
from .llama import Attention, feed_forward
from .source import WeightSource


def short_conv(layer: int, src: WeightSource) -> ShortConv:
    """Under tensor parallelism a rank holds a run of the channels: its rows of each of in_proj's B, C
    and x, of the convolution, and its columns of out_proj (whose partial sums are all-reduced)."""
    p = f"blk.{layer}.shortconv."
    conv = src.weights[p + "conv.weight"].load().float()  # [channels, kernel]
    if src.shard is None:
        return ShortConv(src.linear([p + "in_proj.weight"]), conv, src.linear([p + "out_proj.weight"]))
    channels = conv.shape[0]
    mine = src.shard.split(channels)
    in_rows = [range(k * channels + mine.start, k * channels + mine.stop) for k in range(3)]  # B, C, x
    return ShortConv(src.linear_of([src.weights[p + "in_proj.weight"]] * 3, parallel="column", slices=in_rows),
                     conv[mine.start:mine.stop], src.linear([p + "out_proj.weight"], parallel="row", slices=[mine]))


class Lfm2DecoderLayer(DirectModule):
    """operator_norm -> mixer (convolution or attention) -> residual; ffn_norm -> FFN -> residual,
    the residual adds deferred to the next norm as in llama.py."""

    def __init__(self, cfg: ModelConfig, layer: int, src: WeightSource):
        super().__init__()
        p = f"blk.{layer}."
        self.attn_norm = rms_norm(src, p + "attn_norm.weight", cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer, src) if cfg.is_attention(layer) else None
        self.conv = None if self.attn is not None else short_conv(layer, src)
        self.mlp_norm = rms_norm(src, p + "ffn_norm.weight", cfg.rms_norm_eps)
        self.mlp = feed_forward(cfg, layer, src)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata,
                delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.attn_norm.add_and_norm(h, delta)
        mixed = self.attn(x, meta) if self.attn is not None else self.conv(x, meta)
        return h, self.mlp(self.mlp_norm.add_and_norm(h, mixed))


class Lfm2CausalLM(CausalLM):
    layer_class = Lfm2DecoderLayer
    final_norm = FINAL_NORM
