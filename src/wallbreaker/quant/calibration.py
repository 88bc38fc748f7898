"""Calibration data and what the methods learn from it: the inputs each Linear sees.

`calibration_sequences` cuts a fixed number of fixed-length token windows out of a text at seeded
random offsets (GPTQ's recipe). `InputStats` accumulates, from forward pre-hooks on Linear modules,
the Hessian proxy H = 2/n · Σ x xᵀ (GPTQ; half of it is the Gram matrix AWQ measures output errors
with) and the mean magnitude of each input channel (AWQ's scales).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from ..errors import InvalidRequestError
from ..text.tokenizer import Tokenizer

# The repository's `../shared/data` (next to the project root), where WikiText-2 lives.
_REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_CALIBRATION_FILE = _REPO_ROOT.parent / "shared" / "data" / "wikitext-2" / "valid.txt"


def calibration_sequences(tokenizer: Tokenizer, text: str, nsamples: int, seqlen: int, seed: int) -> torch.Tensor:
    """[nsamples, seqlen] token ids: windows of the tokenized text at seeded random offsets. Each
    window starts with BOS where the model adds one, as perplexity windows do."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= seqlen:
        raise InvalidRequestError(f"calibration text has {len(ids)} tokens; need more than seqlen={seqlen}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seqlen, (nsamples,), generator=gen).tolist()
    seqs = torch.tensor([ids[s:s + seqlen] for s in starts], dtype=torch.long)
    if tokenizer.add_bos:
        seqs[:, 0] = tokenizer.bos_token_id
    return seqs


def read_calibration_text(path: str | Path | None) -> str:
    path = Path(path) if path is not None else DEFAULT_CALIBRATION_FILE
    if not path.is_file():
        raise InvalidRequestError(f"calibration file {path} not found (give one with --calib)")
    return path.read_text(encoding="utf-8")


class InputStats:
    """Running statistics of one Linear's input rows x [in]."""

    def __init__(self, in_features: int, hessian: bool = True):
        self.n = 0
        self.hessian = torch.zeros(in_features, in_features) if hessian else None  # [in, in]
        self.abs_sum = torch.zeros(in_features, dtype=torch.float64)  # [in]

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()  # [T, in]
        t = x.shape[0]
        if self.hessian is not None:
            # H = 2/n Σ x xᵀ as a running mean (the reference GPTQ accumulation)
            self.hessian.mul_(self.n / (self.n + t))
            xs = x * (2.0 / (self.n + t)) ** 0.5
            self.hessian.addmm_(xs.T, xs)
        self.abs_sum += x.abs().sum(0, dtype=torch.float64)
        self.n += t

    @property
    def mean_abs(self) -> torch.Tensor:
        """[in] mean |x| per input channel."""
        return (self.abs_sum / max(self.n, 1)).float()

    @property
    def gram(self) -> torch.Tensor:
        """[in, in] XᵀX / n."""
        assert self.hessian is not None
        return self.hessian / 2


@contextlib.contextmanager
def capture_inputs(modules: dict[str, nn.Module], stats: dict[str, InputStats]) -> Iterator[None]:
    """Feed every input of `modules[name]` to `stats[name]` while the block runs."""
    handles = [modules[name].register_forward_pre_hook(lambda m, args, s=s: s.add(args[0]))
               for name, s in stats.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
