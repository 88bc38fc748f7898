"""What the translated APIs (Anthropic's Messages, Ollama's, OpenAI's Responses) share: each builds
the request the chat or completion handling takes, runs it there, and writes the answer in its own
shape. Nothing here generates: these are the seams between a foreign shape and ours."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import ValidationError

from .errors import APIError, validation_error
from .protocol import ChatCompletionRequest, CompletionRequest


def chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request a translated one stands for; what it cannot hold is a 400, never a 500."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


def completion_request(fields: dict[str, Any]) -> CompletionRequest:
    try:
        return CompletionRequest.model_validate(fields)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


@contextmanager
def renamed_params(names: dict[str, str]) -> Iterator[None]:
    """An error about a chat field (`param`) raised inside names the translated API's field instead:
    `response_format` is Ollama's `format`, the Responses API's `text.format`."""
    try:
        yield
    except APIError as e:
        new = names.get(e.info.param or "")
        if new is not None:
            old = e.info.param
            e.info.param = new
            e.info.message = e.info.message.replace(old, new, 1)
        raise


def delta_pieces(delta: Any) -> Iterator[tuple[str, str, str | None]]:
    """A streamed chat delta as the pieces the other APIs stream, in order: ("reasoning", text),
    ("text", text), ("call", name, call id) where a tool call starts, ("arguments", text)."""
    reasoning = reasoning_of(delta)
    if reasoning:
        yield "reasoning", reasoning, None
    if delta.content:
        yield "text", delta.content, None
    for call in delta.tool_calls or ():
        if call.id is not None:
            yield "call", call.function.name or "", call.id
        if call.function.arguments:
            yield "arguments", call.function.arguments, None


def reasoning_of(message: Any) -> str | None:
    """The reasoning the chat answer (or a chunk's delta) carries apart from its content, where the
    model's reasoning is parsed out (`reasoning_content`); None where it is not."""
    return getattr(message, "reasoning_content", None) or None
