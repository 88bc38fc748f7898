"""POST /tokenize and POST /detokenize, in vLLM's shapes: a prompt (or chat messages, through the
chat template as /v1/chat/completions renders them) to token ids, and token ids back to text."""
from __future__ import annotations

import json

from fastapi import Request, Response
from starlette.concurrency import run_in_threadpool

from ..errors import InvalidRequestError
from .errors import bad_request, parse_body
from .prompts import check_template_kwargs
from .protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from .responses import DetokenizeResponse, TokenizeResponse
from .router import serving_state
from .tools import template_messages


async def tokenize(request: Request) -> Response:
    raw = await request.body()
    try:
        chat = isinstance(peek := json.loads(raw), dict) and "messages" in peek
    except ValueError:
        chat = False  # parse_body names the JSON error
    body = await parse_body(request, TokenizeChatRequest if chat else TokenizeCompletionRequest)
    state = await serving_state(request, body.model)
    tokenizer = state.llm.tokenizer
    try:
        if isinstance(body, TokenizeChatRequest):
            if not body.messages:
                raise bad_request("messages is empty", param="messages")
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            messages, tools = template_messages([m.for_template() for m in body.messages], tools,
                                                state.llm.chat_template)
            check_template_kwargs(body.chat_template_kwargs)
            _, ids = await run_in_threadpool(state.llm.encode_chat, messages, tools,
                                             body.add_generation_prompt is not False, body.chat_template_kwargs)
        else:
            ids = await run_in_threadpool(tokenizer.encode, body.prompt, body.add_special_tokens is not False)
    except InvalidRequestError as e:
        raise bad_request(str(e), param="messages" if isinstance(body, TokenizeChatRequest) else "prompt") from e
    strs = [tokenizer.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
    out = TokenizeResponse(count=len(ids), max_model_len=state.llm.max_model_len, tokens=ids, token_strs=strs)
    return Response(out.model_dump_json(), media_type="application/json")


async def detokenize(request: Request) -> Response:
    body = await parse_body(request, DetokenizeRequest)
    state = await serving_state(request, body.model)
    try:
        state.engine.client.check_token_ids(body.tokens)
    except InvalidRequestError as e:
        raise bad_request(str(e), param="tokens") from e
    text = await run_in_threadpool(state.llm.tokenizer.decode, body.tokens, False)
    return Response(DetokenizeResponse(prompt=text).model_dump_json(), media_type="application/json")
