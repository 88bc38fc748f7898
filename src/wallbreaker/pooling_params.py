"""What one pooling request asks (`PoolingParams`, vLLM's name; the model's side is
`config.PoolingConfig`). A pooling request is a prompt run once, with no
token generated: its hidden states are pooled into one vector (an embedding) or into a classifier's
logits (a cross-encoder's relevance score)."""
from __future__ import annotations

from dataclasses import dataclass

from .config import POOLING_TASKS
from .errors import InvalidRequestError


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
