"""RWKV-7 (fla-hub's RWKV7ForCausalLM, llama.cpp's `rwkv7`): embeddings through a LayerNorm, a stack of
pre-norm layers of a time mix and a channel mix with residuals, a final LayerNorm. No attention:
each layer's three states live in the state pool (layers/rwkv7.py)."""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..formats.rwkv7 import LERPS
from ..layers.attention import AttentionMetadata
from ..layers.recurrent import RecurrentMixer
from ..layers.rwkv7 import ChannelMix, LayerNorm, LowRank, TimeMix, TimeMixWeights, ValueFirst
from .base import CausalLM
from .source import WeightSource


def layer_norm(src: WeightSource, name: str, eps: float) -> LayerNorm:
    return LayerNorm(src.tensor(name + ".weight").float(), src.tensor(name + ".bias").float(), eps)


def time_mix(cfg: ModelConfig, layer: int, src: WeightSource, first: ValueFirst) -> TimeMix:
    """Layer `layer`'s time mix: its four projections and the a, g and v low-rank pairs through
    `src.linear`, the decay's pair (float32 in llama.cpp's files) and the vectors float32 (canonical
    names and layouts: formats/rwkv7.py)."""
    p = f"blk.{layer}.time_mix_"

    def small(name: str) -> torch.Tensor:
        return src.tensor(p + name).float()

    def low_rank(x: str, inner=None) -> LowRank:
        return LowRank(src.linear([f"{p}{x}1.weight"]), src.linear([f"{p}{x}2.weight"]), inner)
    heads, n = cfg.num_heads, cfg.head_dim
    weights = TimeMixWeights(
        lerp=small("lerp_fused.weight").reshape(len(LERPS), 1, cfg.hidden_size),
        w0=small("w0.weight"), w1=small("w1.weight"), w2=small("w2.weight"), a0=small("a0.weight"),
        k_k=small("k_k.weight"), k_a=small("k_a.weight"), r_k=small("r_k.weight").reshape(-1),
        ln_weight=small("ln.weight"), ln_bias=small("ln.bias"), v0=None if layer == 0 else small("v0.weight"))
    proj = [src.linear([f"{p}{name}.weight"]) for name in ("receptance", "key", "value", "output")]
    return TimeMix(heads, n, *proj, weights, low_rank("a"), low_rank("g", torch.sigmoid),
                   None if layer == 0 else low_rank("v"), first)


class Rwkv7Layer(RecurrentMixer):
    """A layer; its states: the time mix's last input, its WKV state, the channel mix's last input."""

    def __init__(self, cfg: ModelConfig, layer: int, src: WeightSource):
        super().__init__()
        self.hidden, self.heads, self.head_size = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        p, eps = f"blk.{layer}.", cfg.rms_norm_eps
        self.norm, self.ffn_norm = layer_norm(src, p + "attn_norm", eps), layer_norm(src, p + "attn_norm_2", eps)
        self.time_mix = time_mix(cfg, layer, src, ValueFirst())
        self.channel_mix = ChannelMix(cfg.hidden_size, src.tensor(p + "channel_mix_lerp_k.weight"),
                                      src.linear([p + "channel_mix_key.weight"]),
                                      src.linear([p + "channel_mix_value.weight"]))

    def state_shapes(self) -> list[tuple[int, ...]]:
        return [(1, self.hidden), (self.heads, self.head_size, self.head_size), (1, self.hidden)]

    def forward(self, h: torch.Tensor, meta: AttentionMetadata,
                delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        time_shift, wkv, channel_shift = self.state
        mixed = self.time_mix(self.norm.add_and_norm(h, delta), meta, time_shift, wkv)
        return h, self.channel_mix(self.ffn_norm.add_and_norm(h, mixed), meta, channel_shift)


class Rwkv7CausalLM(CausalLM):
    layer_class = Rwkv7Layer

    def __init__(self, cfg: ModelConfig, src: WeightSource):
        super().__init__(cfg, src)
        self.embed_norm = layer_norm(src, "token_embd_norm", cfg.rms_norm_eps)
        self.norm = layer_norm(src, "output_norm", cfg.rms_norm_eps)
        first = self.layers[0].time_mix.first
        for layer in self.layers:  # layer 0's values, which the others mix in
            layer.time_mix.first = first

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(super().embed_tokens(input_ids))
