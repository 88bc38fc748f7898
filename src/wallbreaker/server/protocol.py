"""OpenAI request bodies, as pydantic models.

Types are strict (`"max_tokens": "5"` is a 400, as with OpenAI). Ranges that `SamplingParams`
already checks are left to it; these models check only what it cannot see: the shape of prompts
and messages, and the bounds of fields it does not have.

A field these models do not know is kept aside (`model_extra`), then ignored and logged once
(server/ignored.py): clients add fields with every release. A known field that cannot be honoured
is a 400 naming it, raised where it is read.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler, WrapValidator
from pydantic_core import PydanticCustomError

from .ignored import Lenient

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


_Body = Lenient  # fields it does not declare are ignored and logged once (server/ignored.py)


class _Closed(BaseModel):
    """A nested object whose every field we read: an unknown one is a validation error naming it."""

    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Body):
    include_usage: bool | None = False


class JsonSchemaFormat(_Closed):
    name: str | None = None
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Closed):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Closed):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = False


class LlamaCppSamplerFields(_Body):
    """llama.cpp's samplers, by its names (vLLM has none of them); `mirostat_mode` is also accepted.
    Read by `request_params.llama_cpp_sampler_fields`."""

    repeat_last_n: int | None = None
    typical_p: float | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[str] | None = None
    mirostat: int | None = None
    mirostat_mode: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None


class _SamplingFields(LlamaCppSamplerFields):
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
    cache_salt: str | None = None
    # constraints: OpenAI's, then vLLM's (and its older guided_* names)
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    allowed_token_ids: TokenIds | None = None
    bad_words: list[str] | None = None

    @property
    def include_usage(self) -> bool:
        """A streamed answer ends with a chunk of token counts (`stream_options.include_usage`)."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageUrl(_Body):
    url: str  # a data URL (data:image/png;base64,...): the server fetches nothing
    detail: Literal["auto", "low", "high"] | None = None  # accepted; Gemma 3 sees every image at one size


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageUrl


Content = Annotated[str | list[TextPart | ImagePart],
                    _one_of("a string or a list of {\"type\": \"text\", \"text\": ...} and "
                            "{\"type\": \"image_url\", \"image_url\": {\"url\": ...}} parts")]


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """A message; fields beyond these pass through to the template."""

    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer names the call it answers

    def for_template(self) -> dict:
        """The message as chat templates read it (transformers' convention): text content, and each
        tool call's arguments as an object, not JSON text."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list) and any(isinstance(part, ImagePart) for part in self.content):
            message["content"] = [{"type": "text", "text": part.text} if isinstance(part, TextPart) else
                                  {"type": "image_url", "image_url": {"url": part.image_url.url}}
                                  for part in self.content]  # the images are read in server/prompts.py
        elif isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        message.setdefault("content", "")
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                              "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls]
        return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDefinition(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Annotated[Literal["none", "auto", "required"] | NamedToolChoice,
                       _one_of('"none", "auto", "required" or {"type": "function", "function": {"name": ...}}')]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the template (enable_thinking)


# -- POST /tokenize, POST /detokenize (vLLM's) -------------------------------------------------
class TokenizeCompletionRequest(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Body):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool | None = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds
