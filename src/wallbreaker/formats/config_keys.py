"""What a family's config reader (formats/families.py) gets to read with: helpers over config.json
and, for GGUF, the generic reader's checked accessors and the sizes it has read already."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ..config import short_repr
from ..errors import ModelFormatError, UnsupportedModelError


def unsupported(where: str, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{where}: {what} is not supported")


def number(hf: dict[str, Any], key: str, default: Any) -> Any:
    """config.json's `key` as a float where it is a number (else as it is: ModelConfig names it)."""
    value = hf.get(key, default)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def obj(hf: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = hf.get(key) or {}
    if not isinstance(value, dict):
        raise ModelFormatError(f"{where}: {key} must be a JSON object, got {short_repr(value)}")
    return value


def layer_types(hf: dict[str, Any], layers: Any, where: str, default: str) -> tuple[str, ...]:
    """Per layer "sliding" | "full": config.json's `layer_types`, else the family's rule (`default`):
    "none" (no window), "alternate" (even layers slide), "max_window_layers" (the layers from
    `max_window_layers` on slide, and only with `use_sliding_window`: Qwen) or "all"."""
    given = hf.get("layer_types")
    if given is not None:
        if not isinstance(given, list):
            raise ModelFormatError(f"{where}: layer_types must be a list, got {short_repr(given)}")
        for t in given:
            if t not in ("sliding_attention", "full_attention"):
                raise UnsupportedModelError(f"{where}: layer type {short_repr(t)} is not supported")
        return tuple("sliding" if t == "sliding_attention" else "full" for t in given)
    if default == "none" or not isinstance(layers, int) or isinstance(layers, bool) or not 0 < layers <= 1 << 20:
        return ()
    if default == "alternate":
        return tuple("sliding" if i % 2 == 0 else "full" for i in range(layers))
    if default == "max_window_layers":
        first = hf.get("max_window_layers", layers)
        first = first if isinstance(first, int) and not isinstance(first, bool) else layers
        return tuple("sliding" if i >= first else "full" for i in range(layers))
    return ("sliding",) * layers


def own_gguf_keys(gf, known: frozenset[str]) -> Callable[..., Any]:
    """For a family whose GGUF the generic reader does not read (the recurrent ones): refuse a key of
    `<arch>.` not in `known` (it would change the model's math), and return `value(key, kind,
    default=...)`, which reads `<arch>.key` checked against `kind` (a missing key without a default is
    a ModelFormatError naming it; a default of None passes as it is)."""
    name, a = gf.path.name, f"{gf.get('general.architecture')}."
    for key in gf.metadata:
        if key.startswith(a) and key[len(a):] not in known:
            raise UnsupportedModelError(f"{name}: metadata {key} = {short_repr(gf.get(key))} is not supported "
                                        f"(it would change the model's math)")

    def value(key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        v = gf.get(a + key, default)
        if v is ...:
            raise ModelFormatError(f"{name}: missing metadata key {a}{key}")
        if v is not None and (not isinstance(v, kind) or isinstance(v, bool) != (kind is bool)):
            raise ModelFormatError(f"{name}: metadata {a}{key} must be {getattr(kind, '__name__', kind)}, "
                                   f"got {short_repr(v)}")
        return v

    return value


def pre_attn_scalar(scale: float) -> float:
    """An attention scale 1/sqrt(s) -> s; an absurd scale gives a value ModelConfig refuses."""
    try:
        return round(scale ** -2, 3)
    except (OverflowError, ZeroDivisionError):
        return math.inf


@dataclass
class GGUFKeys:
    """A GGUF file as the generic reader (gguf_model.config_from_gguf) has read it so far: `a` is the
    `<arch>.` prefix of its keys; `integer`, `number`, `raw` read a key, checked (a missing key
    without a default is a ModelFormatError naming it)."""

    gf: Any
    name: str
    a: str
    integer: Callable[..., Any]
    number: Callable[..., Any]
    raw: Callable[..., Any]
    hidden: int
    heads: int
    layers: int
    head_dim: int
    window: int | None
    pattern: list[bool] | None
    scale: float | None
