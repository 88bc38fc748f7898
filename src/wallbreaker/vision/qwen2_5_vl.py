"""Qwen2.5-VL's vision encoder (transformers' `Qwen2_5_VisionTransformerPretrainedModel`): patches
(qwen2_vl_preprocess.py) embedded by a 3D convolution over [time, row, col], 2D rotary positions
(the patch's row on the first half of each head's rotated pairs, its column on the second), RMSNorm
blocks with a SwiGLU MLP, attention within windows of `window_size` pixels except in the
`fullatt_block_indexes` blocks (over the whole image), then the merger: RMSNorm, each
merge_size x merge_size block of patches concatenated, a GELU MLP to the decoder's width.

Windows: the image's merge-blocks are reordered window by window (windows row by row, blocks row
by row within a window; the last row and column of windows may be partial), every block keeps its
merge_size**2 patches together, and the output is put back in the image's block order.

`mrope_positions` gives the decoder's 3D (M-RoPE) positions of a prompt with images, as
transformers' `get_rope_index` (the engine's sequences take them through vision/inputs.py
`rope_positions`, the decoder's rotary embedding is layers/rotary.py `MRotaryEmbedding`).
`Qwen25VLVision` is the family as vision/prompt.py and the runner use it."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelFormatError, UnsupportedModelError
from .gemma3 import _check
from .qwen2_vl_preprocess import Qwen2VLImageProcessor

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu": F.gelu, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
NORM_EPS = 1e-6  # transformers' Qwen2_5_VLRMSNorm in the blocks and the merger


@dataclass(frozen=True)
class Qwen25VisionConfig:
    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, hf: dict[str, Any], where: str) -> "Qwen25VisionConfig":
        rope = hf.get("rope_parameters") or {}
        try:
            cfg = cls(**{k: hf[k] for k in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels",
                                            "patch_size", "spatial_merge_size", "temporal_patch_size", "window_size",
                                            "out_hidden_size", "hidden_act") if k in hf},
                      fullatt_block_indexes=tuple(int(i) for i in hf.get("fullatt_block_indexes", (7, 15, 23, 31))),
                      rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))))
        except (TypeError, ValueError) as e:
            raise ModelFormatError(f"{where}: vision_config: {e}") from None
        if rope.get("rope_type", "axial") != "axial":
            raise UnsupportedModelError(f"{where}: vision_config rope_type {rope.get('rope_type')!r} is not supported")
        if cfg.hidden_act not in _ACTIVATIONS:
            raise UnsupportedModelError(f"{where}: vision_config.hidden_act {cfg.hidden_act!r} is not supported")
        if cfg.hidden_size % cfg.num_heads or (cfg.hidden_size // cfg.num_heads) % 4 or \
                cfg.window_size % (cfg.patch_size * cfg.spatial_merge_size):
            raise ModelFormatError(f"{where}: vision_config: inconsistent sizes {cfg}")
        return cfg

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the encoder reads (transformers' names under `visual.`)."""
        h, f, m2 = self.hidden_size, self.intermediate_size, self.hidden_size * self.spatial_merge_size ** 2
        shapes: dict[str, tuple[int, ...]] = {
            "patch_embed.proj.weight": (h, self.in_channels, self.temporal_patch_size, self.patch_size, self.patch_size),
            "merger.ln_q.weight": (h,), "merger.mlp.0.weight": (m2, m2), "merger.mlp.0.bias": (m2,),
            "merger.mlp.2.weight": (self.out_hidden_size, m2), "merger.mlp.2.bias": (self.out_hidden_size,)}
        for i in range(self.depth):
            q = f"blocks.{i}."
            shapes.update({q + "norm1.weight": (h,), q + "norm2.weight": (h,),
                           q + "attn.qkv.weight": (3 * h, h), q + "attn.qkv.bias": (3 * h,),
                           q + "attn.proj.weight": (h, h), q + "attn.proj.bias": (h,),
                           q + "mlp.gate_proj.weight": (f, h), q + "mlp.gate_proj.bias": (f,),
                           q + "mlp.up_proj.weight": (f, h), q + "mlp.up_proj.bias": (f,),
                           q + "mlp.down_proj.weight": (h, f), q + "mlp.down_proj.bias": (h,)})
        return shapes


class Qwen25VisionEncoder(nn.Module):
    def __init__(self, cfg: Qwen25VisionConfig, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        self.w = {name: t.float().contiguous() for name, t in tensors.items()}
        self.act = _ACTIVATIONS[cfg.hidden_act]
        spatial = cfg.hidden_size // cfg.num_heads // 2
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.linears: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}  # `use_linears`; else F.linear

    LINEARS = ("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

    def use_linears(self, make: Callable[[torch.Tensor, torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]) -> None:
        """Run the blocks' projections through `make(weight, bias)`'s modules (the `auto` path)."""
        for i in range(self.cfg.depth):
            for proj in self.LINEARS:
                name = f"blocks.{i}.{proj}"
                self.linears[name] = make(self.w.pop(name + ".weight"), self.w.pop(name + ".bias"))

    def _lin(self, name: str, x: torch.Tensor) -> torch.Tensor:
        module = self.linears.get(name)
        if module is not None:
            return module(x).float()
        return F.linear(x, self.w[name + ".weight"], self.w[name + ".bias"])

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """[grid_h * grid_w, patch dim] patches of one image -> [grid_h * grid_w / merge**2, out hidden]."""
        cfg, w = self.cfg, self.w
        gh, gw = grid
        unit = cfg.spatial_merge_size ** 2
        x = F.conv3d(patches.float().view(-1, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size,
                                          cfg.patch_size), w["patch_embed.proj.weight"],
                     stride=(cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)).view(-1, cfg.hidden_size)
        n = x.shape[0]
        order, windows = window_order(gh // cfg.spatial_merge_size, gw // cfg.spatial_merge_size,
                                      cfg.window_size // cfg.spatial_merge_size // cfg.patch_size)

        def by_window(t: torch.Tensor) -> torch.Tensor:  # [n, ...] in block order -> window order
            return t.reshape(n // unit, unit, -1)[order].reshape(n, -1)

        x = by_window(x)
        freqs = rotary_positions(gh, gw, cfg.spatial_merge_size)[..., None].float() * self.inv_freq  # [n, 2, d/4]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        cos, sin = (by_window(torch.cat([f, f], dim=-1))[:, None, :] for f in (freqs.cos(), freqs.sin()))
        whole = [n]
        heads, head_dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        for i in range(cfg.depth):
            q = f"blocks.{i}."
            y = _rms(x, w[q + "norm1.weight"])
            qkv = self._lin(q + "attn.qkv", y).reshape(n, 3, heads, head_dim)
            qs, ks, vs = qkv.unbind(1)  # [n, heads, head_dim]
            qs, ks = qs * cos + _rotate_half(qs) * sin, ks * cos + _rotate_half(ks) * sin
            lengths = whole if i in cfg.fullatt_block_indexes else [length * unit for length in windows]
            out = [F.scaled_dot_product_attention(a.transpose(0, 1)[None], b.transpose(0, 1)[None],
                                                  c.transpose(0, 1)[None], scale=head_dim ** -0.5)[0].transpose(0, 1)
                   for a, b, c in zip(qs.split(lengths), ks.split(lengths), vs.split(lengths))]
            x = x + self._lin(q + "attn.proj", torch.cat(out).reshape(n, -1))
            y = _rms(x, w[q + "norm2.weight"])
            x = x + self._lin(q + "mlp.down_proj", self.act(self._lin(q + "mlp.gate_proj", y)) * self._lin(q + "mlp.up_proj", y))
        x = _rms(x, w["merger.ln_q.weight"]).view(n // unit, -1)
        x = F.linear(F.gelu(F.linear(x, w["merger.mlp.0.weight"], w["merger.mlp.0.bias"])),
                     w["merger.mlp.2.weight"], w["merger.mlp.2.bias"])
        return x[torch.argsort(order)]


# where checkpoints keep the encoder: transformers 5 saves `model.visual.*`, Qwen's releases `visual.*`
_PREFIXES = ("model.visual.", "visual.")


def read_visual(path: Path, cfg) -> dict[str, torch.Tensor]:
    """A folder's encoder tensors (under `visual.`), checked against `cfg.tensor_shapes()`."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                prefix = next((p for p in _PREFIXES if name.startswith(p)), None)
                if prefix is not None:
                    tensors[name[len(prefix):]] = f.get_tensor(name)
    _check(str(path), "vision encoder", tensors, cfg.tensor_shapes())
    return tensors


def folder_processor(path: Path, cfg) -> Qwen2VLImageProcessor:
    """A folder's image processor, checked to cut the patches the encoder `cfg` reads."""
    processor = Qwen2VLImageProcessor.from_folder(path)
    if (processor.patch_size, processor.merge_size, processor.temporal_patch_size) != \
            (cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size):
        raise ModelFormatError(f"{path}: the image processor's patch, merge and temporal sizes are not the encoder's")
    return processor


def image_token(path: Path, hf: dict[str, Any], tokenizer) -> int:
    """config.json's image_token_id, checked to be the tokenizer's <|image_pad|>."""
    image_id = hf.get("image_token_id")
    if tokenizer.token_to_id(IMAGE_PAD) != image_id:
        raise ModelFormatError(f"{path}/config.json: image_token_id {image_id!r} is not the tokenizer's {IMAGE_PAD}")
    return image_id


def load_folder(path: Path) -> tuple[Qwen25VisionEncoder, Qwen2VLImageProcessor]:
    """The vision encoder and the image processor of a Hugging Face `Qwen2_5_VLForConditionalGeneration`
    folder."""
    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    cfg = Qwen25VisionConfig.from_hf(hf.get("vision_config") or {}, f"{path}/config.json")
    return Qwen25VisionEncoder(cfg, read_visual(path, cfg)), folder_processor(path, cfg)


def mrope_positions(length: int, images: list[tuple[int, int, int]], merge: int) -> tuple[torch.Tensor, int]:
    """[3, length] (temporal, row, column) positions of a prompt whose images are `images`: (offset of
    the first `<|image_pad|>` token, grid_h, grid_w) in patches, in order; and the offset that the
    positions of the tokens after the prompt take (`mrope_position_deltas`). Text tokens take the
    same position thrice, one more than the last; an image's tokens start at the next position and
    add their block's row and column, and the text after it resumes past its larger side."""
    parts, pos, at = [], 0, 0
    for offset, gh, gw in images:
        rows, cols = gh // merge, gw // merge
        if offset < at or offset + rows * cols > length:
            raise ValueError("images must lie within the prompt, in order")
        parts.append(torch.arange(offset - at).expand(3, -1) + pos)
        pos += offset - at
        r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        parts.append(torch.stack([torch.zeros(rows * cols, dtype=torch.long), r.flatten(), c.flatten()]) + pos)
        pos += max(rows, cols)
        at = offset + rows * cols
    parts.append(torch.arange(length - at).expand(3, -1) + pos)
    positions = torch.cat(parts, dim=1)
    return positions, int(positions.max()) + 1 - length


IMAGE_PAD = "<|image_pad|>"


def is_qwen2_5_vl_config(hf: Any) -> bool:
    return isinstance(hf, dict) and hf.get("model_type") == "qwen2_5_vl" and isinstance(hf.get("vision_config"), dict)


class Qwen25VLVision(nn.Module):
    """Qwen2.5-VL's vision side as the engine asks it of a family (vision/prompt.py): the chat template
    writes `<|vision_start|><|image_pad|><|vision_end|>` for an image, the processor repeats the pad
    once per merged block; an image's pixels are its resized, normalized [3, H, W] (patched at encode
    time), its grid gives the decoder's M-RoPE positions, and attention over it is causal."""

    marker = IMAGE_PAD
    bidirectional = False

    def __init__(self, encoder: Qwen25VisionEncoder, processor: Qwen2VLImageProcessor, image_id: int):
        super().__init__()
        self.tower = encoder
        self.processor = processor
        self.image_id = image_id
        self.unit = processor.patch_size * processor.merge_size  # pixels of a merged block's side

    @property
    def hidden_size(self) -> int:
        return self.tower.cfg.out_hidden_size

    def grid_of(self, pixels: torch.Tensor) -> tuple[int, int]:
        """(rows, cols) of merged blocks: the image's tokens."""
        return pixels.shape[-2] // self.unit, pixels.shape[-1] // self.unit

    def tokens_of(self, pixels: torch.Tensor) -> int:
        rows, cols = self.grid_of(pixels)
        return rows * cols

    def expand(self, image) -> tuple[str, list[torch.Tensor]]:
        pixels = self.processor.normalized(image)
        return IMAGE_PAD * self.tokens_of(pixels), [pixels]

    @torch.inference_mode()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, tokens, text hidden]."""
        return torch.stack([self.tower(*self.processor.patchify(x)) for x in pixels])

    @classmethod
    def from_folder(cls, path: Path, tokenizer) -> "Qwen25VLVision":
        encoder, processor = load_folder(path)
        hf = json.loads((Path(path) / "config.json").read_text())
        return cls(encoder, processor, image_token(path, hf, tokenizer))


def window_order(rows: int, cols: int, size: int) -> tuple[torch.Tensor, list[int]]:
    """The image's merge-blocks ([rows, cols], numbered row by row) in window order, and how many
    blocks each window holds: windows of size x size blocks row by row, the last ones partial."""
    index = torch.arange(rows * cols).reshape(rows, cols)
    order, lengths = [], []
    for r in range(0, rows, size):
        for c in range(0, cols, size):
            window = index[r:r + size, c:c + size].reshape(-1)
            order.append(window)
            lengths.append(window.numel())
    return torch.cat(order), lengths


def rotary_positions(gh: int, gw: int, merge: int) -> torch.Tensor:
    """[gh * gw, 2] (row, col) of each patch in the encoder's order (merge-blocks row by row, the
    patches of a block row by row)."""
    rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    shape = (gh // merge, merge, gw // merge, merge)
    return torch.stack([rows.reshape(shape).transpose(1, 2).flatten(), cols.reshape(shape).transpose(1, 2).flatten()],
                       dim=-1)


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
