"""Pooling: what a model's pooled output is (`PoolingConfig`, read from its files) and what one
request asks of it (`PoolingParams`, vLLM's name). A pooling request is a prompt run once, with no
token generated: its hidden states are pooled into one vector (an embedding) or into a classifier's
logits (a cross-encoder's relevance score)."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidRequestError

POOLING_METHODS = ("mean", "cls", "last")
POOLING_TASKS = ("embed", "score")


@dataclass(frozen=True)
class PoolingConfig:
    """How the model pools. `method`: mean over the tokens, the first ([CLS]) token, or the last
    (decoder embedding models). `normalize`: embeddings come out with unit L2 norm (sentence-
    transformers' `Normalize` module). `task`: "embed" (the pooled hidden state is the embedding)
    or "score" (a classifier head on it gives `num_labels` logits: a cross-encoder). `yes_no_ids`:
    a decoder reranker (Qwen3-Reranker) whose score is P(yes) from the LM head's logits of
    the two tokens (no, yes) at the last position."""

    method: str
    normalize: bool = False
    task: str = "embed"
    yes_no_ids: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.method not in POOLING_METHODS:
            raise ValueError(f"pooling method must be one of {', '.join(POOLING_METHODS)}, got {self.method!r}")
        if self.task not in POOLING_TASKS:
            raise ValueError(f"pooling task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")


@dataclass(frozen=True)
class PoolingParams:
    """One pooling request. `task` must be the model's. `dimensions`: keep the first this many
    values of the embedding (Matryoshka), normalized again where the model normalizes.
    `normalize`: None follows the model."""

    task: str = "embed"
    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise InvalidRequestError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise InvalidRequestError(f"dimensions must be a positive integer, got {self.dimensions!r}",
                                      param="dimensions")
