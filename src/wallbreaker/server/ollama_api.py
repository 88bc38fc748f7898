"""Ollama's API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`, `/api/version`),
as the official `ollama` client, Open WebUI and editors speak it: a translation onto the chat and
completion handling.

- Streamed as NDJSON unless `"stream": false` (Ollama's default); the last object has `done: true`,
  `done_reason`, and the counters from the engine's own timings: `prompt_eval_count` and
  `eval_count` (tokens), `prompt_eval_duration` (arrival to the first token), `eval_duration` (first
  to last token), `total_duration` (the whole request here) and `load_duration` (the time it waited
  for its model to load, server/router.py; 0 when the model was loaded), in nanoseconds.
- `options`: temperature, top_p, top_k, min_p, num_predict (-1 and -2: to the end of the context),
  stop, seed (-1: random), repeat_penalty (as `repetition_penalty`), repeat_last_n (the penalties'
  window; left out, the whole sequence rather than Ollama's 64), presence_penalty, frequency_penalty,
  typical_p, mirostat (2; 1 is a 400), mirostat_tau, mirostat_eta. Left out, temperature, top_k and
  top_p take Ollama's defaults (0.8, 40, 0.9). Options about hardware and memory (num_ctx, num_gpu,
  num_thread, ...) change no output and are ignored; ones that would and are not supported here
  (penalize_newline, ...) are a 400 naming them.
- `format`: "json" or a JSON schema, through structured output. `tools` (OpenAI's shape) through the
  chat's tool calling; calls come back whole, their arguments as objects. `keep_alive`: how long the
  model stays loaded once idle (server/router.py; a single `--model PATH` stays while the server runs);
  `think` too: a `thinking` field comes back where
  the chat answer carries `reasoning_content`.
- `/api/generate` renders `prompt` (and `system`) through the chat template unless `raw`, which goes
  to the completion handling as it is; with a `suffix`, the completion's fill-in-the-middle (the
  model's FIM tokens; a model without them is a 400). A request without a prompt (or messages) only "loads" the model.
- Errors as Ollama writes them, `{"error": "..."}` (server/error_shapes.py), in a stream as one more line.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Request, Response
from starlette.concurrency import run_in_threadpool

from ..engine.client import RequestOutput
from .errors import APIError, bad_request, parse_body
from .serving_chat import ChatRun, chat_chunks, chat_response, start_chat
from .serving_completion import CompletionRun, completion_chunks, completion_response, start_completion
from .router import load_wait_ns, serving_state
from .streaming import event_stream
from .ignored import Lenient
from .translate import chat_request, completion_request, reasoning_of, renamed_params

# The Ollama API version answered at /api/version: clients check it for the features they use
# (VS Code Copilot reads it as major.minor.patch integers), so it names the API this module follows.
OLLAMA_API_VERSION = "0.12.0"
NDJSON = "application/x-ndjson"
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}  # Ollama's, where a request leaves them out
# option -> the chat / completion request's field
OPTION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "stop": "stop", "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty", "repeat_last_n": "repeat_last_n", "typical_p": "typical_p",
                 "mirostat": "mirostat",
                 "mirostat_tau": "mirostat_tau", "mirostat_eta": "mirostat_eta"}
PARAMS = {"response_format": "format", "max_tokens": "options.num_predict",
          **{field: f"options.{option}" for option, field in OPTION_FIELDS.items()}}
# Options about where and how the model runs, never what it writes.
IGNORED_OPTIONS = frozenset({"numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
                             "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread"})


_Open = Lenient  # fields it does not declare are ignored and logged once (server/ignored.py)


class FunctionCall(_Open):
    name: str
    arguments: dict


class ToolCall(_Open):
    function: FunctionCall


class OllamaMessage(_Open):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    images: list | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class _Generation(_Open):
    model: str
    format: Literal["", "json"] | dict | None = None
    options: dict[str, Any] | None = None
    stream: bool | None = None
    keep_alive: str | int | float | None = None
    think: bool | str | None = None


class ChatRequest(_Generation):
    messages: list[OllamaMessage] | None = None
    tools: list[dict] | None = None


class GenerateRequest(_Generation):
    prompt: str | None = None
    system: str | None = None
    raw: bool | None = None
    images: list | None = None
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None


class ShowRequest(_Open):
    model: str | None = None
    name: str | None = None  # the older spelling
    verbose: bool | None = None


# -- in: an Ollama request as a chat or completion request ---------------------------------------
def sampling_fields(body: _Generation) -> dict[str, Any]:
    """`options` and `format` as the chat / completion request's fields."""
    options = dict(body.options or {})
    fields: dict[str, Any] = dict(DEFAULTS)
    for name, value in options.items():
        if name in IGNORED_OPTIONS:
            continue
        if name == "num_predict":
            if not isinstance(value, int) or isinstance(value, bool):
                raise bad_request("options.num_predict must be an integer", param="options.num_predict")
            fields["max_tokens"] = value if value >= 0 else None  # -1, -2: to the end of the context
        elif name == "seed":
            fields["seed"] = None if value == -1 else value
        elif name in OPTION_FIELDS:
            fields[OPTION_FIELDS[name]] = value
        else:
            raise bad_request(f"the option '{name}' is not supported by this server; leave it out",
                              param=f"options.{name}")
    if isinstance(fields.get("top_k"), int) and fields["top_k"] <= 0:
        fields["top_k"] = 0  # Ollama's "off" is ours too
    if body.format == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict):
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": body.format}}
    return fields


def image_content(text: str, images: list, param: str) -> list[dict]:
    """Ollama's base64 `images` and the text as chat content parts: the images first, then the text
    (a model without a vision encoder answers 400 where the parts are read)."""
    parts = []
    for k, image in enumerate(images):
        if not isinstance(image, str):
            raise bad_request(f"{param}[{k}] must be a base64 string", param=param)
        parts.append({"type": "image_url", "image_url": {"url": image if image.startswith("data:")
                                                         else "data:image/*;base64," + image}})
    return parts + ([{"type": "text", "text": text}] if text else [])


def chat_messages(messages: list[OllamaMessage]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if m.images and m.role != "user":
            raise bad_request("images belong in a user message", param=f"messages.{i}.images")
        message: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.images:
            message["content"] = image_content(m.content or "", m.images, f"messages.{i}.images")
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": f"call_{i}_{j}", "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": json.dumps(c.function.arguments, ensure_ascii=False)}}
                for j, c in enumerate(m.tool_calls)]
        if m.tool_name:
            message["name"] = m.tool_name
        out.append(message)
    return out


# -- out: answers as Ollama's objects ------------------------------------------------------------
def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def counters(output: RequestOutput | None, started_ns: int) -> dict[str, int]:
    """Ollama's counters from the engine's timings (seconds) and this request's wall time."""
    total = time.perf_counter_ns() - started_ns
    if output is None:
        return {"total_duration": total, "load_duration": load_wait_ns()}
    m = output.metrics
    ttft, e2e = m.get("ttft_s", 0.0), m.get("e2e_s", 0.0)
    return {"total_duration": total, "load_duration": load_wait_ns(),
            "prompt_eval_count": len(output.prompt_token_ids), "prompt_eval_duration": int(ttft * 1e9),
            "eval_count": sum(len(c.token_ids) for c in output.outputs),
            "eval_duration": int(max(0.0, e2e - ttft) * 1e9)}


def done_reason(finish_reason: str | None) -> str:
    return "length" if finish_reason == "length" else "stop"  # Ollama ends a tool call with "stop" too


def ollama_tool_calls(calls: list[tuple[str, str]]) -> list[dict]:
    """Calls as Ollama sends them: numbered, their arguments an object ({} for a call cut short)."""
    out = []
    for index, (name, arguments) in enumerate(calls):
        try:
            value = json.loads(arguments)
        except ValueError:
            value = None
        out.append({"function": {"index": index, "name": name, "arguments": value if isinstance(value, dict) else {}}})
    return out


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


def error_line(error: APIError) -> str:
    return _line({"error": error.info.message})


def _json(obj: dict) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False), media_type="application/json")


async def chat_lines(run: ChatRun, name: str, started_ns: int, generate: bool) -> AsyncIterator[str]:
    """The chat chunks of `run` as Ollama's NDJSON objects: chat's `message`, or generate's `response`."""
    finished: list[RequestOutput] = []
    calls: dict[int, list[str]] = {}  # index -> [name, arguments so far]
    finish_reason = None
    async for chunk in chat_chunks(run, include_usage=False, finished=finished):
        for choice in chunk.choices:
            delta = choice.delta
            for c in delta.tool_calls or ():
                held = calls.setdefault(c.index, ["", ""])
                held[0] = c.function.name or held[0]
                held[1] += c.function.arguments or ""
            if choice.finish_reason is not None:
                finish_reason = choice.finish_reason
            thinking = reasoning_of(delta)
            if not (delta.content or thinking):
                continue
            if generate:
                yield _line({"model": name, "created_at": _now(), "response": delta.content or "", "done": False,
                             **({"thinking": thinking} if thinking else {})})
            else:
                message = {"role": "assistant", "content": delta.content or "",
                           **({"thinking": thinking} if thinking else {})}
                yield _line({"model": name, "created_at": _now(), "message": message, "done": False})
    if calls and not generate:
        held = [(calls[i][0], calls[i][1]) for i in sorted(calls)]
        message = {"role": "assistant", "content": "", "tool_calls": ollama_tool_calls(held)}
        yield _line({"model": name, "created_at": _now(), "message": message, "done": False})
    last = {"model": name, "created_at": _now(), "done": True, "done_reason": done_reason(finish_reason),
            **counters(finished[0] if finished else None, started_ns)}
    if generate:
        last["response"] = ""
    else:
        last["message"] = {"role": "assistant", "content": ""}
    yield _line(last)


async def completion_lines(run: CompletionRun, name: str, started_ns: int) -> AsyncIterator[str]:
    finished: list[RequestOutput] = []
    finish_reason = None
    async for chunk in completion_chunks(run, include_usage=False, finished=finished):
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
            if choice.text:
                yield _line({"model": name, "created_at": _now(), "response": choice.text, "done": False})
    yield _line({"model": name, "created_at": _now(), "response": "", "done": True,
                 "done_reason": done_reason(finish_reason), **counters(finished[0] if finished else None, started_ns)})


def _loaded(name: str, generate: bool, keep_alive: Any) -> Response:
    """Ollama's answer to a request with nothing to generate: it loads (or with keep_alive 0 unloads)."""
    reason = "unload" if keep_alive in (0, "0", "0s", "0m") else "load"
    body: dict[str, Any] = {"model": name, "created_at": _now(), "done": True, "done_reason": reason}
    body.update({"response": ""} if generate else {"message": {"role": "assistant", "content": ""}})
    return _json(body)


# -- routes --------------------------------------------------------------------------------------
router = APIRouter()


@router.post("/api/chat")
async def chat(request: Request) -> Response:
    started = time.perf_counter_ns()
    body = await parse_body(request, ChatRequest)
    name = body.model
    if not body.messages:
        await request.app.state.models.preload(request, name, body.keep_alive)
        return _loaded(name, False, body.keep_alive)
    state = await serving_state(request, name, body.keep_alive)
    stream = body.stream is not False
    fields = {"messages": chat_messages(body.messages), "stream": stream, **sampling_fields(body)}
    if body.tools:
        fields["tools"] = body.tools
    with renamed_params(PARAMS):
        run = await start_chat(chat_request(fields), request, state, prefix="ollama")
    if stream:
        return event_stream(run.handle, chat_lines(run, name, started, False), state.config, done="",
                            error_event=error_line, media_type=NDJSON, keepalive=None)
    answer, output = await chat_response(run, request)
    choice = answer.choices[0]
    message: dict[str, Any] = {"role": "assistant", "content": choice.message.content or ""}
    if reasoning_of(choice.message):
        message["thinking"] = reasoning_of(choice.message)
    if choice.message.tool_calls:
        message["tool_calls"] = ollama_tool_calls([(c.function.name, c.function.arguments)
                                                   for c in choice.message.tool_calls])
    return _json({"model": name, "created_at": _now(), "message": message, "done": True,
                  "done_reason": done_reason(choice.finish_reason), **counters(output, started)})


@router.post("/api/generate")
async def generate(request: Request) -> Response:
    started = time.perf_counter_ns()
    body = await parse_body(request, GenerateRequest)
    for field, why in (("template", "Go templates (the model's own chat template is used)"),
                       ("context", "the deprecated context tokens (send the conversation to /api/chat)")):
        if getattr(body, field):
            raise bad_request(f"{field} is not supported: no {why}", param=field)
    if body.images and (body.raw or body.suffix):
        raise bad_request("images are read in the chat template's prompt, not with raw or suffix", param="images")
    name = body.model
    if not body.prompt:
        await request.app.state.models.preload(request, name, body.keep_alive)
        return _loaded(name, True, body.keep_alive)
    state = await serving_state(request, name, body.keep_alive)
    stream = body.stream is not False
    if body.raw or body.suffix:  # a suffix asks for the middle: the completion's fill-in-the-middle
        fim = {"suffix": body.suffix} if body.suffix else {}
        with renamed_params(PARAMS):
            run = await start_completion(completion_request({"prompt": body.prompt, "stream": stream, **fim,
                                                             **sampling_fields(body)}), request, state)
        if stream:
            return event_stream(run.handle, completion_lines(run, name, started), state.config, done="",
                                error_event=error_line, media_type=NDJSON, keepalive=None)
        answer, outputs = await completion_response(run, request)
        text, finish = answer.choices[0].text, answer.choices[0].finish_reason
        output = next(iter(outputs.values()))
        thinking = None
    else:
        user = image_content(body.prompt, body.images, "images") if body.images else body.prompt
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
            [{"role": "user", "content": user}]
        with renamed_params({**PARAMS, "messages": "prompt"}):
            run = await start_chat(chat_request({"messages": messages, "stream": stream, **sampling_fields(body)}),
                                   request, state, prefix="ollama")
        if stream:
            return event_stream(run.handle, chat_lines(run, name, started, True), state.config, done="",
                                error_event=error_line, media_type=NDJSON, keepalive=None)
        answer, output = await chat_response(run, request)
        text, finish = answer.choices[0].message.content or "", answer.choices[0].finish_reason
        thinking = reasoning_of(answer.choices[0].message)
    return _json({"model": name, "created_at": _now(), "response": text, "done": True,
                  "done_reason": done_reason(finish), **({"thinking": thinking} if thinking else {}),
                  **counters(output, started)})


@router.get("/api/version")
async def version() -> Response:
    return _json({"version": OLLAMA_API_VERSION})


@router.get("/api/tags")
async def tags(request: Request) -> Response:
    return _json({"models": await run_in_threadpool(request.app.state.models.tags)})


@router.get("/api/ps")
async def ps(request: Request) -> Response:
    return _json({"models": await run_in_threadpool(request.app.state.models.running)})


@router.post("/api/show")
async def show(request: Request) -> Response:
    body = await parse_body(request, ShowRequest)
    name = body.model or body.name
    if not name:
        raise bad_request("model is required", param="model")
    return _json(await request.app.state.models.describe(request, name))


def add_ollama_api(app: FastAPI, dependencies: list) -> None:
    """The routes, behind the server's key if it has one; their errors take Ollama's shape by their
    path (server/error_shapes.py)."""
    app.include_router(router, dependencies=dependencies)
