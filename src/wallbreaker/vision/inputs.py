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

    @property
    def end(self) -> int:
        return self.offset + self.length


def pixel_digest(pixels: torch.Tensor) -> bytes:
    digest = hashlib.sha256(b"image:" + repr((tuple(pixels.shape), str(pixels.dtype))).encode())
    digest.update(pixels.contiguous().numpy().tobytes())
    return digest.digest()


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
