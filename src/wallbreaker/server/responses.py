"""OpenAI response bodies and stream chunks, as pydantic models."""
from __future__ import annotations

import time
from typing import Generic, Literal, TypeVar

from pydantic import BaseModel, Field, model_serializer


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens the prefix cache served


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> "Usage":
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def cached_tokens(output) -> int:
    """The prompt tokens of an engine request's output that the prefix cache served."""
    return output.metrics.get("num_cached_prompt_tokens", 0)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "wallbreaker"
    max_model_len: int | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- what every answer and choice carries -------------------------------------------------------
Choice = TypeVar("Choice")


class _Answer(BaseModel, Generic[Choice]):
    """What every answer, and every chunk of a streamed one, carries: its kind (`object`) and choices."""

    id: str
    object: str
    created: int = Field(default_factory=_now)
    model: str
    choices: list[Choice]
    usage: Usage | None = None  # a stream's chunks carry it only in the last, when asked


class _Choice(BaseModel):
    index: int
    finish_reason: str | None = None


# -- completions -------------------------------------------------------------------------------
class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(_Answer[CompletionChoice]):
    """POST /v1/completions: the answer, and each chunk of a streamed one."""

    object: Literal["text_completion"] = "text_completion"


# -- chat --------------------------------------------------------------------------------------
class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking (server/reasoning.py), vLLM's name

    @model_serializer
    def _present_fields(self) -> dict:
        """`tool_calls` only when there are some, as OpenAI sends it; `reasoning_content` likewise."""
        out: dict = {"role": self.role, "content": self.content}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class ChatChoice(_Choice):
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionResponse(_Answer[ChatChoice]):
    """POST /v1/chat/completions, not streamed: its usage is always there."""

    object: Literal["chat.completion"] = "chat.completion"
    usage: Usage


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer
    def _present_fields(self) -> dict:
        return {k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None}


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: its first carries id, type and name; later ones add arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer
    def _present_fields(self) -> dict:
        out: dict = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
        if self.type is not None:
            out["type"] = self.type
        out["function"] = self.function.model_dump()
        return out


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None

    @model_serializer
    def _present_fields(self) -> dict:
        """OpenAI's deltas leave absent fields out rather than sending nulls (the last one is `{}`)."""
        out = {k: v for k, v in (("role", self.role), ("content", self.content),
                                 ("reasoning_content", self.reasoning_content)) if v is not None}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class ChatStreamChoice(_Choice):
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Answer[ChatStreamChoice]):
    """One event of a streamed chat completion."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


# -- /tokenize, /detokenize (vLLM's shapes) ----------------------------------------------------
class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
