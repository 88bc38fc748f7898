"""Qwen3-VL's vision encoder (transformers' `Qwen3VLVisionModel`) and its DeepStack features.

Against Qwen2.5-VL's (qwen2_5_vl.py): the 3D patch embedding has a bias; a learned square table of
position embeddings is resampled to the image's patch grid (bilinear, corners aligned) and added;
the blocks are LayerNorm ones with a plain MLP and attend over the whole image (no windows); the
merger normalizes each patch (LayerNorm) before the merge-block is concatenated. DeepStack: after
each block in `deepstack_visual_indexes` a merger of its own (LayerNorm over the concatenated block)
gives one more vector a token; the decoder adds the k-th of them to the image's tokens' hidden
states after its k-th layer (models/base.py). The encoder returns them side by side,
[tokens, (1 + len(deepstack_visual_indexes)) * out_hidden_size], so that the engine's encoder cache
and prefix keys take an image's features whole.

Patches, the 2D rotary positions, the prompt and the decoder's M-RoPE positions are Qwen2.5-VL's
(the decoder's sections are interleaved: layers/rotary.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ModelFormatError, UnsupportedModelError
from .qwen2_5_vl import (_ACTIVATIONS, Qwen25VisionEncoder, Qwen25VLVision, _rotate_half, folder_processor,
                         image_token, read_visual, rotary_positions)

NORM_EPS = 1e-6  # transformers' LayerNorms in the blocks and the mergers


@dataclass(frozen=True)
class Qwen3VisionConfig:
    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, hf: dict[str, Any], where: str) -> "Qwen3VisionConfig":
        rope = hf.get("rope_parameters") or {}
        try:
            cfg = cls(**{k: hf[k] for k in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels",
                                            "patch_size", "spatial_merge_size", "temporal_patch_size",
                                            "out_hidden_size", "num_position_embeddings", "hidden_act") if k in hf},
                      deepstack_visual_indexes=tuple(int(i) for i in hf.get("deepstack_visual_indexes", (8, 16, 24))),
                      rope_theta=float(rope.get("rope_theta", 10000.0)))
        except (TypeError, ValueError) as e:
            raise ModelFormatError(f"{where}: vision_config: {e}") from None
        if rope.get("rope_type", "axial") != "axial":
            raise UnsupportedModelError(f"{where}: vision_config rope_type {rope.get('rope_type')!r} is not supported")
        if cfg.hidden_act not in _ACTIVATIONS:
            raise UnsupportedModelError(f"{where}: vision_config.hidden_act {cfg.hidden_act!r} is not supported")
        side = round(cfg.num_position_embeddings ** 0.5)
        if cfg.hidden_size % cfg.num_heads or (cfg.hidden_size // cfg.num_heads) % 4 or side * side != \
                cfg.num_position_embeddings or not all(0 <= i < cfg.depth for i in cfg.deepstack_visual_indexes):
            raise ModelFormatError(f"{where}: vision_config: inconsistent sizes {cfg}")
        return cfg

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the encoder reads (transformers' names under `visual.`)."""
        h, f, out = self.hidden_size, self.intermediate_size, self.out_hidden_size
        m2, p = h * self.spatial_merge_size ** 2, self.patch_size
        shapes: dict[str, tuple[int, ...]] = {
            "patch_embed.proj.weight": (h, self.in_channels, self.temporal_patch_size, p, p),
            "patch_embed.proj.bias": (h,), "pos_embed.weight": (self.num_position_embeddings, h)}
        mergers = {"merger.": h, **{f"deepstack_merger_list.{k}.": m2
                                    for k in range(len(self.deepstack_visual_indexes))}}
        for q, norm in mergers.items():
            shapes.update({q + "norm.weight": (norm,), q + "norm.bias": (norm,), q + "linear_fc1.weight": (m2, m2),
                           q + "linear_fc1.bias": (m2,), q + "linear_fc2.weight": (out, m2),
                           q + "linear_fc2.bias": (out,)})
        for i in range(self.depth):
            q = f"blocks.{i}."
            shapes.update({q + "norm1.weight": (h,), q + "norm1.bias": (h,), q + "norm2.weight": (h,),
                           q + "norm2.bias": (h,), q + "attn.qkv.weight": (3 * h, h), q + "attn.qkv.bias": (3 * h,),
                           q + "attn.proj.weight": (h, h), q + "attn.proj.bias": (h,),
                           q + "mlp.linear_fc1.weight": (f, h), q + "mlp.linear_fc1.bias": (f,),
                           q + "mlp.linear_fc2.weight": (h, f), q + "mlp.linear_fc2.bias": (h,)})
        return shapes


class Qwen3VisionEncoder(Qwen25VisionEncoder):
    """Qwen2.5-VL's encoder's weights, rotary frequencies and `auto`-path projections; its own blocks."""

    LINEARS = ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.w[name + ".weight"], self.w[name + ".bias"], NORM_EPS)

    def _merge(self, q: str, x: torch.Tensor, after_shuffle: bool) -> torch.Tensor:
        """[n, hidden] -> [n / merge**2, out hidden]: the norm before or after each merge-block is
        concatenated, then the GELU MLP."""
        width = self.cfg.hidden_size * self.cfg.spatial_merge_size ** 2
        x = self._norm(q + "norm", x.reshape(-1, width)) if after_shuffle else \
            self._norm(q + "norm", x).reshape(-1, width)
        w = self.w
        return F.linear(F.gelu(F.linear(x, w[q + "linear_fc1.weight"], w[q + "linear_fc1.bias"])),
                        w[q + "linear_fc2.weight"], w[q + "linear_fc2.bias"])

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """[grid_h * grid_w, patch dim] patches of one image -> [grid_h * grid_w / merge**2,
        (1 + deepstack) * out hidden]: the merger's vectors, then each DeepStack merger's."""
        cfg, w = self.cfg, self.w
        gh, gw = grid
        x = F.conv3d(patches.float().view(-1, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size,
                                          cfg.patch_size), w["patch_embed.proj.weight"], w["patch_embed.proj.bias"],
                     stride=(cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)).view(-1, cfg.hidden_size)
        n = x.shape[0]
        rc = rotary_positions(gh, gw, cfg.spatial_merge_size)  # [n, 2] (row, col) in the encoder's order
        x = x + position_embeddings(w["pos_embed.weight"], rc, gh, gw)
        freqs = rc[..., None].float() * self.inv_freq  # [n, 2, d/4]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        cos, sin = (torch.cat([f, f], dim=-1)[:, None, :] for f in (freqs.cos(), freqs.sin()))
        heads, head_dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        deepstack = []
        for i in range(cfg.depth):
            q = f"blocks.{i}."
            qs, ks, vs = self._lin(q + "attn.qkv", self._norm(q + "norm1", x)).reshape(n, 3, heads, head_dim).unbind(1)
            qs, ks = qs * cos + _rotate_half(qs) * sin, ks * cos + _rotate_half(ks) * sin  # [n, heads, head_dim]
            out = F.scaled_dot_product_attention(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                                 vs.transpose(0, 1)[None], scale=head_dim ** -0.5)[0].transpose(0, 1)
            x = x + self._lin(q + "attn.proj", out.reshape(n, -1))
            y = self.act(self._lin(q + "mlp.linear_fc1", self._norm(q + "norm2", x)))
            x = x + self._lin(q + "mlp.linear_fc2", y)
            if i in cfg.deepstack_visual_indexes:
                k = cfg.deepstack_visual_indexes.index(i)
                deepstack.append(self._merge(f"deepstack_merger_list.{k}.", x, after_shuffle=True))
        return torch.cat([self._merge("merger.", x, after_shuffle=False), *deepstack], dim=-1)


def position_embeddings(table: torch.Tensor, rc: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
    """[n, hidden]: the square learned table [side * side, hidden] resampled to a gh x gw grid at
    each patch's (row, col), bilinear with the corners aligned (a grid's first and last row and
    column sit on the table's), as the weighted sum of the four nearest entries."""
    side = round(table.shape[0] ** 0.5)

    def taps(index: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        src = index.float() * (side - 1) / max(size - 1, 1)
        lo = src.floor()
        at = lo.long()[:, None] + torch.arange(2)
        weight = (1 - (src[:, None] - lo[:, None] - torch.arange(2)).abs()).clamp(min=0)
        return at.clamp(0, side - 1), weight

    (ri, rw), (ci, cw) = taps(rc[:, 0], gh), taps(rc[:, 1], gw)
    index = (ri[:, :, None] * side + ci[:, None, :]).reshape(-1, 4)
    weight = (rw[:, :, None] * cw[:, None, :]).reshape(-1, 4)
    return (table[index] * weight[..., None]).sum(1)


def is_qwen3_vl_config(hf: Any) -> bool:
    return isinstance(hf, dict) and hf.get("model_type") == "qwen3_vl" and isinstance(hf.get("vision_config"), dict)


def load_qwen3_vl(path: Path, tokenizer) -> Qwen25VLVision:
    """The vision side of a Hugging Face `Qwen3VLForConditionalGeneration` folder: the encoder, the
    image processor (`Qwen2VLImageProcessor` at Qwen3-VL's patch size), the image token; the family
    otherwise behaves as Qwen2.5-VL's (`Qwen25VLVision`)."""
    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    cfg = Qwen3VisionConfig.from_hf(hf.get("vision_config") or {}, f"{path}/config.json")
    return Qwen25VLVision(Qwen3VisionEncoder(cfg, read_visual(path, cfg)), folder_processor(path, cfg),
                          image_token(path, hf, tokenizer))
