"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), as the official
`anthropic` client and Claude Code speak it: a translation onto the chat handling.

- In: `system` (a string or text blocks); messages of `text`, `tool_use` and `tool_result` blocks
  (an assistant's `thinking` blocks are accepted and dropped, as chat templates drop earlier
  reasoning); `max_tokens`, `stop_sequences`, `temperature`, `top_p`, `top_k`; `tools` with
  `input_schema` and `tool_choice` auto / any / tool / none, through the chat's tool calling (any
  and tool constrain the output to calls that fit the schemas); `output_config.format` (a JSON
  schema) through structured output. `metadata`, `service_tier`, `cache_control`, `thinking` and
  `output_config.effort` (no reasoning budget is enforced) and the like are accepted and change
  nothing (`IGNORED`); any other field is a 400.
- Out: `text` and `tool_use` blocks (a `thinking` block first where the chat answer carries
  `reasoning_content`), `stop_reason` end_turn / max_tokens / stop_sequence / tool_use, `usage`.
  Streamed as Anthropic's events: `message_start`, per block `content_block_start`,
  `content_block_delta` (`text_delta`, `thinking_delta`, `input_json_delta`), `content_block_stop`,
  then `message_delta` (stop reason, usage) and `message_stop`; a failure mid-way is an `error` event.
- Errors in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}` (server/error_shapes.py);
  the key is read from `x-api-key` as well as `Authorization`.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, FastAPI, Request, Response
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from starlette.concurrency import run_in_threadpool

from ..engine.client import RequestOutput
from .error_shapes import anthropic_error
from .errors import APIError, bad_request, parse_body
from .prompts import chat_prompt
from .protocol import ChatCompletionRequest
from .serving_chat import ChatRun, chat_chunks, chat_response, start_chat
from .state import ServerState
from .tools import plan_tools
from .streaming import event_stream
from .translate import chat_request, delta_pieces, reasoning_of, refuse_unknown, renamed_params

# Accepted and without effect here: bookkeeping, routing and caching hints, and reasoning settings.
IGNORED = frozenset({"metadata", "service_tier", "thinking", "cache_control", "speed", "inference_geo",
                     "user_profile_id", "workspace_id", "diagnostics"})
PARAMS = {"stop": "stop_sequences", "response_format": "output_config.format"}


class _Closed(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Open(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class _Block(BaseModel):
    """A content block: a field it does not know is refused unless null (clients send back the blocks
    they were given, with the null fields of newer API versions)."""

    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="after")
    def _no_unknown_values(self) -> "_Block":
        unknown = sorted(k for k, v in (self.model_extra or {}).items() if v is not None)
        if unknown:
            raise ValueError(f"the field '{unknown[0]}' of a {getattr(self, 'type', '')} block is not supported")
        return self


def _text_or(blocks: Any) -> Any:
    """A string, or a list of `blocks`, chosen by the value: one error about the branch given (an
    unknown block type names the types taken) rather than one a member of the union."""
    return Annotated[Annotated[str, Tag("text")] | Annotated[list[blocks], Tag("blocks")],
                     Discriminator(lambda v: "text" if isinstance(v, str) else "blocks")]


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None
    citations: list | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict
    cache_control: dict | None = None


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: _text_or(TextBlock) | None = None
    is_error: bool | None = None
    cache_control: dict | None = None


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]


class InputMessage(_Closed):
    role: Literal["user", "assistant"]
    content: _text_or(Block)


class ToolDefinition(_Closed):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None
    cache_control: dict | None = None


class ToolChoice(_Closed):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class JsonOutputFormat(_Closed):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(_Closed):
    format: JsonOutputFormat | None = None
    effort: str | None = None  # accepted, without effect (no reasoning budget here)


class CountTokensRequest(_Open):
    model: str
    messages: list[InputMessage]
    system: _text_or(TextBlock) | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    output_config: OutputConfig | None = None


# -- in: a Messages request as a chat request ----------------------------------------------------
def _text(blocks: str | list[TextBlock] | None) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    return "\n".join(b.text for b in blocks)


def chat_messages(body: CountTokensRequest) -> list[dict]:
    """Anthropic's turns as chat messages: a user turn's `tool_result` blocks become `tool` messages
    (in order, around its text), an assistant turn's `tool_use` blocks its `tool_calls`."""
    out: list[dict] = []
    system = _text(body.system)
    if system:
        out.append({"role": "system", "content": system})
    for message in body.messages:
        blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) \
            else message.content
        if message.role == "assistant":
            text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
            calls = [{"id": b.id, "type": "function",
                      "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                     for b in blocks if isinstance(b, ToolUseBlock)]
            if any(isinstance(b, ToolResultBlock) for b in blocks):
                raise bad_request("tool_result blocks belong in a user message", param="messages")
            out.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
            continue
        text: list[str] = []
        for b in blocks:
            if isinstance(b, ToolResultBlock):
                if text:
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)})
            elif isinstance(b, ToolUseBlock):
                raise bad_request("tool_use blocks belong in an assistant message", param="messages")
            elif isinstance(b, TextBlock):
                text.append(b.text)
        if text:
            out.append({"role": "user", "content": "".join(text)})
    if body.messages and body.messages[-1].role == "assistant":
        raise bad_request("the last message is the assistant's: continuing a prefilled answer is not supported",
                          param="messages")
    return out


def _tool_fields(body: CountTokensRequest) -> dict:
    fields: dict[str, Any] = {}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                             "parameters": t.input_schema}} for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice of type tool needs a name", param="tool_choice")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    return fields


def to_chat(body: MessagesRequest) -> ChatCompletionRequest:
    refuse_unknown(body, IGNORED)
    fields = {"model": body.model, "messages": chat_messages(body), "max_tokens": body.max_tokens,
              "stop": body.stop_sequences, "temperature": body.temperature, "top_p": body.top_p,
              "top_k": body.top_k, "stream": bool(body.stream), **_tool_fields(body)}
    if body.output_config is not None and body.output_config.format is not None:
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": body.output_config.format.schema_}}
    return chat_request(fields)


# -- out: a chat answer as a Message -------------------------------------------------------------
def stop_reason(finish_reason: str | None, engine_stop: str | int | None) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a chat finish reason and the engine's stop reason
    (the stop string that ended it, or a stop token id, or None for end of sequence)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(engine_stop, str):
        return "stop_sequence", engine_stop
    return "end_turn", None


def _tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {}  # a call cut short by max_tokens has no whole input


def message_body(run: ChatRun, answer, output: RequestOutput) -> dict:
    choice = answer.choices[0]
    content: list[dict] = []
    reasoning = reasoning_of(choice.message)
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if choice.message.content:
        content.append({"type": "text", "text": choice.message.content})
    for call in choice.message.tool_calls or ():
        content.append({"type": "tool_use", "id": call.id, "name": call.function.name,
                        "input": _tool_input(call.function.arguments)})
    reason, sequence = stop_reason(choice.finish_reason, output.outputs[0].stop_reason)
    return {"id": _message_id(run), "type": "message", "role": "assistant", "model": run.state.model_name,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": answer.usage.prompt_tokens, "output_tokens": answer.usage.completion_tokens}}


def _message_id(run: ChatRun) -> str:
    return "msg_" + run.chat_id.split("-", 1)[-1]


def sse_event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def error_event(error: APIError) -> str:
    return f"event: error\ndata: {json.dumps(anthropic_error(error.status, error.info.message))}\n\n"


class BlockWriter:
    """Content blocks as Anthropic streams them: each opened, filled by deltas, closed, numbered in order."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the kind of the block open now

    def _start(self, kind: str, block: dict) -> list[str]:
        events = self.close()
        self.index += 1
        self.open = kind
        return events + [sse_event("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict) -> str:
        return sse_event("content_block_delta", {"index": self.index, "delta": delta})

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse_event("content_block_stop", {"index": self.index})]

    def thinking(self, piece: str) -> list[str]:
        events = self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""}) \
            if self.open != "thinking" else []
        return events + [self._delta({"type": "thinking_delta", "thinking": piece})]

    def text(self, piece: str) -> list[str]:
        events = self._start("text", {"type": "text", "text": ""}) if self.open != "text" else []
        return events + [self._delta({"type": "text_delta", "text": piece})]

    def tool_use(self, call_id: str, name: str) -> list[str]:
        return self._start("tool_use", {"type": "tool_use", "id": call_id, "name": name, "input": {}})

    def tool_input(self, piece: str) -> list[str]:
        return [self._delta({"type": "input_json_delta", "partial_json": piece})] if self.open == "tool_use" else []


async def message_events(run: ChatRun) -> AsyncIterator[str]:
    """The chat chunks of `run` as Anthropic's stream events."""
    yield sse_event("message_start", {"message": {
        "id": _message_id(run), "type": "message", "role": "assistant", "model": run.state.model_name,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": run.prompt_tokens, "output_tokens": 0}}})
    blocks = BlockWriter()
    finish_reason: str | None = None
    finished: list[RequestOutput] = []
    async for chunk in chat_chunks(run, include_usage=False, finished=finished):
        for choice in chunk.choices:
            events: list[str] = []
            for kind, text, call_id in delta_pieces(choice.delta):
                events += (blocks.tool_use(call_id, text) if kind == "call" else
                           {"reasoning": blocks.thinking, "text": blocks.text, "arguments": blocks.tool_input}[kind](text))
            if choice.finish_reason is not None:
                finish_reason = choice.finish_reason
            for event in events:
                yield event
    for event in blocks.close():
        yield event
    output = finished[0] if finished else None
    engine_stop = output.outputs[0].stop_reason if output is not None else None
    reason, sequence = stop_reason(finish_reason, engine_stop)
    generated = len(output.outputs[0].token_ids) if output is not None else 0
    yield sse_event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": {"output_tokens": generated}})
    yield sse_event("message_stop", {})


# -- routes --------------------------------------------------------------------------------------
router = APIRouter()


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = to_chat(await parse_body(request, MessagesRequest))
    with renamed_params(PARAMS):
        run = await start_chat(body, request, state, prefix="msg")
    if body.stream:
        return event_stream(run.handle, message_events(run), state.request_timeout, done="", error_event=error_event)
    answer, output = await chat_response(run, request)
    return Response(json.dumps(message_body(run, answer, output), ensure_ascii=False), media_type="application/json")


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    """The prompt's tokens as the model sees it: the chat template over the messages and the tools."""
    state: ServerState = request.app.state.server
    raw = await parse_body(request, CountTokensRequest)
    refuse_unknown(raw, IGNORED)
    state.check_model(raw.model)
    body = chat_request({"model": raw.model, "messages": chat_messages(raw), **_tool_fields(raw)})
    plan = plan_tools(body, state.llm.chat_template)
    _, ids = await run_in_threadpool(chat_prompt, state, body.messages, None, plan)
    return Response(json.dumps({"input_tokens": len(ids)}), media_type="application/json")


def add_anthropic_messages(app: FastAPI, dependencies: list) -> None:
    """The routes, behind the server's key (`x-api-key` or `Authorization`); their errors take
    Anthropic's shape by their path (server/error_shapes.py)."""
    app.include_router(router, dependencies=dependencies)
