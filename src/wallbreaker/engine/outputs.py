"""What the engine hands back, shaped like vLLM's outputs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    cumulative_logprob: float = 0.0
    logprobs: list[float] | None = None  # the chosen token's logprob, per token (when asked)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it; None for EOS


@dataclass
class StepFailure:
    """A model step failed on this request's sequence alone: the error, and the id that names it in
    the log (clients are told the id, never the error text)."""

    error_id: str
    error: Exception


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, Any] = field(default_factory=dict)
    failure: StepFailure | None = None  # set where a model step failed on this request
    pooled: Any = None  # a pooling request's float32 torch.Tensor: its pooled hidden state or a classifier's logits


@dataclass
class StreamDelta:
    """New output of one sequence in one engine step (for streaming)."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str | None
    output: RequestOutput | None = None  # on a stream's last delta (`LLM.stream`): the whole output, metrics too
