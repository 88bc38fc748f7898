"""What the engine carries for each image of a prompt: where its soft tokens sit, its pixels, and the
digest of those pixels that keys the prefix cache and the encoder's cache."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class ImageInput:
    offset: int  # position of the image's first soft token in the prompt
    length: int  # its soft tokens: one run, encoded together
    digest: bytes  # SHA-256 of the pixel tensor (shape and bytes)
    pixels: torch.Tensor = field(repr=False)  # [3, H, W] float32, the processor's output
    bidirectional: bool = True  # its soft tokens attend to each other both ways (Gemma 3); else causally (SmolVLM)
    tile: int = 0  # which tile of its image this is (SmolVLM splits an image into tiles, one run each)
    grid: tuple[int, int] | None = None  # M-RoPE (Qwen2.5-VL): its tokens as rows x cols; None: plain positions

    @property
    def end(self) -> int:
        return self.offset + self.length


def pixel_digest(pixels: torch.Tensor) -> bytes:
    digest = hashlib.sha256(b"image:" + repr((tuple(pixels.shape), str(pixels.dtype))).encode())
    digest.update(pixels.contiguous().numpy().tobytes())
    return digest.digest()


def rope_table(images: tuple[ImageInput, ...], num_prompt: int) -> tuple[torch.Tensor, int] | None:
    """The [3, num_prompt] M-RoPE positions (temporal, row, column) of a prompt that holds `images`, and
    the offset of the tokens after it; None where no image has a grid (plain positions)."""
    if not images or images[0].grid is None:
        return None
    from .qwen2_5_vl import mrope_positions
    return mrope_positions(num_prompt, [(im.offset, *im.grid) for im in images], 1)


def rope_positions(table: tuple[torch.Tensor, int], num_prompt: int, start: int, end: int) -> torch.Tensor:
    """[3, end - start] M-RoPE positions of tokens start..end, from the prompt's `rope_table`: tokens past
    the prompt take their index plus the prompt's offset, thrice."""
    table, delta = table
    tail = torch.arange(max(start, num_prompt), max(end, num_prompt)).expand(3, -1) + delta
    return torch.cat([table[:, start:min(end, num_prompt)], tail], dim=1)


def fit_chunk(images: tuple[ImageInput, ...], start: int, num_new: int) -> int:
    """How many tokens from `start` a step may compute, at most `num_new` unless an image forces more:
    a chunk never ends inside a bidirectional image's block of soft tokens that it began (each needs
    all the others; a causal one may be split anywhere), so it stops before the block, or where the chunk
    starts inside it, runs to its end."""
    end = start + num_new
    for image in images:
        if image.bidirectional and image.offset < end < image.end:
            return image.offset - start if image.offset > start else image.end - start
    return num_new
