"""Perplexity over a text file, computed the way llama.cpp's `llama-perplexity` computes it.

The text is tokenized once (with BOS if the model adds one) and cut into non-overlapping windows of
`ctx` tokens; each window is evaluated on its own, its first token replaced by BOS where the model
adds one. By default (`score="half"`) only the second half of each window is scored: positions j in
[ctx/2, ctx − 1) predicting token j + 1, so every scored token has at least ctx/2 tokens of context.
`score="all"` scores every token of a window after its first. The ± is llama.cpp's estimate of the
standard error: PPL · sqrt((E[nll²] − E[nll]²) / (n − 1)).
"""
from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from ..errors import InvalidRequestError

SCORES = ("half", "all")


@dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    stderr: float  # of the PPL
    nll: float  # mean negative log-likelihood (nats per token)
    tokens_scored: int
    windows: int
    ctx: int
    score: str

    def line(self) -> str:
        return f"PPL = {self.ppl:.4f} +/- {self.stderr:.5f}"

    def to_dict(self) -> dict:
        return asdict(self)


def token_windows(ids: list[int], ctx: int, chunks: int | None, bos: int | None) -> list[list[int]]:
    """Non-overlapping windows of `ctx` tokens (a last partial window is dropped), each starting with
    `bos` when given."""
    n = len(ids) // ctx
    if chunks is not None:
        n = min(n, chunks)
    windows = []
    for i in range(n):
        w = ids[i * ctx:(i + 1) * ctx]
        if bos is not None:
            w[0] = bos
        windows.append(w)
    return windows


def window_nll(logits: torch.Tensor, tokens: list[int], score: str) -> torch.Tensor:
    """logits [ctx, vocab] of one window -> float64 negative log-likelihoods of its scored tokens."""
    ctx = len(tokens)
    first = ctx // 2 if score == "half" else 0
    rows = logits[first:ctx - 1].double()  # row j predicts token j + 1
    targets = torch.tensor(tokens[first + 1:ctx])
    return -torch.log_softmax(rows, dim=-1).gather(1, targets[:, None]).squeeze(1)


def perplexity(llm, text: str, ctx: int = 512, chunks: int | None = None, score: str = "half",
               progress: bool = True) -> PerplexityResult:
    if score not in SCORES:
        raise InvalidRequestError(f"score must be one of {', '.join(SCORES)}; got {score!r}")
    if ctx < 4:
        raise InvalidRequestError("ctx must be at least 4")
    if chunks is not None and chunks < 1:
        raise InvalidRequestError("chunks must be at least 1")
    tok = llm.tokenizer
    ids = tok.encode(text)
    windows = token_windows(ids, ctx, chunks, tok.bos_token_id if tok.add_bos else None)
    if not windows:
        raise InvalidRequestError(f"the text has {len(ids)} tokens, fewer than one window of {ctx}")
    nll_sum = nll2_sum = 0.0
    count = 0
    bar = tqdm(windows, desc="perplexity", unit="window", file=sys.stderr, disable=not progress)
    for w in bar:
        nll = window_nll(llm.logits(w), w, score)
        nll_sum += nll.sum().item()
        nll2_sum += nll.pow(2).sum().item()
        count += nll.numel()
        bar.set_postfix(ppl=f"{math.exp(nll_sum / count):.4f}")
    mean = nll_sum / count
    var = nll2_sum / count - mean * mean
    ppl = math.exp(mean)
    stderr = ppl * math.sqrt(var / (count - 1)) if var > 0 and count > 1 else 0.0
    return PerplexityResult(ppl, stderr, mean, count, len(windows), ctx, score)
