"""Prompts in: completions' strings or token ids (one or a batch), chat's messages; all checked
against the context before anything reaches the engine, text by its length before it is tokenized.
A `max_tokens` past what the context leaves is clamped to it (`within_context`), as llama-server
and Ollama do: the answer then stops at the context's end with the API's length stop reason."""
from __future__ import annotations

from typing import TYPE_CHECKING

import dataclasses
import json

from ..errors import InvalidRequestError
from ..text.fim import ExtraFile, FimTokens
from ..llm import as_prompt_list
from ..sampling_params import SamplingParams
from .errors import bad_request
from .protocol import ChatMessage
from .tools import ToolPlan, template_messages

if TYPE_CHECKING:
    from .state import ServerState

Encoded = tuple[str | None, list[int]]


def completion_prompts(state: ServerState, prompt: str | list) -> list[Encoded]:
    """A string, a list of token ids, or a batch (list) of either -> one (text, token ids) a prompt."""
    prompts = as_prompt_list(prompt)
    if not prompts:
        raise bad_request("the prompt is empty", param="prompt")
    encoded = []
    for p in prompts:
        if isinstance(p, str):
            _check_chars(state, len(p), "prompt")
        try:
            text, ids = state.llm.encode(p)
        except InvalidRequestError as e:
            raise bad_request(str(e), param="prompt") from e
        encoded.append((text, _checked(state, ids, "prompt")))
    return encoded


# Variables the template gets from the server itself: a request's chat_template_kwargs may not set them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                                         "bos_token", "eos_token"})


def fim_prompts(state: ServerState, prompt: str | list, suffix: str) -> list[Encoded]:
    """Completions' prompts as the prefixes of fill-in-the-middle prompts (text/fim.py) before
    `suffix`; a 400 naming `suffix` for a model without FIM tokens."""
    fim = fim_tokens(state, "suffix")
    prompts = as_prompt_list(prompt)
    if not prompts:
        raise bad_request("the prompt is empty", param="prompt")
    _check_chars(state, len(suffix), "suffix")
    encoded = []
    for p in prompts:
        if isinstance(p, str):
            _check_chars(state, len(p), "prompt")
        elif not (isinstance(p, list) and all(isinstance(t, int) for t in p)):
            raise bad_request("with suffix, a prompt is a string or a list of token ids", param="prompt")
        ids = fim.prompt(state.llm.tokenizer, p, suffix)
        encoded.append((p if isinstance(p, str) else None, _checked(state, ids, "prompt")))
    return encoded


def infill_prompt(state: ServerState, prefix: str, suffix: str, extra: list[ExtraFile], prompt: str) -> list[int]:
    """llama.cpp's /infill prompt (the repository-level layout of text/fim.py)."""
    fim = fim_tokens(state, "input_prefix")
    chars = len(prefix) + len(suffix) + len(prompt) + sum(len(f.text) + len(f.filename) for f in extra)
    _check_chars(state, chars, "input_prefix")
    ids = fim.prompt(state.llm.tokenizer, prefix, suffix, repo_level=True, extra=extra, prompt=prompt)
    return _checked(state, ids, "input_prefix")


def fim_tokens(state: ServerState, param: str) -> FimTokens:
    try:
        return FimTokens.of(state.llm.tokenizer)
    except InvalidRequestError as e:
        raise bad_request(str(e), param=param) from e


def chat_prompt(state: ServerState, messages: list[ChatMessage], tools: ToolPlan | None = None,
                template_kwargs: dict | None = None) -> Encoded:
    """The conversation through the chat template, with the plan's tools (server/tools.py) and the
    request's `chat_template_kwargs`. Text only: `chat_prompt_images` takes images too."""
    text, ids, images = chat_prompt_images(state, messages, tools, template_kwargs)
    if images:
        raise bad_request("images are not supported on this route", param="messages")
    return text, ids


def chat_prompt_images(state: ServerState, messages: list[ChatMessage], tools: ToolPlan | None = None,
                       template_kwargs: dict | None = None) -> tuple[str | None, list[int], list]:
    """`chat_prompt`, and the conversation's images (vision.inputs.ImageInput): a 400 naming the
    reason for an image a text-only model is sent, or one that cannot be read."""
    check_template_kwargs(template_kwargs)
    if not messages:
        raise bad_request("messages is empty", param="messages")
    rendered = [m.for_template() for m in messages]
    _check_chars(state, sum(_text_chars(m["content"]) for m in rendered) + len(json.dumps(tools.tools) if tools else "")
                 + len(json.dumps(template_kwargs) if template_kwargs else ""), "messages")
    rendered, tool_list = template_messages(rendered, tools.tools if tools else None, state.llm.chat_template)
    try:
        text, ids, images = state.llm.encode_chat_images(rendered, tools=tool_list, chat_template_kwargs=template_kwargs)
    except InvalidRequestError as e:
        raise bad_request(str(e), param="messages") from e
    return text, _checked(state, ids, "messages"), images


def _text_chars(content) -> int:
    """Characters of a message's text (its image parts are checked as images)."""
    if isinstance(content, list):
        return sum(len(part.get("text", "")) for part in content if isinstance(part, dict))
    return len(content)


def check_template_kwargs(template_kwargs: dict | None) -> None:
    reserved = sorted(RESERVED_TEMPLATE_VARIABLES & set(template_kwargs or ()))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {reserved[0]!r}: the server sets it",
                          param="chat_template_kwargs")


def _check_chars(state: ServerState, chars: int, param: str) -> None:
    if chars > state.max_prompt_chars:
        raise bad_request(f"the prompt has {chars} characters, more than this model's context could hold as "
                          f"tokens ({state.llm.max_model_len - 1} prompt tokens)", param=param)


def within_context(state: ServerState, params: SamplingParams, prompt_tokens: int) -> SamplingParams:
    """`params` with `max_tokens` no more than the context leaves after a prompt of `prompt_tokens`."""
    room = state.llm.max_model_len - prompt_tokens
    if params.max_tokens is None or params.max_tokens <= room:
        return params
    return dataclasses.replace(params, max_tokens=room)


def _checked(state: ServerState, ids: list[int], param: str) -> list[int]:
    """The engine's own check (its door's, thread-safe), as a 400 naming the field at fault."""
    try:
        state.engine.client.check_prompt(ids)
    except InvalidRequestError as e:
        raise bad_request(str(e), param=e.param or param) from e
    return ids
