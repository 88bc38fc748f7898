"""LoRA adapters served as models of their own (vLLM's `--lora-modules` and its runtime endpoints):
a request whose `model` names an adapter runs on the base model with that adapter, on every API.

An adapter's serving state is the base model's with two things changed: its name in answers, and an
engine door that stamps the adapter onto every request it submits (`AdapterEngine`); handlers are
the same code for both. Adapters are loaded and unloaded on the engine thread, between steps
(`AsyncEngine.call`); a bad adapter is a 400 naming what is wrong, and nothing changes."""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from ..engine.client import EngineRequest
from ..lora.request import LoRARequest
from .async_engine import AsyncEngine, RequestHandle
from .errors import APIError, bad_request
from .state import ServerState


class AdapterEngine:
    """The base model's `AsyncEngine`, every request it submits run with `lora`."""

    def __init__(self, engine: AsyncEngine, lora: LoRARequest):
        self._engine, self.lora = engine, lora

    def submit(self, requests: list[EngineRequest], stream: bool) -> RequestHandle:
        return self._engine.submit([dataclasses.replace(r, lora_request=self.lora) for r in requests], stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def adapter_view(base: ServerState, lora: LoRARequest) -> ServerState:
    """The base model's serving state answering as the adapter, its requests run with it."""
    view = copy.copy(base)
    view.engine = AdapterEngine(base.engine, lora)
    view.model_name = lora.lora_name
    return view


@dataclasses.dataclass(frozen=True)
class LoRAModule:
    """`serve --lora-modules`: an adapter served as model `name`, on `base` (None: the one model served)."""
    name: str
    path: str
    base: str | None = None


class ServedAdapters:
    """The adapters of one served model, by name."""

    def __init__(self, base: ServerState):
        self.base = base
        self.views: dict[str, ServerState] = {}
        self._ids = 0

    @property
    def enabled(self) -> bool:
        return self.base.llm.config.enable_lora

    def view(self, name: str | None) -> ServerState | None:
        return self.views.get(name) if name else None

    def add_view(self, name: str, path: str) -> None:
        """Serve an adapter the engine has loaded under `name`."""
        self._ids += 1
        self.views[name] = adapter_view(self.base, LoRARequest(name, self._ids, str(path)))

    async def load(self, name: str, path: str) -> None:
        if not self.enabled:
            raise bad_request("LoRA adapters are not enabled on this server (serve --enable-lora)")
        if name == self.base.model_name or name in self.views:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        client = self.base.engine.client
        await self.base.engine.call(lambda: client.load_lora_adapter(name, path))
        self.add_view(name, path)

    async def unload(self, name: str) -> None:
        if name not in self.views:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", type="NotFoundError",
                           param="lora_name", code=404)
        client = self.base.engine.client

        def unload() -> None:
            if name in client.lora_adapters():  # else evicted for another already (read again when asked for)
                client.unload_lora_adapter(name)
        await self.base.engine.call(unload)
        del self.views[name]


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def add_lora_routes(app: FastAPI, dependencies: list) -> None:
    """vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter, with its answers."""

    def adapters(request: Request) -> ServedAdapters:
        found = getattr(request.app.state.models, "adapters", None)
        if found is None:
            raise bad_request("loading LoRA adapters at run time needs one model served (serve --model PATH "
                              "--enable-lora); with several, serve them with --lora-modules")
        return found

    @app.post("/v1/load_lora_adapter", dependencies=dependencies)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
        if not body.lora_name or not body.lora_path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.")
        await adapters(request).load(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=dependencies)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
        await adapters(request).unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
