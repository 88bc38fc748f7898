"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), as the official
`anthropic` client and Claude Code speak it: a translation onto the chat handling.

- In: `system` (a string or text blocks; Claude Code's per-prompt billing header block is left out
  of the prompt, so that the prefix cache can serve the rest); messages of `text`, `tool_use` and
  `tool_result` blocks, and `system` messages mid-conversation (an assistant's `thinking` blocks are
  accepted and dropped, as chat templates drop earlier reasoning); `max_tokens` (past the context:
  clamped, stop reason max_tokens), `stop_sequences`, `temperature`, `top_p`, `top_k`; `tools` with
  `input_schema` and `tool_choice` auto / any / tool / none, through the chat's tool calling (any
  and tool constrain the output to calls that fit the schemas); `output_config.format` (a JSON
  schema) through structured output.
- Deferred tools (`defer_loading`, Claude Code's tool search) stay out of the tool list, so that it,
  and the prompt's prefix, stay the same from turn to turn; a `tool_reference` block in a tool
  result writes the referenced tool's definition into that result, where the model reads it.
  Anthropic's server tools (`web_search_20250305`, ...) run on Anthropic's side and are left out.
- Fields without effect here (`metadata`, `thinking`, `context_management`, `output_config.effort`,
  `cache_control`, ...) are ignored and logged once (server/ignored.py); an image or document block
  is a 400 (this server reads text).
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
from pydantic import Discriminator, Field, Tag
from starlette.concurrency import run_in_threadpool

from ..engine.client import RequestOutput
from .error_shapes import anthropic_error
from .errors import APIError, bad_request, parse_body
from .prompts import chat_prompt_images
from .responses import cached_tokens
from .protocol import ChatCompletionRequest
from .serving_chat import ChatRun, chat_chunks, chat_response, start_chat
from .router import serving_state
from .ignored import Lenient, note_ignored
from .tools import plan_tools
from .streaming import event_stream, with_keepalive
from .translate import chat_request, delta_pieces, reasoning_of, renamed_params

PARAMS = {"stop": "stop_sequences", "response_format": "output_config.format"}
BILLING_HEADER = "x-anthropic-billing-header:"  # Claude Code's first system block: new with every prompt


_Open = Lenient  # fields it does not declare are ignored and logged once (server/ignored.py)


_Block = _Open


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
    content: _text_or(ResultBlock) | None = None
    cache_control: dict | None = None


class ToolReferenceBlock(_Block):
    """Claude Code's tool search: the tool named is loaded (server/anthropic_messages.py's docstring)."""

    type: Literal["tool_reference"]
    tool_name: str


class MediaBlock(_Block):
    """An image or a document. An image in a user turn becomes an image part of the chat message
    (its base64 source a data URL; a model without a vision encoder answers 400); a document, or an
    image anywhere else, is refused when the request is translated."""

    type: Literal["image", "document"]
    source: dict | None = None


class OtherBlock(_Block):
    """A block of a type this server never writes nor reads (server tools' results in the history,
    ...): left out of the prompt, and logged once."""

    type: str


ResultBlock = Annotated[Annotated[TextBlock, Tag("text")] | Annotated[ToolReferenceBlock, Tag("tool_reference")]
                        | Annotated[MediaBlock, Tag("media")] | Annotated[OtherBlock, Tag("other")],
                        Discriminator(lambda v: _block_tag(v, ("text", "tool_reference")))]


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


_BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


def _block_tag(value: Any, known: tuple[str, ...]) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind in known:
        return kind
    return "media" if kind in ("image", "document") else "other"


Block = Annotated[Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
                  | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")]
                  | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")] | Annotated[MediaBlock, Tag("media")]
                  | Annotated[OtherBlock, Tag("other")],
                  Discriminator(lambda v: _block_tag(v, _BLOCK_TYPES))]


class InputMessage(_Open):
    role: Literal["user", "assistant", "system"]
    content: _text_or(Block)


class ToolDefinition(_Open):
    """A client tool (`type` custom or left out), or one of Anthropic's server tools (another
    `type`: left out of the prompt, as their work happens on Anthropic's side)."""

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    input_schema: dict | None = None
    type: str | None = None
    cache_control: dict | None = None
    defer_loading: bool | None = None

    @property
    def is_client_tool(self) -> bool:
        return self.type in (None, "custom")


class ToolChoice(_Open):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class JsonOutputFormat(_Open):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(_Open):
    format: JsonOutputFormat | None = None


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
    thinking: dict | None = None  # no budget is kept; a stream's keep-alive takes a thinking block (message_events)


# -- in: a Messages request as a chat request ----------------------------------------------------
def _text(blocks: str | list[TextBlock] | None) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    return "\n".join(b.text for b in blocks)


def _system_text(system: str | list[TextBlock] | None) -> str:
    """The system prompt without Claude Code's billing header block, which changes with every prompt
    (`cc_version=...`) and would keep the prefix cache from serving anything after it."""
    if isinstance(system, list):
        system = [b for b in system if not b.text.startswith(BILLING_HEADER)]
    return _text(system)


def _result_text(content: str | list | None, deferred: dict[str, "ToolDefinition"]) -> str:
    """A tool result's text; a `tool_reference` block becomes the definition of the tool it loads."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for b in content:
        if isinstance(b, TextBlock):
            parts.append(b.text)
        elif isinstance(b, ToolReferenceBlock):
            tool = deferred.get(b.tool_name)
            parts.append(json.dumps(_function(tool), ensure_ascii=False) if tool is not None
                         else f"(no tool named {b.tool_name!r} was given)")
        else:
            _refuse_or_skip(b)
    return "\n".join(parts)


def _refuse_or_skip(block: Any) -> None:
    if isinstance(block, MediaBlock):
        raise bad_request(f"a {block.type} block: this server reads text only", param="messages")
    note_ignored("/v1/messages", [f"{block.type} block"], "not part of the prompt here")


def chat_messages(body: CountTokensRequest) -> list[dict]:
    """Anthropic's turns as chat messages: a user turn's `tool_result` blocks become `tool` messages
    (in order, around its text), an assistant turn's `tool_use` blocks its `tool_calls`, a system
    message stays one."""
    out: list[dict] = []
    system = _system_text(body.system)
    if system:
        out.append({"role": "system", "content": system})
    deferred = {t.name: t for t in body.tools or () if t.is_client_tool and t.defer_loading}
    for message in body.messages:
        blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) \
            else message.content
        for b in blocks:
            if isinstance(b, MediaBlock) and b.type == "image" and message.role == "user":
                continue  # an image part, below
            if isinstance(b, (MediaBlock, OtherBlock)):
                _refuse_or_skip(b)
        if message.role == "system":
            out.append({"role": "system", "content": "".join(b.text for b in blocks if isinstance(b, TextBlock))})
            continue
        if message.role == "assistant":
            text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
            calls = [{"id": b.id, "type": "function",
                      "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                     for b in blocks if isinstance(b, ToolUseBlock)]
            if any(isinstance(b, ToolResultBlock) for b in blocks):
                raise bad_request("tool_result blocks belong in a user message", param="messages")
            out.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
            continue
        text: list = []  # strings, and image parts where the turn has images
        for b in blocks:
            if isinstance(b, ToolResultBlock):
                if text:
                    out.append({"role": "user", "content": _user_content(text)})
                    text = []
                out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": _result_text(b.content, deferred)})
            elif isinstance(b, ToolUseBlock):
                raise bad_request("tool_use blocks belong in an assistant message", param="messages")
            elif isinstance(b, TextBlock):
                text.append(b.text)
            elif isinstance(b, MediaBlock):
                text.append(_image_part(b))
        if text:
            out.append({"role": "user", "content": _user_content(text)})
    if body.messages and body.messages[-1].role == "assistant":
        raise bad_request("the last message is the assistant's: continuing a prefilled answer is not supported",
                          param="messages")
    return out


def _image_part(block: MediaBlock) -> dict:
    """An image block as an OpenAI image part: a base64 source as a data URL (a `url` source is
    passed on, and refused where images are read: this server fetches nothing)."""
    source = block.source or {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        media = source.get("media_type") if isinstance(source.get("media_type"), str) else "image/png"
        url = f"data:{media};base64,{source['data']}"
    elif source.get("type") == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise bad_request("an image block's source must be {\"type\": \"base64\", \"media_type\": ..., "
                          "\"data\": ...}", param="messages")
    return {"type": "image_url", "image_url": {"url": url}}


def _user_content(pieces: list) -> str | list[dict]:
    """A user turn's text (joined), or its parts in order where it has an image."""
    if all(isinstance(p, str) for p in pieces):
        return "".join(pieces)
    return [p if isinstance(p, dict) else {"type": "text", "text": p} for p in pieces]


def _function(tool: ToolDefinition) -> dict:
    return {"name": tool.name, "description": tool.description, "parameters": tool.input_schema or {"type": "object"}}


def _tool_fields(body: CountTokensRequest) -> dict:
    fields: dict[str, Any] = {}
    server_tools = [t.type for t in body.tools or () if not t.is_client_tool]
    note_ignored("/v1/messages", [f"{kind} tool" for kind in server_tools], "a server tool of Anthropic's")
    listed = [{"type": "function", "function": _function(t)} for t in body.tools or ()
              if t.is_client_tool and not t.defer_loading]
    if listed:
        fields["tools"] = listed
    choice = body.tool_choice
    if choice is not None and (listed or choice.type in ("any", "tool")):  # auto / none of no tools: nothing to say
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
            "usage": {**input_usage(answer.usage.prompt_tokens, answer.usage.prompt_tokens_details.cached_tokens),
                      "output_tokens": answer.usage.completion_tokens}}


def input_usage(prompt_tokens: int, cached: int) -> dict:
    """Anthropic's count of a prompt: the tokens read from the prefix cache apart from the rest (every
    prompt's full blocks are cached for the next request, whatever its `cache_control` says)."""
    return {"input_tokens": prompt_tokens - cached, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def _message_id(run: ChatRun) -> str:
    return "msg_" + run.chat_id.split("-", 1)[-1]


def sse_event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


PING = sse_event("ping", {})


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


STILL_THINKING = object()  # the keep-alive of message_events


async def message_events(run: ChatRun, keepalive_s: float, thinking: bool) -> AsyncIterator[str]:
    """The chat chunks of `run` as Anthropic's stream events. While nothing comes for `keepalive_s`
    (a long prompt being prefilled), a `ping` event; and where the request asked for thinking, an
    (empty) thinking block's delta: Anthropic's clients skip pings before their code sees them, and
    Claude Code gives up on a stream after 5 minutes without an event it sees, and sends it again,
    so a prefill of more than 5 minutes would never end. The thinking block is where the answer
    would say it thinks, and a reasoning model's real thinking goes on in it."""
    yield sse_event("message_start", {"message": {
        "id": _message_id(run), "type": "message", "role": "assistant", "model": run.state.model_name,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": run.prompt_tokens, "output_tokens": 0}}})
    blocks = BlockWriter()
    finish_reason: str | None = None
    finished: list[RequestOutput] = []
    async for chunk in with_keepalive(chat_chunks(run, include_usage=False, finished=finished), STILL_THINKING,
                                      keepalive_s):
        if chunk is STILL_THINKING:
            for event in [PING, *(blocks.thinking("") if thinking and blocks.open in (None, "thinking") else ())]:
                yield event
            continue
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
    usage = input_usage(len(output.prompt_token_ids), cached_tokens(output)) if output is not None else {}
    yield sse_event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": {**usage, "output_tokens": generated}})
    yield sse_event("message_stop", {})


# -- routes --------------------------------------------------------------------------------------
router = APIRouter()


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    raw = await parse_body(request, MessagesRequest)
    state = await serving_state(request, raw.model)
    body = to_chat(raw)
    with renamed_params(PARAMS):
        run = await start_chat(body, request, state, prefix="msg")
    if body.stream:
        thinking = isinstance(raw.thinking, dict) and raw.thinking.get("type") in ("enabled", "adaptive")
        return event_stream(run.handle, message_events(run, state.config.keepalive_interval, thinking), state.config,
                            done="", error_event=error_event, keepalive=None)
    answer, output = await chat_response(run, request)
    return Response(json.dumps(message_body(run, answer, output), ensure_ascii=False), media_type="application/json")


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    """The prompt's tokens as the model sees it: the chat template over the messages and the tools."""
    raw = await parse_body(request, CountTokensRequest)
    state = await serving_state(request, raw.model)
    body = chat_request({"model": raw.model, "messages": chat_messages(raw), **_tool_fields(raw)})
    plan = plan_tools(body, state.llm.chat_template)
    _, ids, _ = await run_in_threadpool(chat_prompt_images, state, body.messages, plan)
    return Response(json.dumps({"input_tokens": len(ids)}), media_type="application/json")


def add_anthropic_messages(app: FastAPI, dependencies: list) -> None:
    """The routes, behind the server's key (`x-api-key` or `Authorization`); their errors take
    Anthropic's shape by their path (server/error_shapes.py)."""
    app.include_router(router, dependencies=dependencies)
