"""Prompts in: completions' strings or token ids (one or a batch), chat's messages; all checked
against the context before anything reaches the engine, text by its length before it is tokenized."""
from __future__ import annotations

from typing import TYPE_CHECKING

import json

from ..errors import InvalidRequestError
from .errors import bad_request
from .protocol import ChatMessage
from .tools import ToolPlan, template_messages

if TYPE_CHECKING:
    from .state import ServerState

Encoded = tuple[str | None, list[int]]


def completion_prompts(state: ServerState, prompt: str | list, max_tokens: int | None) -> list[Encoded]:
    """A string, a list of token ids, or a batch (list) of either -> one (text, token ids) a prompt."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
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
        encoded.append((text, _checked(state, ids, max_tokens, "prompt")))
    return encoded


def chat_prompt(state: ServerState, messages: list[ChatMessage], max_tokens: int | None,
                tools: ToolPlan | None = None) -> Encoded:
    """The conversation through the chat template, with the plan's tools (server/tools.py)."""
    if not messages:
        raise bad_request("messages is empty", param="messages")
    rendered = [m.for_template() for m in messages]
    _check_chars(state, sum(len(m["content"]) for m in rendered) + len(json.dumps(tools.tools) if tools else ""),
                 "messages")
    rendered, tool_list = template_messages(rendered, tools.tools if tools else None, state.llm.chat_template)
    try:
        text, ids = state.llm.encode_chat(rendered, tools=tool_list)
    except InvalidRequestError as e:
        raise bad_request(str(e), param="messages") from e
    return text, _checked(state, ids, max_tokens, "messages")


def _check_chars(state: ServerState, chars: int, param: str) -> None:
    if chars > state.max_prompt_chars:
        raise bad_request(f"the prompt has {chars} characters, more than this model's context could hold as "
                          f"tokens ({state.engine.max_prompt_tokens} prompt tokens)", param=param)


def _checked(state: ServerState, ids: list[int], max_tokens: int | None, param: str) -> list[int]:
    max_prompt_tokens = state.engine.max_prompt_tokens
    if not ids:
        raise bad_request("the prompt is empty", param=param)
    if len(ids) > max_prompt_tokens:
        raise bad_request(f"the prompt has {len(ids)} tokens; this model's context takes at most "
                          f"{max_prompt_tokens} prompt tokens (one must be left to generate)", param=param)
    try:
        state.llm.engine.check_token_ids(ids)  # immutable engine facts: safe off the engine thread
    except InvalidRequestError as e:
        raise bad_request(str(e), param=param) from e
    context = state.llm.max_model_len
    if max_tokens is not None and len(ids) + max_tokens > context:
        raise bad_request(f"this model's context is {context} tokens, but {len(ids) + max_tokens} were asked for "
                          f"({len(ids)} in the prompt, max_tokens {max_tokens})", param="max_tokens")
    return ids
