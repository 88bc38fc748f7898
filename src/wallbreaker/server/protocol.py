"""OpenAI request bodies, as pydantic models.

Types are strict (`"max_tokens": "5"` is a 400, as with OpenAI) and unknown fields are ignored.
Ranges that `SamplingParams` already checks are left to it; these models check only what it
cannot see: the shape of prompts and messages, and the bounds of fields it does not have.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler, WrapValidator
from pydantic_core import PydanticCustomError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 128  # OpenAI's bound on `n`

Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX - MAX_N)]  # seed + index must fit a torch seed
TokenIds = list[Annotated[int, Field(ge=0, le=INT64_MAX)]]


def _one_of(description: str) -> WrapValidator:
    """One error naming what a union field takes, instead of one error a member of the union."""
    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("union_type", f"must be {description}") from None
    return WrapValidator(validate)


Prompt = Annotated[str | list[str] | TokenIds | list[TokenIds],
                   _one_of("a string, a list of strings, a list of token ids (ints >= 0), or a list of such lists")]
Stop = Annotated[str | list[str], _one_of("a string or a list of strings")]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool | None = False


class _SamplingFields(_Body):
    """The fields shared by completions and chat, OpenAI's and vLLM's extras."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: Stop | None = None
    seed: Seed | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool | None = False

    @property
    def include_usage(self) -> bool:
        """A streamed answer ends with a chunk of token counts (`stream_options.include_usage`)."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


Content = Annotated[str | list[TextPart], _one_of("a string or a list of {\"type\": \"text\", \"text\": ...} parts")]


class ChatMessage(BaseModel):
    """A message; fields beyond role, content and name (tool calls, ...) pass through to the template."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: Content | None = None
    name: str | None = None

    def for_template(self) -> dict:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        message.setdefault("content", "")
        return message


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
