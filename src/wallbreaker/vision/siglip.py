"""SigLIP's vision encoder (transformers' `SiglipVisionModel` without its pooling head): patches by a
strided convolution, learned position embeddings, pre-LayerNorm encoder layers with full
(bidirectional) attention and a GELU-tanh MLP, a final LayerNorm. Gemma 3's tower."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelFormatError, UnsupportedModelError

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


@dataclass(frozen=True)
class SiglipConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @classmethod
    def from_hf(cls, hf: dict[str, Any], where: str) -> "SiglipConfig":
        try:
            cfg = cls(hidden_size=int(hf.get("hidden_size", 768)), intermediate_size=int(hf.get("intermediate_size", 3072)),
                      num_layers=int(hf.get("num_hidden_layers", 12)), num_heads=int(hf.get("num_attention_heads", 12)),
                      image_size=int(hf.get("image_size", 224)), patch_size=int(hf.get("patch_size", 16)),
                      num_channels=int(hf.get("num_channels", 3)), layer_norm_eps=float(hf.get("layer_norm_eps", 1e-6)),
                      hidden_act=str(hf.get("hidden_act", "gelu_pytorch_tanh")))
        except (TypeError, ValueError) as e:
            raise ModelFormatError(f"{where}: vision_config: {e}") from None
        if cfg.hidden_act not in _ACTIVATIONS:
            raise UnsupportedModelError(f"{where}: vision_config.hidden_act {cfg.hidden_act!r} is not supported")
        if min(cfg.hidden_size, cfg.num_heads, cfg.patch_size, cfg.image_size, cfg.num_layers) <= 0 or \
                cfg.hidden_size % cfg.num_heads or cfg.image_size % cfg.patch_size:
            raise ModelFormatError(f"{where}: vision_config: inconsistent sizes {cfg}")
        return cfg

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the tower reads (names under the tower, transformers' without `vision_model.`)."""
        h, f, p, c = self.hidden_size, self.intermediate_size, self.patch_size, self.num_channels
        shapes = {"embeddings.patch_embedding.weight": (h, c, p, p), "embeddings.patch_embedding.bias": (h,),
                  "embeddings.position_embedding.weight": (self.patches_per_side ** 2, h),
                  "post_layernorm.weight": (h,), "post_layernorm.bias": (h,)}
        for i in range(self.num_layers):
            q = f"encoder.layers.{i}."
            for norm in ("layer_norm1", "layer_norm2"):
                shapes.update({q + norm + ".weight": (h,), q + norm + ".bias": (h,)})
            for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                shapes.update({q + f"self_attn.{proj}.weight": (h, h), q + f"self_attn.{proj}.bias": (h,)})
            shapes.update({q + "mlp.fc1.weight": (f, h), q + "mlp.fc1.bias": (f,),
                           q + "mlp.fc2.weight": (h, f), q + "mlp.fc2.bias": (h,)})
        return shapes


class SiglipVisionTower(nn.Module):
    def __init__(self, cfg: SiglipConfig, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        self.w = {name: t.float().contiguous() for name, t in tensors.items()}  # plain tensors: nothing trains here
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.linears: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}  # `use_linears`; else F.linear

    LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2")

    def use_linears(self, make: Callable[[torch.Tensor, torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]) -> None:
        """Run the encoder layers' projections through `make(weight, bias)`'s modules (the `auto` path
        gives our kernels' packed linear layers); the float weights they replace are dropped."""
        for i in range(self.cfg.num_layers):
            for proj in self.LINEARS:
                name = f"encoder.layers.{i}.{proj}"
                self.linears[name] = make(self.w.pop(name + ".weight"), self.w.pop(name + ".bias"))

    def forward(self, pixels: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[N, 3, H, W] float32 pixel values -> [N, patches, hidden] (after the final LayerNorm).
        `position_ids` [patches]: which position embedding each patch takes (default: its index)."""
        cfg, w = self.cfg, self.w
        x = F.conv2d(pixels.float(), w["embeddings.patch_embedding.weight"], w["embeddings.patch_embedding.bias"],
                     stride=cfg.patch_size)  # [N, hidden, side, side]
        positions = w["embeddings.position_embedding.weight"]
        if position_ids is not None:
            positions = positions[position_ids]
        x = x.flatten(2).transpose(1, 2) + positions  # [N, patches, hidden]
        n, t, h = x.shape
        heads, head_dim = cfg.num_heads, h // cfg.num_heads
        for i in range(cfg.num_layers):
            q = f"encoder.layers.{i}."

            def lin(name: str, v: torch.Tensor) -> torch.Tensor:
                module = self.linears.get(q + name)
                if module is not None:
                    return module(v.reshape(-1, v.shape[-1])).float().reshape(*v.shape[:-1], -1)
                return F.linear(v, w[q + name + ".weight"], w[q + name + ".bias"])

            y = self._norm(x, q + "layer_norm1")
            qkv = [lin(f"self_attn.{p}_proj", y).view(n, t, heads, head_dim).transpose(1, 2) for p in "qkv"]
            attn = F.scaled_dot_product_attention(*qkv, scale=head_dim ** -0.5)  # [N, heads, patches, head_dim]
            x = x + lin("self_attn.out_proj", attn.transpose(1, 2).reshape(n, t, h))
            x = x + lin("mlp.fc2", self.act(lin("mlp.fc1", self._norm(x, q + "layer_norm2"))))
        return self._norm(x, "post_layernorm")

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.w[name + ".weight"], self.w[name + ".bias"], self.cfg.layer_norm_eps)
