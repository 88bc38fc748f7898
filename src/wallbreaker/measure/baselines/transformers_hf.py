"""Hugging Face transformers as a baseline: float32 on the same weights (a GGUF is dequantized on
load), timed through `generate` with a streamer that stamps each token as it comes."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch


def load(path: Path) -> tuple[Any, float]:
    """The model in eval mode and its load time in seconds."""
    from transformers import AutoModelForCausalLM
    start = time.perf_counter()
    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), time.perf_counter() - start


class _Stamps:
    """A `generate` streamer: the first `put` is the prompt, each later one a new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.inference_mode()
def prefill_seconds(model: Any, ids: list[int]) -> float:
    start = time.perf_counter()
    model(torch.tensor([ids]), use_cache=True)
    return time.perf_counter() - start


@torch.inference_mode()
def timed_generate(model: Any, ids: list[int], max_tokens: int) -> dict[str, float]:
    """Greedy, exactly `max_tokens` new tokens, batch 1: TTFT and decode tokens/s."""
    stamps = _Stamps()
    start = time.perf_counter()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                   max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                   streamer=stamps, pad_token_id=pad)
    tokens = stamps.times[1:]
    decode = (len(tokens) - 1) / (tokens[-1] - tokens[0]) if len(tokens) > 1 else 0.0
    return {"ttft_s": tokens[0] - start if tokens else 0.0, "decode_tokens_per_s": decode,
            "generated": len(tokens)}


def weight_bytes(model: Any) -> int:
    """Bytes of the float32 parameters (a tied table counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
