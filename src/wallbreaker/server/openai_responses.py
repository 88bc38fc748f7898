"""OpenAI's Responses API (`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`), as the
official `openai` client, Codex and opencode speak it: a translation onto the chat handling.

- In: `input` as a string or items (messages of `input_text` / `output_text` parts, `function_call`
  and `function_call_output` items, and Codex's `custom_tool_call` / `custom_tool_call_output` as
  calls whose arguments are `{"input": ...}`; earlier `reasoning` items, and the items of tools that
  run on OpenAI's side, are dropped, as chat templates drop earlier reasoning), `instructions` (a
  system message), `tools`, `tool_choice`, `parallel_tool_calls`, `text.format` (text, json_object,
  json_schema), `max_output_tokens`, `temperature`, `top_p`.
- Tools: `function` tools, and the functions inside Codex's `namespace` tools (a call of one comes
  back naming its `namespace`); tools of other types (`web_search`, ...) run on OpenAI's side and
  are left out of the prompt, logged once. Fields without effect (`reasoning`, `include`,
  `client_metadata`, `prompt_cache_key`, ...) are ignored and logged once (server/ignored.py); an
  image or file part is a 400 (this server reads text).
- `store` (true unless false, as OpenAI's) keeps the response in a bounded memory store
  (server/response_store.py), and `previous_response_id` continues its conversation; an id the store
  no longer holds is a 400 that says so.
- Out: a `reasoning` item where the chat answer carries `reasoning_content`, a `message` item of
  `output_text`, `function_call` items; `status` completed, or incomplete at `max_output_tokens`.
  Streamed as OpenAI's events: `response.created`, `response.in_progress`, per item
  `response.output_item.added`, its deltas (`response.output_text.delta`,
  `response.function_call_arguments.delta`, `response.reasoning_text.delta`) and their `.done`,
  `response.output_item.done`, then `response.completed` (or `response.incomplete`); a failure mid-way
  is an `error` event.
- Errors in OpenAI's shape, as on the other OpenAI routes.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, FastAPI, Request, Response
from pydantic import BaseModel, Field, ValidationError

from ..engine.client import RequestOutput
from .errors import APIError, bad_request, parse_body, validation_error
from .protocol import ChatCompletionRequest
from .response_store import ResponseStore
from .responses import cached_tokens
from .serving_chat import ChatRun, chat_chunks, chat_response, start_chat
from .router import serving_state
from .streaming import event_stream
from .ignored import Lenient, note_ignored, refuse_present
from .translate import chat_request, delta_pieces, reasoning_of, renamed_params

# Fields whose absence would change the answer, and that this server cannot honour.
REFUSED = {"conversation": "conversations are not stored here; send the earlier items in input, or "
                           "previous_response_id",
           "prompt": "stored prompt templates are not kept here; send the instructions and input",
           "background": "responses run while the request waits; leave it out"}
PARAMS = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens",
          "max_tokens": "max_output_tokens", "messages": "input"}


_Open = Lenient  # fields it does not declare are ignored and logged once (server/ignored.py)


class FunctionTool(_Open):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict | None = None


class NamespaceTool(_Open):
    """Codex's group of functions (`multi_agent_v1`, an MCP server's tools)."""

    type: Literal["namespace"]
    name: str
    description: str | None = None
    tools: list[dict]


def function_tools(tools: list[dict] | None) -> tuple[list[FunctionTool], dict[str, str]]:
    """The functions the model may call, and the namespace of each that came from one."""
    functions: list[FunctionTool] = []
    namespace_of: dict[str, str] = {}
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        try:
            if kind == "function":
                functions.append(FunctionTool.model_validate(tool))
            elif kind == "namespace":
                group = NamespaceTool.model_validate(tool)
                inner, _ = function_tools(group.tools)
                functions += inner
                namespace_of.update((f.name, group.name) for f in inner)
            else:
                note_ignored("/v1/responses", [f"{kind} tool"], "runs on OpenAI's side, not here")
        except ValidationError as e:
            error = validation_error(e.errors(include_url=False))
            error.info.message = f"tools.{i}: {error.info.message}"
            error.info.param = "tools"
            raise error from None
    return functions, namespace_of


class NamedFunction(_Open):
    type: Literal["function"]
    name: str


class TextFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Open):
    format: TextFormat | None = None
    verbosity: str | None = None  # no length is enforced


class ResponsesRequest(_Open):
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    store: bool | None = None
    previous_response_id: str | None = None
    truncation: Literal["disabled"] | None = None


# -- in: a Responses request as a chat request ---------------------------------------------------
def _part_text(content: Any, where: str, images: bool = False) -> str | list[dict]:
    """A message's text; with `images` (a user message), its text and `input_image` parts as chat
    content parts where it has an image (a data URL; a model without a vision encoder answers 400)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: content must be a string or a list of parts", param="input")
    texts: list = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "input_image" and images:
            url = part.get("image_url")
            if not isinstance(url, str):
                raise bad_request(f"{where}.content.{j}: an input_image needs image_url (a data URL); file_id is "
                                  "not supported", param="input")
            texts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(f"{where}.content.{j}: an {kind} part: this server reads text only", param="input")
        elif kind in ("refusal",) and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise bad_request(f"{where}.content.{j}: the part type {kind!r} is not supported (this server takes "
                              "input_text and output_text parts)", param="input")
    if any(isinstance(t, dict) for t in texts):
        return [t if isinstance(t, dict) else {"type": "text", "text": t} for t in texts]
    return "".join(texts)


def _call(call_id: Any, name: Any, arguments: Any, where: str) -> dict:
    if not all(isinstance(v, str) for v in (call_id, name, arguments)):
        raise bad_request(f"{where}: a function_call needs call_id, name and arguments (strings)", param="input")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def input_messages(items: str | list[dict]) -> list[dict]:
    """The input items as chat messages: a function_call joins the assistant message before it (or
    starts one), a function_call_output is a tool message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}: the role {role!r} is not one of user, assistant, system, developer",
                                  param="input")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _part_text(item.get("content"), where, images=role == "user")})
        elif kind in ("function_call", "custom_tool_call"):
            arguments = item.get("arguments") if kind == "function_call" else \
                json.dumps({"input": item.get("input")}, ensure_ascii=False)
            call = _call(item.get("call_id"), item.get("name"), arguments, where)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise bad_request(f"{where}: a function_call_output needs call_id (a string)", param="input")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _part_text(output, where)})
        elif kind == "reasoning":
            continue
        elif isinstance(kind, str):
            note_ignored("/v1/responses", [f"{kind} item"], "not part of the prompt here")
        else:
            raise bad_request(f"{where}: an item needs a type (message, function_call, function_call_output, ...)",
                              param="input")
    return out


def _text_format(body: ResponsesRequest) -> dict | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise bad_request("text.format of type json_schema needs a schema", param="text.format")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_}}


def to_chat(body: ResponsesRequest, history: list[dict]) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request, and the conversation it continues (`history`) with this input, instructions aside."""
    refuse_present(body, REFUSED, "/v1/responses")
    conversation = history + input_messages(body.input)
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields: dict[str, Any] = {"model": body.model, "messages": system + conversation, "stream": bool(body.stream),
                              "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
                              "top_p": body.top_p, "response_format": _text_format(body)}
    functions, _ = function_tools(body.tools)
    if functions:
        fields["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True,
                                                                          exclude=set(t.model_extra or ()) | {"type"})}
                           for t in functions]
    if isinstance(body.tool_choice, NamedFunction):
        fields["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        fields["tool_choice"] = body.tool_choice
    if body.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = body.parallel_tool_calls
    return chat_request({k: v for k, v in fields.items() if v is not None}), conversation


# -- out: a chat answer as a Response ------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [output_text(text)] if status == "completed" else []}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed",
              namespace: str | None = None) -> dict:
    item = {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}
    return item if namespace is None else {**item, "namespace": namespace}


def reasoning_item(item_id: str, text: str) -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


class Reply:
    """The response object around one chat run: its fields echo the request, as OpenAI's do."""

    def __init__(self, body: ResponsesRequest, run: ChatRun, response_id: str):
        self.body, self.run, self.id = body, run, response_id
        self.namespaces = function_tools(body.tools)[1]
        self.created_at = int(time.time())

    def object(self, status: str, output: list[dict], output_tokens: int | None = None,
               finish_reason: str | None = None, cached: int = 0) -> dict:
        body = self.body
        prompt = self.run.prompt_tokens
        usage = None
        if output_tokens is not None:
            usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                     "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": prompt + output_tokens}
        fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) \
            if body.text is not None and body.text.format is not None else {"type": "text"}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.run.state.model_name, "output": output, "usage": usage, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "parallel_tool_calls": body.parallel_tool_calls is not False,
                "previous_response_id": body.previous_response_id, "store": body.store is not False,
                "temperature": body.temperature if body.temperature is not None else 1.0,
                "top_p": body.top_p if body.top_p is not None else 1.0,
                "tool_choice": _echo_choice(body.tool_choice),
                "tools": body.tools or [],
                "text": {"format": fmt}, "truncation": "disabled",
                "metadata": (body.model_extra or {}).get("metadata") or {},
                "reasoning": {"effort": None, "summary": None}}


def _echo_choice(choice: Any) -> Any:
    if choice is None:
        return "auto"
    return choice.model_dump() if isinstance(choice, BaseModel) else choice


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def answer_message(output: list[dict]) -> dict:
    """This response's output as the assistant message that continues its conversation."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


def output_items(answer, namespaces: dict[str, str]) -> list[dict]:
    message = answer.choices[0].message
    items = []
    reasoning = reasoning_of(message)
    if reasoning:
        items.append(reasoning_item(_id("rs"), reasoning))
    if message.content:
        items.append(message_item(_id("msg"), message.content))
    items += [call_item(_id("fc"), c.id, c.function.name, c.function.arguments, namespace=namespaces.get(c.function.name))
              for c in message.tool_calls or ()]
    return items


class EventWriter:
    """Output items as OpenAI streams them: each added, filled by deltas, done, numbered in order;
    every event carries the stream's sequence number."""

    def __init__(self, namespaces: dict[str, str]) -> None:
        self.namespaces = namespaces  # a function's namespace, for those that came from one
        self.sequence = 0
        self.items: list[dict] = []  # finished items, in output order
        self.open: dict | None = None  # the item being streamed: its kind, id, text so far (and call fields)

    def event(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    @property
    def _index(self) -> int:
        return len(self.items)

    def close(self) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": self._index}
        if item["kind"] == "message":
            done = message_item(item["id"], item["text"])
            events = [self.event("response.output_text.done", **where, content_index=0, text=item["text"], logprobs=[]),
                      self.event("response.content_part.done", **where, content_index=0,
                                 part=output_text(item["text"]))]
        elif item["kind"] == "reasoning":
            done = reasoning_item(item["id"], item["text"])
            events = [self.event("response.reasoning_text.done", **where, content_index=0, text=item["text"])]
        else:
            done = call_item(item["id"], item["call_id"], item["name"], item["text"],
                             namespace=self.namespaces.get(item["name"]))
            events = [self.event("response.function_call_arguments.done", **where, name=item["name"],
                                 arguments=item["text"])]
        events.append(self.event("response.output_item.done", output_index=self._index, item=done))
        self.items.append(done)
        return events

    def _begin(self, kind: str, prefix: str, **fields: Any) -> list[str]:
        events = self.close()
        self.open = {"kind": kind, "id": _id(prefix), "text": "", **fields}
        if kind == "message":
            added = message_item(self.open["id"], "", "in_progress")
        elif kind == "reasoning":
            added = {"type": "reasoning", "id": self.open["id"], "summary": [], "content": []}
        else:
            added = call_item(self.open["id"], fields["call_id"], fields["name"], "", "in_progress",
                              self.namespaces.get(fields["name"]))
        events.append(self.event("response.output_item.added", output_index=self._index, item=added))
        if kind == "message":
            events.append(self.event("response.content_part.added", item_id=self.open["id"], output_index=self._index,
                                     content_index=0, part=output_text("")))
        return events

    def text(self, piece: str) -> list[str]:
        events = self._begin("message", "msg") if self.open is None or self.open["kind"] != "message" else []
        self.open["text"] += piece
        return events + [self.event("response.output_text.delta", item_id=self.open["id"], output_index=self._index,
                                    content_index=0, delta=piece, logprobs=[])]

    def reasoning(self, piece: str) -> list[str]:
        events = self._begin("reasoning", "rs") if self.open is None or self.open["kind"] != "reasoning" else []
        self.open["text"] += piece
        return events + [self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                    output_index=self._index, content_index=0, delta=piece)]

    def call(self, call_id: str, name: str) -> list[str]:
        return self._begin("function_call", "fc", call_id=call_id, name=name)

    def arguments(self, piece: str) -> list[str]:
        if self.open is None or self.open["kind"] != "function_call":
            return []
        self.open["text"] += piece
        return [self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                           output_index=self._index, delta=piece)]


def error_event(writer: EventWriter) -> Any:
    def event(error: APIError) -> str:
        info = error.info
        return writer.event("error", code=info.code, message=info.message, param=info.param,
                            error=info.model_dump())
    return event


async def response_events(reply: Reply, writer: EventWriter, store: ResponseStore | None,
                          conversation: list[dict]) -> AsyncIterator[str]:
    """The chat chunks of the reply's run as the Responses API's stream events."""
    yield writer.event("response.created", response=reply.object("in_progress", []))
    yield writer.event("response.in_progress", response=reply.object("in_progress", []))
    finished: list[RequestOutput] = []
    finish_reason = None
    async for chunk in chat_chunks(reply.run, include_usage=False, finished=finished):
        for choice in chunk.choices:
            events: list[str] = []
            for kind, text, call_id in delta_pieces(choice.delta):
                events += (writer.call(call_id, text) if kind == "call" else
                           {"reasoning": writer.reasoning, "text": writer.text, "arguments": writer.arguments}[kind](text))
            finish_reason = choice.finish_reason or finish_reason
            for event in events:
                yield event
    for event in writer.close():
        yield event
    generated = sum(len(c.token_ids) for c in finished[0].outputs) if finished else 0
    status = _status(finish_reason)
    final = reply.object(status, writer.items, generated, finish_reason, cached_tokens(finished[0]) if finished else 0)
    if store is not None:
        store.put(reply.id, conversation + [answer_message(writer.items)], final)
    yield writer.event("response.completed" if status == "completed" else "response.incomplete", response=final)


# -- routes --------------------------------------------------------------------------------------
router = APIRouter()


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    responses: ResponseStore = request.app.state.responses
    body = await parse_body(request, ResponsesRequest)
    state = await serving_state(request, body.model)
    history: list[dict] = []
    if body.previous_response_id is not None:
        previous = responses.get(body.previous_response_id)
        if previous is None:
            raise bad_request(f"previous_response_id: no stored response '{body.previous_response_id}' (this server "
                              f"keeps the last {responses.max_responses} responses with store=true, in memory)",
                              param="previous_response_id")
        history = previous.messages
    store = responses if body.store is not False else None
    with renamed_params(PARAMS):
        chat, conversation = to_chat(body, history)
        run = await start_chat(chat, request, state, prefix="resp")
    reply = Reply(body, run, "resp_" + run.chat_id.split("-", 1)[-1])
    if body.stream:
        writer = EventWriter(reply.namespaces)
        return event_stream(run.handle, response_events(reply, writer, store, conversation), state.config,
                            done="", error_event=error_event(writer))
    answer, _ = await chat_response(run, request)
    output = output_items(answer, reply.namespaces)
    finish_reason = answer.choices[0].finish_reason
    final = reply.object(_status(finish_reason), output, answer.usage.completion_tokens, finish_reason,
                         answer.usage.prompt_tokens_details.cached_tokens)
    if store is not None:
        store.put(reply.id, conversation + [answer_message(output)], final)
    return Response(json.dumps(final, ensure_ascii=False), media_type="application/json")


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> Response:
    stored = request.app.state.responses.get(response_id)
    if stored is None:
        raise APIError(404, f"no stored response '{response_id}'", type="not_found_error", param="response_id",
                       code="response_not_found")
    return Response(json.dumps(stored.response, ensure_ascii=False), media_type="application/json")


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    if not request.app.state.responses.delete(response_id):
        raise APIError(404, f"no stored response '{response_id}'", type="not_found_error", param="response_id",
                       code="response_not_found")
    return Response(json.dumps({"id": response_id, "object": "response.deleted", "deleted": True}),
                    media_type="application/json")


def add_openai_responses(app: FastAPI, dependencies: list) -> None:
    """The routes, behind the server's key, and the app's store of responses."""
    app.state.responses = ResponseStore()
    app.include_router(router, dependencies=dependencies)
