"""POST /v1/chat/completions: the messages through the model's chat template, one engine request.

With tools (server/tools.py) the answer's calls come back as `tool_calls`, with finish_reason
"tool_calls"; streamed, as deltas the official client assembles: a call's first delta carries its
index, id, type and name, the next ones pieces of its arguments. A reasoning model's thinking
(server/reasoning.py) comes apart, in `reasoning_content`; tool calls are read from the answer only."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request, Response
from starlette.concurrency import run_in_threadpool

from ..engine.client import RequestOutput
from .access_log import AccessRecord
from ..engine.client import EngineRequest
from .async_engine import RequestHandle
from .logprobs import chat_logprobs
from .prompts import chat_prompt_images, within_context
from .protocol import ChatCompletionRequest
from .harmony import HarmonyReasoning, HarmonyStream, is_harmony
from .reasoning import ReasoningParser, ReasoningStream
from .request_params import chat_params
from .responses import (AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionResponse, ChatStreamChoice,
                        DeltaFunctionCall, DeltaMessage, DeltaToolCall, FunctionCallOut, ToolCallOut, Usage,
                        cached_tokens)
from .state import ServerState
from .streaming import collect, deltas, event_stream, sse
from .tools import Call, ToolPlan, ToolStream, plan_tools


@dataclass
class ChatRun:
    """One chat request handed to the engine: what its answer is translated with. The other APIs
    (Anthropic's Messages, Ollama's chat, OpenAI's Responses) build a `ChatCompletionRequest`, start it
    here, and translate the chat answer or its chunks into their own shapes."""

    state: ServerState
    handle: RequestHandle
    engine_request: EngineRequest
    access: AccessRecord
    deadline: float | None
    plan: ToolPlan | None
    parallel: bool
    reasoning: ReasoningParser | HarmonyReasoning | None  # the chat template's thinking style, if it has one

    @property
    def chat_id(self) -> str:
        return self.engine_request.request_id

    @property
    def prompt_tokens(self) -> int:
        return len(self.engine_request.prompt_token_ids)


async def start_chat(body: ChatCompletionRequest, request: Request, state: ServerState, prefix: str = "chatcmpl"
                     ) -> ChatRun:
    """Check the request, render its prompt, compile its constraint and queue it on the engine."""
    access, chat_id, deadline = state.admit(request, prefix)
    plan = plan_tools(body, state.llm.chat_template)
    params, source = chat_params(body, plan.spec if plan is not None and plan.forced else None)
    template_source = state.llm.chat_template.source
    reasoning = HarmonyReasoning() if is_harmony(template_source) else ReasoningParser.for_template(template_source)
    if isinstance(reasoning, HarmonyReasoning) or (plan is not None and plan.choice == "auto"
                                                  and plan.parser.special_markers):
        params.skip_special_tokens = False  # the markers to read are special tokens
    text, ids, images = await run_in_threadpool(chat_prompt_images, state, body.messages, plan,
                                                body.chat_template_kwargs)
    params = within_context(state, params, len(ids))
    grammar = await state.compile_grammar(params.structured_outputs, source)
    engine_request = EngineRequest(ids, params, text, chat_id, body.cache_salt, grammar, images=tuple(images))
    access.prompt_tokens = len(ids)
    handle = state.engine.submit([engine_request], stream=bool(body.stream))
    return ChatRun(state, handle, engine_request, access, deadline, plan, body.parallel_tool_calls is not False,
                   reasoning)


async def chat_response(run: ChatRun, request: Request) -> tuple[ChatCompletionResponse, RequestOutput]:
    """The whole answer, and the engine's output it came from (its metrics, stop reasons)."""
    state, params = run.state, run.engine_request.params
    output = (await collect(run.handle, request, run.deadline, state.request_timeout))[run.chat_id]
    choices = []
    for c in output.outputs:
        answer, thinking = c.text, None
        if run.reasoning is not None:
            split = run.reasoning.split(c.text, run.engine_request.prompt)
            answer, thinking = split.content, split.reasoning or None
        message, finish_reason = _message(run.plan, answer, c.finish_reason, run.parallel)
        message.reasoning_content = thinking
        logprobs = None
        if params.logprobs is not None:
            logprobs = chat_logprobs(state.strings, c.token_ids, c.logprobs or [], c.top_logprobs or [])
        choices.append(ChatChoice(index=c.index, message=message, finish_reason=finish_reason, logprobs=logprobs))
    usage = _usage(output)
    run.access.completion_tokens = usage.completion_tokens
    run.access.ttft_s = output.metrics.get("ttft_s")
    return ChatCompletionResponse(id=run.chat_id, model=state.model_name, choices=choices, usage=usage), output


async def create_chat_completion(body: ChatCompletionRequest, request: Request, state: ServerState) -> Response:
    run = await start_chat(body, request, state)
    if body.stream:
        chunks = (sse(c) async for c in chat_chunks(run, body.include_usage, []))
        return event_stream(run.handle, chunks, state.config)
    body_out, _ = await chat_response(run, request)
    return Response(body_out.model_dump_json(), media_type="application/json")


def _message(plan: ToolPlan | None, text: str, finish_reason: str | None,
             parallel: bool) -> tuple[AssistantMessage, str | None]:
    if plan is None:
        return AssistantMessage(content=text), finish_reason
    content, calls = plan.calls_from_output(text)
    if not parallel:
        calls = calls[:1]
    if not calls:
        return AssistantMessage(content=text), finish_reason
    out = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls]
    return AssistantMessage(content=content, tool_calls=out), _calls_finish(finish_reason)


def _calls_finish(finish_reason: str | None) -> str | None:
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _call_deltas(calls: list[Call], first_index: int = 0) -> list[DeltaToolCall]:
    return [DeltaToolCall(index=first_index + i, id=c.id, type="function",
                          function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
            for i, c in enumerate(calls)]


class _ChoiceStream:
    """What one streamed choice sends, by the request's tool plan: content as it comes (no tools),
    a named call's arguments as they come, a required call list or auto calls once complete."""

    def __init__(self, plan: ToolPlan | None, parallel: bool, reasoning: ReasoningStream | HarmonyStream | None = None):
        self.plan = plan
        self.reasoning = reasoning
        self.parallel = parallel
        self.auto = ToolStream(plan.parser) if plan is not None and plan.choice == "auto" else None
        self.named: Call | None = Call(plan.name, "") if plan is not None and plan.choice == "named" else None
        self.started = False
        self.held = ""  # a required list of calls, until it is complete

    def piece(self, text: str) -> DeltaMessage | None:
        if self.reasoning is None:
            return self._answer(text)
        split = self.reasoning.feed(text)
        return _with_reasoning(self._answer(split.content), split.reasoning)

    def flush(self) -> DeltaMessage | None:
        """What the reasoning split held back (a possible tag), at the end of the output."""
        if self.reasoning is None:
            return None
        split = self.reasoning.finish()
        return _with_reasoning(self._answer(split.content), split.reasoning)

    def _answer(self, text: str) -> DeltaMessage | None:
        if self.plan is None:
            return DeltaMessage(content=text) if text else None
        if self.named is not None:
            if not text:
                return None
            first = not self.started
            self.started = True
            return DeltaMessage(tool_calls=[DeltaToolCall(
                index=0, id=self.named.id if first else None, type="function" if first else None,
                function=DeltaFunctionCall(name=self.named.name if first else None, arguments=text))])
        if self.auto is not None:
            content = self.auto.feed(text)
            return DeltaMessage(content=content) if content else None
        self.held += text
        return None

    def finish(self, finish_reason: str | None) -> tuple[DeltaMessage | None, str | None]:
        """The last delta before the finish, and the finish reason to send."""
        if self.plan is None:
            return None, finish_reason
        if self.named is not None:
            if not self.started:  # nothing generated: still a call, with empty arguments
                return DeltaMessage(tool_calls=_call_deltas([self.named])), _calls_finish(finish_reason)
            return None, _calls_finish(finish_reason)
        if self.auto is not None:
            content, calls = self.auto.finish()
        else:
            content, calls = self.plan.calls_from_output(self.held)
            content = self.held if not calls else None
        if not self.parallel:
            calls = calls[:1]
        if calls:
            return DeltaMessage(tool_calls=_call_deltas(calls)), _calls_finish(finish_reason)
        return (DeltaMessage(content=content) if content else None), finish_reason


def _with_reasoning(delta: DeltaMessage | None, reasoning: str) -> DeltaMessage | None:
    if not reasoning:
        return delta
    delta = delta or DeltaMessage()
    delta.reasoning_content = reasoning
    return delta


async def chat_chunks(run: ChatRun, include_usage: bool, finished: list[RequestOutput]
                      ) -> AsyncIterator[ChatCompletionChunk]:
    """The streamed answer's chunks; each request's final output is appended to `finished` as it ends."""
    state, chat_id, params, plan = run.state, run.chat_id, run.engine_request.params, run.plan

    def chunk(choices: list[ChatStreamChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=chat_id, model=state.model_name, choices=choices, usage=usage)

    yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                 for i in range(params.n)])
    streams = {i: _ChoiceStream(plan, run.parallel, run.reasoning.stream(run.engine_request.prompt)
                                if run.reasoning is not None else None) for i in range(params.n)}
    async for event in deltas(run.handle, run.access, run.deadline, finished):
        logprobs = None
        if params.logprobs is not None and event.token_ids:
            logprobs = chat_logprobs(state.strings, event.token_ids, event.logprobs, event.top_logprobs)
        stream = streams[event.index]
        delta = stream.piece(event.text)
        if delta is not None or logprobs is not None:
            yield chunk([ChatStreamChoice(index=event.index, delta=delta or DeltaMessage(), logprobs=logprobs)])
        if event.finish_reason is not None:
            flushed = stream.flush()
            if flushed is not None:
                yield chunk([ChatStreamChoice(index=event.index, delta=flushed)])
            last, reason = stream.finish(event.finish_reason)
            if last is not None:
                yield chunk([ChatStreamChoice(index=event.index, delta=last)])
            yield chunk([ChatStreamChoice(index=event.index, delta=DeltaMessage(), finish_reason=reason)])
    if include_usage and finished:
        yield chunk([], _usage(finished[0]))


def _usage(output: RequestOutput) -> Usage:
    return Usage.of(len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs), cached_tokens(output))
