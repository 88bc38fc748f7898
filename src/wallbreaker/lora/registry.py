"""The adapters a model has loaded, each bound into its linear layers under a slot (1..max_loras; 0
is the base model). A sequence carries its adapter's slot, which the model runner turns into the
step's row groups (layers/lora.py), and its adapter's key, which the prefix cache chains into its
blocks' hashes (kv/block_pool.py `salt_digest`): a digest of the adapter's weights, so blocks
computed with one adapter never serve another or the base model, even across processes (the disk
tier)."""
from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..errors import InvalidRequestError
from ..layers.lora import LoRARows, LoRAWeights
from .adapter import Adapter, read_adapter
from .request import LoRARequest


@dataclass
class LoadedAdapter:
    name: str
    path: str
    slot: int
    rank: int
    key: bytes  # the digest of its weights and scale
    int_id: int = 0
    last_used: int = 0


class LoRARegistry:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int,
                 in_use: Callable[[int], bool] = lambda slot: False):
        """`in_use(slot)`: whether an unfinished sequence runs with that slot's adapter (such an
        adapter is neither evicted nor unloaded)."""
        if max_loras < 1 or max_lora_rank < 1:
            raise InvalidRequestError("max_loras and max_lora_rank must be at least 1")
        self.config = model.config
        self.model = model
        self.max_loras, self.max_lora_rank, self.in_use = max_loras, max_lora_rank, in_use
        self.rows = LoRARows()
        self.targets: dict[str, _Target] = {}
        layers = getattr(model, "layers", None)
        for module in layers.modules() if isinstance(layers, nn.Module) else ():
            segments = getattr(module, "lora_segments", None)
            if segments is None:
                continue
            module.lora_rows, module.lora = self.rows, None
            first = 0
            for j, (name, rows) in enumerate(segments):
                self.targets[name] = _Target(module, first, rows, j, len(segments))
                first += rows
        if not self.targets:
            raise InvalidRequestError(f"enable_lora: this model ({type(model).__name__}) has no projections that "
                                      f"LoRA adapters can adapt")
        model.lora_rows = self.rows
        self.adapters: dict[str, LoadedAdapter] = {}
        self._clock = itertools.count(1)

    def resolve(self, request: LoRARequest) -> LoadedAdapter:
        """The adapter a request names, loaded from its `lora_path` the first time."""
        loaded = self.adapters.get(request.lora_name)
        if loaded is None:
            if not request.lora_path:
                raise InvalidRequestError(f"LoRA adapter {request.lora_name!r} is not loaded and the request "
                                          f"gives no lora_path")
            loaded = self.load(request.lora_name, request.lora_path, request.lora_int_id)
        elif request.lora_path and request.lora_path != loaded.path:
            raise InvalidRequestError(f"LoRA adapter {request.lora_name!r} is loaded from {loaded.path}, "
                                      f"not {request.lora_path}")
        loaded.last_used = next(self._clock)
        return loaded

    def load(self, name: str, path: str, int_id: int = 0) -> LoadedAdapter:
        """Read, check and bind an adapter; on any error nothing changes."""
        if not isinstance(name, str) or not name:
            raise InvalidRequestError("a LoRA adapter needs a non-empty name")
        if name in self.adapters:
            raise InvalidRequestError(f"The lora adapter '{name}' has already been loaded.")
        adapter = read_adapter(path, self.config)
        if adapter.rank > self.max_lora_rank:
            raise InvalidRequestError(f"LoRA adapter {path}: rank {adapter.rank} is above max_lora_rank "
                                      f"{self.max_lora_rank}")
        writes = self._checked_pairs(path, adapter)
        slot = self._free_slot()
        for target, a, b in writes:
            self._write(target, slot, a, b * adapter.scale)
        loaded = LoadedAdapter(name, str(path), slot, adapter.rank, _digest(adapter), int_id or slot,
                               next(self._clock))
        self.adapters[name] = loaded
        return loaded

    def unload(self, name: str) -> None:
        loaded = self.adapters.get(name)
        if loaded is None:
            raise InvalidRequestError(f"The lora adapter '{name}' cannot be found.")
        if self.in_use(loaded.slot):
            raise InvalidRequestError(f"The lora adapter '{name}' is in use by unfinished requests.")
        self._unbind(loaded)

    def _unbind(self, loaded: LoadedAdapter) -> None:
        del self.adapters[loaded.name]
        for module in {t.module for t in self.targets.values()}:
            w = module.lora
            if w is not None:
                cols = slice((loaded.slot - 1) * w.width, loaded.slot * w.width)
                w.a[cols] = 0
                w.b_t[cols] = 0

    def _write(self, target: "_Target", slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """One segment's A and scaled B into its place in `slot`'s columns of its layer."""
        module = target.module
        if module.lora is None:  # the first adapter to target this layer: room for every slot
            width = target.segments * self.max_lora_rank
            module.lora = LoRAWeights(torch.zeros(self.max_loras * width, _in_features(module)),
                                      torch.zeros(self.max_loras * width, _out_features(module)), width)
            self.model.decoder_plan.reset()  # the C++ stack holds each layer's LoRA weights
        w = module.lora
        start = (slot - 1) * w.width + target.segment * self.max_lora_rank
        w.a[start:start + a.shape[0]] = a
        w.b_t[start:start + a.shape[0], target.first:target.first + target.rows] = b.T

    def _free_slot(self) -> int:
        """A slot no adapter holds, else the least recently used idle adapter's, evicted."""
        taken = {a.slot for a in self.adapters.values()}
        free = [s for s in range(1, self.max_loras + 1) if s not in taken]
        if free:
            return free[0]
        idle = [a for a in self.adapters.values() if not self.in_use(a.slot)]
        if not idle:
            raise InvalidRequestError(f"all {self.max_loras} LoRA slots (max_loras) hold adapters in use")
        victim = min(idle, key=lambda a: a.last_used)
        self._unbind(victim)
        return victim.slot

    def _checked_pairs(self, path: str, adapter: Adapter) -> list[tuple["_Target", torch.Tensor, torch.Tensor]]:
        """Each (A, B) pair with the layer segment it adapts, every one checked to fit before any is bound."""
        out = []
        for name, (a, b) in adapter.pairs.items():
            target = self.targets.get(name)
            if target is None:
                raise InvalidRequestError(f"LoRA adapter {path}: targets {name}, which this model has no "
                                          f"adaptable projection of")
            in_features = _in_features(target.module)
            if a.shape[1] != in_features or b.shape[0] != target.rows:
                raise InvalidRequestError(f"LoRA adapter {path}: {name} is [{target.rows}, {in_features}] in the "
                                          f"model, the adapter's A {tuple(a.shape)} and B {tuple(b.shape)} do not fit it")
            out.append((target, a, b))
        return out


@dataclass(frozen=True, eq=False)
class _Target:
    """A weight an adapter may adapt: its layer, its rows there, and which of the layer's segments it is."""
    module: nn.Module
    first: int
    rows: int
    segment: int
    segments: int


def _in_features(module: nn.Module) -> int:
    return module.in_features if hasattr(module, "in_features") else module.weight.shape[1]


def _out_features(module: nn.Module) -> int:
    return module.out_features if hasattr(module, "out_features") else module.weight.shape[0]


def _digest(adapter: Adapter) -> bytes:
    h = hashlib.sha256(f"lora:{adapter.scale!r}".encode())
    for name in sorted(adapter.pairs):
        a, b = adapter.pairs[name]
        h.update(name.encode())
        h.update(a.contiguous().numpy().tobytes())
        h.update(b.contiguous().numpy().tobytes())
    return h.digest()
