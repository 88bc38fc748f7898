"""The one engine loop of the server, and the handles request handlers hold.

The engine is not thread-safe, so a single thread owns it. Handlers never touch it: they put
commands (add, abort) on a thread-safe queue, and the thread runs them between steps, in order.
The engine is reached through its door (engine/client.py) and nothing else; handlers may call its
checks that read only fixed facts (`client.check_prompt`, `check_token_ids`, `cached_grammar`,
`compile_grammar`) from their own threads. Each step's outputs go back to the event loop in one `call_soon_threadsafe`,
into one asyncio queue per HTTP request. With nothing to run, the thread blocks on the command
queue, so an idle server costs nothing.

Admission is counted in sequences (a request of n choices takes n): up to `max_num_seqs` run and
up to `max_queue` more wait; beyond that `submit` refuses with a 429 at once.

What the engine's state looks like (running, waiting, KV blocks) is published by the thread after
every turn as `snapshot`, so that /metrics never queues work onto the thread that generates.
Engine failures reach clients as a generic message with an error id; the details go to the log.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from ..engine.client import EngineClient, EngineRequest, RequestOutput, StreamDelta
from ..llm import LLM
from .errors import APIError, bad_request, queue_full
from .metrics import ServerMetrics

logger = logging.getLogger("wallbreaker.server")
T = TypeVar("T")


@dataclass
class Finished:
    output: RequestOutput


@dataclass
class Failed:
    error: Exception


Event = StreamDelta | Finished | Failed
_STOP = object()


class RequestHandle:
    """The engine requests of one HTTP request (one a prompt); their events arrive on its event loop."""

    def __init__(self, owner: AsyncEngine, requests: list[EngineRequest], stream: bool):
        self.loop = asyncio.get_running_loop()
        self.stream = stream  # False: only Finished/Failed events are sent
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._owner = owner
        self._pending = {r.request_id: r.params.n for r in requests}  # request id -> sequences (seats)

    async def events(self, deadline: float | None = None) -> AsyncIterator[Event]:
        """Events until every request has finished; `TimeoutError` once the loop's clock passes
        `deadline`; a `Failed` event's error is raised."""
        while self._pending:
            if not self._queue.empty():
                event = self._queue.get_nowait()
            else:
                async with asyncio.timeout_at(deadline):
                    event = await self._queue.get()
            if isinstance(event, Failed):
                self._release(list(self._pending))
                raise event.error
            if isinstance(event, Finished):
                self._release([event.output.request_id])
            yield event

    def abort(self, reason: str = "abort") -> None:
        """Stop whatever is unfinished (no-op when all is done); its KV blocks are freed on the next
        turn of the engine loop."""
        if self._pending:
            pending = dict(self._pending)
            self._release(list(pending))
            self._owner._command(partial(self._owner._abort, pending, reason))

    def _release(self, request_ids: list[str]) -> None:
        self._owner._release_seats(sum(self._pending.pop(rid, 0) for rid in request_ids))

    def _receive(self, events: list[Event]) -> None:
        for event in events:
            self._queue.put_nowait(event)


class AsyncEngine:
    def __init__(self, llm: LLM, metrics: ServerMetrics | None = None, max_queue: int = 1024):
        self.client: EngineClient = llm.engine
        self.metrics = metrics or ServerMetrics()
        self.max_num_seqs = llm.config.max_num_seqs
        self.max_queue = max_queue
        self.snapshot: dict = self.client.live_stats()  # replaced (never mutated) by the engine thread
        self._seats_used = 0
        self._seats_lock = threading.Lock()
        self._commands: queue.SimpleQueue[Callable[[], None] | object] = queue.SimpleQueue()
        self._routes: dict[str, tuple[RequestHandle, int]] = {}  # request id -> (handle, n); engine thread only
        self._thread = threading.Thread(target=self._run, name="wallbreaker-engine", daemon=True)
        self._thread.start()

    # -- the event-loop side ---------------------------------------------------------------------
    def submit(self, requests: list[EngineRequest], stream: bool) -> RequestHandle:
        """Queue `requests` for the engine (all or none); raises a 429 `APIError` when the queue is full."""
        self._check_alive()
        need = sum(r.params.n for r in requests)
        if need > self.max_num_seqs + self.max_queue:
            raise bad_request(f"the request asks for {need} sequences, more than the server ever holds "
                              f"({self.max_num_seqs} running + {self.max_queue} waiting)", param="n")
        with self._seats_lock:
            if self._seats_used + need > self.max_num_seqs + self.max_queue:
                raise queue_full(self.max_queue)
            self._seats_used += need
        handle = RequestHandle(self, requests, stream)
        self._command(partial(self._add, handle, requests))
        return handle

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread between two steps (it may touch the engine's state, as saving
        or restoring a session does); its result, or its exception raised here."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(error: BaseException | None, result: object) -> None:
            if future.done():  # the handler went away (a disconnect, a timeout)
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        def run() -> None:
            try:
                result, error = fn(), None
            except Exception as e:
                result, error = None, e
            try:
                loop.call_soon_threadsafe(settle, error, result)
            except RuntimeError:  # the loop has closed: nobody is waiting any more
                pass
        self._command(run)
        return await future

    @property
    def queue_length(self) -> int:
        return max(0, self._seats_used - self.max_num_seqs)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; whatever is still in flight is aborted and its handlers told so."""
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout)

    def _check_alive(self) -> None:
        if not self._thread.is_alive():
            raise APIError(503, "the engine is shutting down", type="service_unavailable", code="shutting_down")

    def _command(self, fn: Callable[[], None]) -> None:
        self._commands.put(fn)

    def _release_seats(self, n: int) -> None:
        with self._seats_lock:
            self._seats_used -= n

    # -- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._run_commands(block=not self.client.has_unfinished()):
                if self.client.has_unfinished():
                    try:
                        self._step()
                    except Exception:
                        error_id = uuid.uuid4().hex[:16]
                        logger.exception("engine step failed (error id %s); failing the requests in flight", error_id)
                        self._fail_all(engine_failure(error_id))
                self.snapshot = self.client.live_stats()
        finally:
            self._run_late_commands()
            self._fail_all(APIError(503, "the server shut down before the request finished",
                                    type="service_unavailable", code="shutting_down"), reason="abort")

    def _run_commands(self, block: bool) -> bool:
        """Run queued commands (waiting for one if `block`); False once told to stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
            while True:
                if command is _STOP:
                    return False
                try:
                    command()
                except Exception:
                    logger.exception("engine command failed")
                command = self._commands.get_nowait()
        except queue.Empty:
            return True

    def _run_late_commands(self) -> None:
        """Commands queued behind the stop still run, so that no handler waits for an answer forever."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is not _STOP:
                try:
                    command()
                except Exception:
                    logger.exception("engine command failed")

    def _add(self, handle: RequestHandle, requests: list[EngineRequest]) -> None:
        added: list[str] = []
        try:
            for r in requests:
                self.client.add_request(r)
                added.append(r.request_id)
                self._routes[r.request_id] = (handle, r.params.n)
                self.metrics.on_added(len(r.prompt_token_ids))
        except Exception as e:
            for rid in added:
                self.client.abort(rid)
                self._routes.pop(rid, None)
            if isinstance(e, ValueError):
                error = bad_request(str(e))
            else:
                error_id = uuid.uuid4().hex[:16]
                logger.error("adding a request failed (error id %s)", error_id, exc_info=e)
                error = engine_failure(error_id)
            _deliver({handle: [Failed(error)]})

    def _abort(self, request_ids: Iterable[str], reason: str) -> None:
        for rid in request_ids:
            route = self._routes.pop(rid, None)
            if route is None:
                continue  # already finished
            self.client.abort(rid)
            self.metrics.on_ended_early(rid, route[1], reason)

    def _step(self) -> None:
        result = self.client.step()
        now = time.perf_counter()
        events: dict[RequestHandle, list[Event]] = defaultdict(list)
        for delta in result.deltas:
            self.metrics.on_delta(delta, now)
            route = self._routes.get(delta.request_id)
            if route is not None and route[0].stream:
                events[route[0]].append(delta)
        for output in result.finished:
            route = self._routes.pop(output.request_id, None)
            if route is None:
                continue
            handle, n = route
            if output.failure is not None:
                self.metrics.on_ended_early(output.request_id, n, "error")
                events[handle].append(Failed(engine_failure(output.failure.error_id)))
            else:
                self.metrics.on_finished(output)
                events[handle].append(Finished(output))
        self.snapshot = self.client.live_stats()  # before the answers: a client that then scrapes sees it
        _deliver(events)

    def _fail_all(self, error: Exception, reason: str = "error") -> None:
        events: dict[RequestHandle, list[Event]] = {}
        for rid, (handle, _) in list(self._routes.items()):
            try:
                self._abort([rid], reason)
            except Exception:  # the engine is in a bad way; still tell every handler
                logger.exception("aborting %s failed", rid)
                self._routes.pop(rid, None)
            events[handle] = [Failed(error)]
        self.snapshot = self.client.live_stats()
        _deliver(events)


def engine_failure(error_id: str) -> APIError:
    """What a client is told when the engine failed on its request: never the error text itself."""
    return APIError(500, f"the engine failed on this request (error id {error_id}; the server log has the details)",
                    type="internal_server_error", code="engine_error")


def _deliver(events: dict[RequestHandle, list[Event]]) -> None:
    """Hand each handle its events on its own event loop: one wake-up a loop per step."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, list[Event]]]] = defaultdict(list)
    for handle, handle_events in events.items():
        if handle_events:
            by_loop[handle.loop].append((handle, handle_events))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_receive_all, batch)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass


def _receive_all(batch: list[tuple[RequestHandle, list[Event]]]) -> None:
    for handle, events in batch:
        handle._receive(events)
