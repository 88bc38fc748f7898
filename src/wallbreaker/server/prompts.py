"""Prompts in: completions' strings or token ids (one or a batch), chat's messages; all checked
against the context before anything reaches the engine."""
from __future__ import annotations

from ..engine.llm import LLM
from ..errors import InvalidRequestError
from .errors import bad_request
from .protocol import ChatMessage

Encoded = tuple[str | None, list[int]]


def completion_prompts(llm: LLM, prompt: str | list, max_prompt_tokens: int) -> list[Encoded]:
    """A string, a list of token ids, or a batch (list) of either -> one (text, token ids) a prompt."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise bad_request("the prompt is empty", param="prompt")
    encoded = []
    for p in prompts:
        try:
            text, ids = llm.encode(p)
        except InvalidRequestError as e:
            raise bad_request(str(e), param="prompt") from e
        encoded.append((text, _checked(ids, max_prompt_tokens, "prompt")))
    return encoded


def chat_prompt(llm: LLM, messages: list[ChatMessage], max_prompt_tokens: int) -> Encoded:
    if not messages:
        raise bad_request("messages is empty", param="messages")
    try:
        text, ids = llm.encode_chat([m.for_template() for m in messages])
    except InvalidRequestError as e:
        raise bad_request(str(e), param="messages") from e
    return text, _checked(ids, max_prompt_tokens, "messages")


def _checked(ids: list[int], max_prompt_tokens: int, param: str) -> list[int]:
    if not ids:
        raise bad_request("the prompt is empty", param=param)
    if len(ids) > max_prompt_tokens:
        raise bad_request(f"the prompt has {len(ids)} tokens; this model's context takes at most "
                          f"{max_prompt_tokens} prompt tokens (one must be left to generate)", param=param)
    return ids
