"""The limits one chat-template render is held to, and the measure of the values it builds.

A template is untrusted code, so every render has a deadline and a size limit: no output, and no
string it builds, over `max_chars` characters; no value over MAX_ITEMS items; no integer over
MAX_INT_BITS bits. A value is measured here once it exists, which is cheap for the strings and
numbers that make up real renders; the operations that could build one too big to measure safely
are refused from their arguments before they run (template_guards.py).

The limits live in a thread-local, set by `bounded()` for the length of one render: each server
thread renders on its own, with its own deadline.
"""
from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import jinja2.utils

MAX_RENDER_S = 1.0  # wall-clock seconds one render may take
MAX_CHARS = 1 << 22  # characters of the output, or of any one string a render builds (about 1M tokens)
MAX_ITEMS = 1 << 20  # items in any one value a render builds, nested ones included
MAX_INT_BITS = 1 << 16  # bits of any integer a render computes
COMPILE_TIME_CHARS = 1 << 12  # the biggest constant Jinja may fold while it compiles a template


class TemplateLimitError(Exception):
    """A render went past a limit; its message completes "chat template exceeded ..."."""


class _Render(threading.local):
    """The render running in this thread, if any."""

    active = False
    deadline = math.inf
    seconds = MAX_RENDER_S
    max_chars = MAX_CHARS


_render = _Render()


@contextlib.contextmanager
def bounded(seconds: float, chars: int) -> Iterator[None]:
    """Hold this thread's render to `seconds` from now and `chars` characters."""
    saved = (_render.active, _render.deadline, _render.seconds, _render.max_chars)
    _render.active, _render.seconds, _render.max_chars = True, seconds, chars
    _render.deadline = time.perf_counter() + seconds
    try:
        yield
    finally:
        _render.active, _render.deadline, _render.seconds, _render.max_chars = saved


def tick() -> None:
    """Refuse to go on past the render's deadline."""
    if time.perf_counter() > _render.deadline:
        raise TemplateLimitError(f"its time limit of {_render.seconds:g} s")


def max_chars() -> int:
    """Outside a render, the template is compiling: Jinja folds constant expressions then, through
    the same checked filters, and what it may fold is kept small."""
    return _render.max_chars if _render.active else COMPILE_TIME_CHARS


def too_big(what: str) -> TemplateLimitError:
    return TemplateLimitError(f"its size limit: {what} (at most {max_chars()} characters, {MAX_ITEMS} items)")


def need(chars: int, items: int = 0) -> None:
    """Refuse an operation whose result would hold `chars` characters or `items` items."""
    if chars > max_chars():
        raise too_big(f"a value of {chars} characters")
    if items > MAX_ITEMS:
        raise too_big(f"a value of {items} items")


def width(value: Any) -> None:
    """Refuse a pad or indent width that alone makes a string over the limit."""
    if isinstance(value, int) and value > max_chars():
        raise too_big(f"a width of {value}")


def measure(value: Any) -> tuple[int, int, int]:
    """(characters, items, depth) of `value` as text: strings, the items of containers (shared ones
    counted each time they appear, as `str` writes them), integers' digits. Refuses a value past
    the limits as soon as it is seen to be, so the walk itself is bounded."""
    if type(value) is str:
        if len(value) > max_chars():
            raise too_big(f"a string of {len(value)} characters")
        return len(value), 1, 0
    limit = max_chars()
    chars = items = depth = 0
    stack = [(value, 0)]
    while stack:
        v, d = stack.pop()
        items += 1
        depth = max(depth, d)
        if items > MAX_ITEMS:
            raise too_big(f"a value of more than {MAX_ITEMS} items")
        if isinstance(v, str):
            chars += len(v)
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend((x, d + 1) for x in v)
        elif isinstance(v, dict):
            stack.extend((x, d + 1) for kv in v.items() for x in kv)
        elif isinstance(v, Namespace):
            stack.append((Namespace.held(v), d + 1))
        elif isinstance(v, int):
            if v.bit_length() > MAX_INT_BITS:
                raise too_big(f"an integer of {v.bit_length()} bits")
            chars += v.bit_length() // 3 + 1
        else:
            chars += 8
        if chars > limit:
            raise too_big(f"a value of more than {limit} characters")
    return chars, items, depth


def check(value: Any) -> Any:
    """`value`, measured (cheaply for a string or a number) and refused if over the limits."""
    kind = type(value)
    if kind is str:
        if len(value) > max_chars():
            raise too_big(f"a string of {len(value)} characters")
    elif kind is int:
        if value.bit_length() > MAX_INT_BITS:
            raise too_big(f"an integer of {value.bit_length()} bits")
    elif kind is float or kind is bool or value is None:
        pass
    elif isinstance(value, (str, list, tuple, dict, set, frozenset, int, Namespace)):
        measure(value)
    return value


def bounded_items(iterable: Iterable, separator: int = 0) -> list:
    """The items of `iterable` (perhaps a lazy `map`), refused as soon as they, as text with a
    separator of `separator` characters between them, pass the limits."""
    items, chars = [], 0
    for item in iterable:
        tick()
        chars += measure(item)[0] + separator
        need(chars, len(items))
        items.append(item)
    return items


class Namespace(jinja2.utils.Namespace):
    """`namespace()` as templates get it: it refuses underscore attributes (a path out of the
    sandbox) and keeps its contents where `measure` can see them (jinja's own keeps them in a
    private attribute)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            Namespace._refuse(name)
        object.__setattr__(self, "_held", attrs)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        Namespace._refuse(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)
        object.__getattribute__(self, "_held")[name] = value

    def held(self) -> dict[str, Any]:
        """What the namespace holds. (Call it on the class, `Namespace.held(ns)`: an instance's
        attributes are its contents.)"""
        return object.__getattribute__(self, "_held")

    @staticmethod
    def _refuse(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")
