"""The models one server serves: one (`SingleModel`, loaded when the server starts, as `serve --model
PATH` has always done) or many (`ModelRouter`, `serve --models-dir DIR` / `--model NAME=PATH`).

Handlers reach a model through `serving_state(request, body.model)`: the router loads the model a
request names on first use (requests for a model that is loading wait for that one load; a load
runs in a thread, so requests to other models go on), keeps it while a request uses it (a lease,
released by `ModelLeases` once the response has been sent, a stream's last chunk included), and
unloads it once it has been idle for its `keep_alive` (Ollama's field and default, 5 minutes;
`keep_alive: 0` unloads as soon as the request is done; negative: never). Before a load would pass
the memory budget (`--max-memory-gb`), the least recently used idle models are unloaded. Each loaded
model has its own `ServerState`: its `LLM`, its engine thread (scheduler), its name in answers.
Where the models come from, and keep_alive's durations: server/model_sources.py.
"""
from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil
from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from ..config import ModelConfig
from ..errors import InvalidRequestError, WallbreakerError
from ..kv.cache import HEADROOM_GB
from ..llm import LLM
from .async_engine import AsyncEngine
from .config import ServerConfig
from .errors import APIError, bad_request
from ..lora.request import LoRARequest
from .lora_adapters import LoRAModule, ServedAdapters, adapter_view
from .metrics import ServerMetrics
from .model_sources import DEFAULT_KEEP_ALIVE_S, FOREVER, ModelSource, parse_keep_alive
from .ollama_models import model_entry, running_entry, show_body
from .responses import ModelCard
from .state import ServerState

logger = logging.getLogger("wallbreaker.server")

LOAD_PROGRESS_EVERY_S = 5.0  # a load still running says so in the log this often


def _keep_alive_of(value: Any) -> float | None:
    """A request's keep_alive (None: the server's), or a 400 naming it."""
    if value is None:
        return None
    try:
        return parse_keep_alive(value)
    except ValueError as e:
        raise bad_request(str(e), param="keep_alive") from None


def default_max_memory_bytes() -> int:
    """The budget for loaded models: the free memory now, less the headroom the KV pool's default leaves."""
    return max(int(psutil.virtual_memory().available - HEADROOM_GB * 2**30), 0)


def model_bytes(llm: LLM) -> int:
    """What a loaded model holds in memory: its weights, its KV pool, its recurrent state pool."""
    return llm.weight_bytes + llm.kv_cache.nbytes + (llm.states.nbytes if llm.states is not None else 0)


def open_state(llm: LLM, name: str, metrics: ServerMetrics, config: ServerConfig) -> ServerState:
    """A model's serving state: its engine thread starts now."""
    return ServerState(llm, AsyncEngine(llm, metrics, config.max_queue), metrics, name, config)


def close_state(state: ServerState) -> None:
    """Stop a model's engine thread (failing whatever it still runs) and its grammar workers."""
    state.engine.shutdown()
    state.grammar_pool.shutdown(wait=False, cancel_futures=True)
    state.llm.shutdown()


def release_memory() -> None:
    """Collect what an unloaded model left and hand the heap's free pages back to the OS."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


# -- the leases: a model stays loaded while a response that uses it is being sent ----------------
_LEASES = "model_leases"
_load_wait: ContextVar[int] = ContextVar("wallbreaker_load_wait_ns", default=0)


def load_wait_ns() -> int:
    """Nanoseconds the request being handled waited for its model to load (Ollama's `load_duration`)."""
    return _load_wait.get()


class ModelLeases:
    """Releases the models a request acquired once its response has been sent (for a stream: after
    its last chunk, or after the client left)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        leases: list[Callable[[], None]] = []
        scope.setdefault("state", {})[_LEASES] = leases
        try:
            await self.app(scope, receive, send)
        finally:
            for release in leases:
                release()


async def serving_state(request: Request, model: str | None, keep_alive: Any = None) -> ServerState:
    """The state of the model a request names (loading it if need be), held until its response is sent."""
    return await request.app.state.models.acquire(request, model, _keep_alive_of(keep_alive))


# -- one model: today's server -------------------------------------------------------------------
class SingleModel:
    """The one model loaded when the server started: every request gets it, whatever model it names
    (clients send the names they were made for, as Claude Code's `claude-opus-...`)."""

    def __init__(self, state: ServerState):
        self.state = state
        self.adapters = ServedAdapters(state)  # a name of one of them means the model with that adapter
        registry = state.llm.engine.loras
        for adapter in registry.adapters.values() if registry is not None else ():
            self.adapters.add_view(adapter.name, adapter.path)

    async def acquire(self, request: Request, model: str | None, keep_alive: float | None = None) -> ServerState:
        return self.adapters.view(model) or self.state

    async def preload(self, request: Request, model: str | None, keep_alive: Any) -> None:
        _keep_alive_of(keep_alive)  # checked; the model stays loaded while the server runs

    async def describe(self, request: Request, model: str | None) -> dict:
        return await run_in_threadpool(show_body, self.state)  # it hashes the file, once

    def states(self) -> list[ServerState]:
        return [self.state]

    def cards(self) -> list[ModelCard]:
        base = self.state.model_name
        return [ModelCard(id=base, max_model_len=self.state.llm.max_model_len)] + \
            [ModelCard(id=name, max_model_len=self.state.llm.max_model_len, parent=base) for name in self.adapters.views]

    def tags(self) -> list[dict]:
        return [model_entry(self.state)]

    def running(self) -> list[dict]:
        return [running_entry(self.state)]

    async def shutdown(self) -> None:
        self.state.engine.shutdown()  # the LLM is the caller's: it may use it again
        self.state.grammar_pool.shutdown(wait=False, cancel_futures=True)


# -- many models ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class UnloadedModel:
    """What the listings (server/ollama_models.py) read of an `LLM`, for a model that is not loaded:
    read once from its files, no weights loaded."""
    model_path: Path
    model_config: ModelConfig
    chat_template: Any  # text.chat_template.ChatTemplate
    max_model_len: int
    takes_images: bool = False  # its vision encoder is found when it loads


@dataclass(frozen=True)
class UnloadedState:
    """An unloaded model in the place of its `ServerState`, for the listings."""
    llm: UnloadedModel
    model_name: str


@dataclass(eq=False)
class Slot:
    """One model's place in the router; touched only on the event loop."""
    source: ModelSource
    state: ServerState | None = None
    loading: asyncio.Future | None = None  # the load in flight, awaited by every request for it
    unloading: asyncio.Future | None = None
    active: int = 0  # requests holding it
    last_used: float = 0.0  # monotonic
    keep_alive: float = DEFAULT_KEEP_ALIVE_S
    expires_at: float | None = None  # wall clock; None: not counting down
    timer: asyncio.TimerHandle | None = None
    size: int | None = None  # bytes once loaded (an estimate from its files before)
    described: UnloadedState | None = None  # what /api/tags and /api/show say of it unloaded, read once


class ModelRouter:
    """Many models in one process, each with its own engine thread, loaded on demand."""

    def __init__(self, sources: list[ModelSource], load: Callable[[ModelSource], LLM],
                 keep_alive: float = DEFAULT_KEEP_ALIVE_S, max_memory_bytes: int | None = None,
                 extra_bytes: int = 0, lora_modules: list[LoRAModule] = ()):
        """`load` makes a source's LLM (it runs in a worker thread); `extra_bytes` is added to a
        model's file size to estimate its first load (a fixed KV pool's size). `lora_modules`: adapters
        served as models of their own, each on its base model (loaded with `enable_lora`), the adapter
        read when a request first names it."""
        if not sources:
            raise WallbreakerError("no models to serve: --models-dir found none and no --model was given")
        if not keep_alive >= 0:
            raise InvalidRequestError(f"keep_alive must be >= 0 seconds (math.inf: forever), got {keep_alive}")
        if max_memory_bytes is not None and max_memory_bytes <= 0:
            raise InvalidRequestError(f"the memory budget must be positive, got {max_memory_bytes} bytes")
        self.slots = {s.name: Slot(s, keep_alive=keep_alive) for s in sources}
        self.adapters: dict[str, tuple[str, LoRARequest]] = {}  # adapter name -> (its base's name, request)
        for i, m in enumerate(lora_modules, start=1):
            base = m.base or (next(iter(self.slots)) if len(self.slots) == 1 else None)
            if base not in self.slots:
                raise WallbreakerError(f"--lora-modules {m.name}: name its base model, one of {', '.join(self.slots)} "
                                       f"(the JSON form's base_model_name)")
            if m.name in self.slots or m.name in self.adapters:
                raise WallbreakerError(f"--lora-modules {m.name}: the name is already a model's")
            self.adapters[m.name] = (base, LoRARequest(m.name, i, m.path))
        for s in sources:
            s.remember_digest()
        self.load_fn = load
        self.keep_alive = keep_alive
        self.max_memory_bytes = default_max_memory_bytes() if max_memory_bytes is None else max_memory_bytes
        self.extra_bytes = extra_bytes
        self.metrics = ServerMetrics()
        self.config = ServerConfig()
        self._workers = ThreadPoolExecutor(4, thread_name_prefix="wallbreaker-load")
        self._room = asyncio.Lock()
        self._closed = False

    def attach(self, metrics: ServerMetrics, config: ServerConfig) -> None:
        """The app's metrics and settings, which every model's state shares."""
        self.metrics, self.config = metrics, config

    def announce(self) -> None:
        keep = "forever" if self.keep_alive == FOREVER else f"{self.keep_alive:g} s"
        logger.info("serving %d models, each loaded when a request names it (keep_alive %s, memory budget %.1f GB): %s",
                    len(self.slots), keep, self.max_memory_bytes / 2**30, ", ".join(self.slots))

    # -- finding a model -------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self.slots)

    def slot(self, model: str | None) -> Slot:
        """The slot a request's model names: with one model, any name (or none) is that model; with
        several, a name (Ollama's `name:latest` too) or a 404 naming the ones served."""
        if model in self.adapters:
            return self.slots[self.adapters[model][0]]
        if len(self.slots) == 1:
            return next(iter(self.slots.values()))
        available = ", ".join(f"'{n}'" for n in self.slots)
        if not model:
            raise bad_request(f"model is required: this server serves {available}", param="model")
        found = self.slots.get(model) or self.slots.get(model.removesuffix(":latest"))
        if found is None:
            raise APIError(404, f"the model '{model}' does not exist; this server serves {available}",
                           type="not_found_error", param="model", code="model_not_found")
        return found

    # -- using a model ---------------------------------------------------------------------------
    async def acquire(self, request: Request, model: str | None, keep_alive: float | None = None) -> ServerState:
        slot = self.slot(model)
        leases = request.scope.setdefault("state", {}).setdefault(_LEASES, [])
        state = await self._hold(slot)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._release(slot, keep_alive)
        leases.append(release)
        return adapter_view(state, self.adapters[model][1]) if model in self.adapters else state

    async def _hold(self, slot: Slot) -> ServerState:
        slot.active += 1  # held from now: a model loading for a request is not idle (never evicted)
        started = time.perf_counter_ns() if slot.state is None else None
        try:
            while slot.state is None:
                if self._closed:
                    raise APIError(503, "the server is shutting down", type="service_unavailable",
                                   code="shutting_down")
                if slot.loading is None:
                    slot.loading = asyncio.ensure_future(self._load(slot))
                    slot.loading.add_done_callback(lambda task: task.cancelled() or task.exception())
                await asyncio.shield(slot.loading)
        except BaseException:
            self._release(slot, None)
            raise
        slot.last_used = time.monotonic()
        self._stop_countdown(slot)
        if started is not None:
            _load_wait.set(time.perf_counter_ns() - started)
        return slot.state

    def _release(self, slot: Slot, keep_alive: float | None) -> None:
        slot.active -= 1
        slot.last_used = time.monotonic()
        slot.keep_alive = self.keep_alive if keep_alive is None else keep_alive  # the last request's holds, as in Ollama
        if slot.active == 0 and slot.state is not None:
            self._start_countdown(slot)

    def _start_countdown(self, slot: Slot) -> None:
        self._stop_countdown(slot)
        if slot.keep_alive == FOREVER:
            return
        slot.expires_at = time.time() + slot.keep_alive
        slot.timer = asyncio.get_running_loop().call_later(slot.keep_alive, self._expire, slot)

    def _stop_countdown(self, slot: Slot) -> None:
        if slot.timer is not None:
            slot.timer.cancel()
        slot.timer, slot.expires_at = None, None

    def _expire(self, slot: Slot) -> None:
        slot.timer = None
        if slot.active == 0 and slot.state is not None:
            asyncio.ensure_future(self._unload(slot, f"idle for its keep_alive ({slot.keep_alive:g} s)"))

    async def preload(self, request: Request, model: str | None, keep_alive: Any) -> None:
        """Ollama's request with nothing to generate: load the model (held for `keep_alive`), or with
        `keep_alive: 0` unload it now (if no request is using it)."""
        seconds = _keep_alive_of(keep_alive)
        slot = self.slot(model)
        if seconds == 0:
            slot.keep_alive = 0.0
            if slot.loading is not None:
                await asyncio.shield(slot.loading)
            if slot.state is not None and slot.active == 0:
                await self._unload(slot, "keep_alive 0")
            return
        await self.acquire(request, model, seconds)

    # -- loading and unloading -------------------------------------------------------------------
    async def _load(self, slot: Slot) -> None:
        name, loop = slot.source.name, asyncio.get_running_loop()
        try:
            if slot.unloading is not None:
                await asyncio.shield(slot.unloading)  # its memory is handed back before it is taken again
            estimate = slot.size if slot.size is not None else \
                await loop.run_in_executor(self._workers, slot.source.disk_bytes) + self.extra_bytes
            async with self._room:
                await self._make_room(estimate, slot)
                slot.size = estimate  # counted against the budget while it loads
            logger.info("loading model '%s' from %s (about %.0f MB)", name, slot.source.model, estimate / 1e6)
            started = time.perf_counter()
            work = loop.run_in_executor(self._workers, self._open, slot.source)
            while True:
                try:
                    state = await asyncio.wait_for(asyncio.shield(work), LOAD_PROGRESS_EVERY_S)
                    break
                except TimeoutError:
                    logger.info("still loading model '%s' (%.0f s)", name, time.perf_counter() - started)
            if self._closed:
                await loop.run_in_executor(self._workers, close_state, state)
                return
            slot.size = model_bytes(state.llm)
            slot.state, slot.last_used = state, time.monotonic()
            logger.info("loaded model '%s' in %.1f s: %.0f MB (weights %.0f MB, KV pool %.0f MB)", name,
                        time.perf_counter() - started, slot.size / 1e6, state.llm.weight_bytes / 1e6,
                        state.llm.kv_cache.nbytes / 1e6)
            if slot.active == 0:  # every request that waited for it has gone
                self._start_countdown(slot)
            try:
                async with self._room:
                    await self._make_room(0, slot)  # its real size may pass what was estimated
            except Exception:
                logger.exception("making room after loading model '%s' failed", name)
        except Exception as e:
            if slot.state is None:
                slot.size = None
            logger.error("loading model '%s' failed: %s", name, e, exc_info=not isinstance(e, WallbreakerError))
            detail = " ".join(str(e).split())  # one line, whatever the error's own text
            detail = detail if len(detail) <= 300 else detail[:300] + "..."
            raise APIError(500, f"the model '{name}' could not be loaded: {detail or type(e).__name__}",
                           type="server_error", param="model", code="model_load_failed") from e
        finally:
            slot.loading = None

    def _open(self, source: ModelSource) -> ServerState:
        """On a worker thread: load the model and start its engine thread."""
        llm = self.load_fn(source)
        return open_state(llm, source.name, self.metrics, self.config)

    def _in_use_bytes(self, besides: Slot) -> int:
        return sum(s.size or 0 for s in self.slots.values()
                   if s is not besides and (s.state is not None or s.loading is not None or s.unloading is not None))

    async def _make_room(self, needed: int, loading: Slot) -> None:
        """Unload idle models, least recently used first, until `needed` more bytes (0: `loading`'s
        size, once it is loaded) fit the budget.
        Models in use are never unloaded: past them the load goes on over the budget, with a warning."""
        needed = needed or loading.size or 0
        while self._in_use_bytes(loading) + needed > self.max_memory_bytes:
            idle = [s for s in self.slots.values() if s is not loading and s.state is not None and s.active == 0]
            if not idle:
                logger.warning("model '%s' passes the memory budget (%.0f MB): the other loaded models are in use",
                               loading.source.name, self.max_memory_bytes / 1e6)
                return
            victim = min(idle, key=lambda s: s.last_used)
            await self._unload(victim, f"to make room for '{loading.source.name}'")

    async def _unload(self, slot: Slot, reason: str) -> None:
        state = slot.state
        if state is None:
            return
        slot.state = None
        self._stop_countdown(slot)
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        slot.unloading = done
        try:
            await loop.run_in_executor(self._workers, close_state, state)
            del state
            await loop.run_in_executor(self._workers, release_memory)
            logger.info("unloaded model '%s' (%s)", slot.source.name, reason)
        finally:
            slot.unloading = None
            done.set_result(None)

    async def shutdown(self) -> None:
        self._closed = True
        for slot in self.slots.values():
            if slot.loading is not None:
                try:
                    await asyncio.shield(slot.loading)
                except Exception:
                    pass
            await self._unload(slot, "the server stops")
        self._workers.shutdown(wait=False)

    # -- what the listings say -------------------------------------------------------------------
    def states(self) -> list[ServerState]:
        return [s.state for s in self.slots.values() if s.state is not None]

    def loaded(self) -> list[str]:
        return [name for name, s in self.slots.items() if s.state is not None]

    def cards(self) -> list[ModelCard]:
        def length(s: Slot) -> int | None:
            return s.state.llm.max_model_len if s.state is not None else None
        return [ModelCard(id=name, max_model_len=length(s)) for name, s in self.slots.items()] + \
            [ModelCard(id=name, max_model_len=length(self.slots[base]), parent=base)
             for name, (base, _) in self.adapters.items()]

    def tags(self) -> list[dict]:
        """Ollama's /api/tags: every model served, loaded or not (run in a worker thread: it may read files)."""
        return [self._entry(s) for s in self.slots.values()]

    def running(self) -> list[dict]:
        """Ollama's /api/ps: the loaded models, each with when it will be unloaded (`expires_at`;
        while requests use it, their keep_alive from now)."""
        out = []
        for slot in list(self.slots.values()):
            state = slot.state
            if state is None:
                continue
            entry = running_entry(state)
            expires = slot.expires_at
            if expires is None and slot.keep_alive != FOREVER:
                expires = time.time() + slot.keep_alive
            entry["expires_at"] = None if expires is None else _iso(expires)
            out.append(entry)
        return out

    async def describe(self, request: Request, model: str | None) -> dict:
        """Ollama's /api/show, from a loaded model or from its files (never loading it)."""
        slot = self.slot(model)
        if slot.state is not None:
            return await run_in_threadpool(show_body, slot.state)
        try:
            return await run_in_threadpool(lambda: show_body(self._described(slot)))
        except WallbreakerError as e:
            raise APIError(500, f"the model '{slot.source.name}' cannot be read: {e}", type="server_error",
                           param="model", code="model_load_failed") from None

    def _described(self, slot: Slot) -> UnloadedState:
        """A stand-in for an unloaded model's state, with what the listings read (read once)."""
        if slot.described is None:
            from ..formats import open_model
            files = open_model(slot.source.model)
            llm = UnloadedModel(files.path, files.config, files.chat_template, files.config.max_position_embeddings)
            slot.described = UnloadedState(llm, slot.source.name)
        return slot.described

    def _entry(self, slot: Slot) -> dict:
        state = slot.state
        if state is not None:
            return model_entry(state)
        try:
            entry = model_entry(self._described(slot))
        except WallbreakerError as e:  # a file that cannot be read is still listed, as what it is
            logger.warning("model '%s': %s", slot.source.name, e)
            files = slot.source.files()
            listed = f"{slot.source.name}:latest"
            modified = max((f.stat().st_mtime for f in files), default=0.0)
            return {"name": listed, "model": listed, "modified_at": _iso(modified), "size": slot.source.disk_bytes(),
                    "digest": "", "details": {"parent_model": "", "format": "", "family": "", "families": [],
                                              "parameter_size": "", "quantization_level": "unknown"}}
        return entry


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def combined_stats(states: list[ServerState]) -> tuple[dict, int]:
    """The engines' published snapshots summed (counts, blocks, disk counters; rates: the largest),
    and their queues' length: what /metrics shows for all the models loaded."""
    total: dict[str, float] = {}
    queue = 0
    for state in states:
        for key, value in state.engine.snapshot.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if key.endswith(("_rate", "_fraction")):
                    total[key] = max(total.get(key, 0.0), value)
                else:
                    total[key] = total.get(key, 0) + value
        queue += state.engine.queue_length
    return total, queue


def kv_bytes_by_dtype(states: list[ServerState]) -> dict[str, int]:
    out: dict[str, int] = {}
    for state in states:
        dtype = str(state.llm.kv_cache.dtype).removeprefix("torch.")
        out[dtype] = out.get(dtype, 0) + state.llm.kv_cache.nbytes
    return out
