"""The checks on each operation a chat template can use to grow a value, run before it does.

`*`, `**`, `+` and `%`, `str.format`, the str methods and the filters that pad, indent, replace,
repeat or join are refused here from their arguments when their result would pass the render's
limits (template_limits.py), so that the memory and the time are never spent. Everything else a
template calls is cheap for its arguments' size, and its result is measured once it exists.
"""
from __future__ import annotations

import functools
import re
import string
from typing import Any, Callable

import jinja2
import jinja2.nodes
import jinja2.runtime

from .template_limits import MAX_INT_BITS, bounded_items, check, measure, need, tick, too_big, width


def check_binop(operator: str, left: Any, right: Any) -> None:
    """`left <operator> right`, for the operators the sandbox intercepts: `+`, `*`, `**`, `%`."""
    if operator == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            a, b = measure(left), measure(right)
            need(a[0] + b[0], a[1] + b[1])
    elif operator == "*":
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(seq, str) and isinstance(n, int):
            need(len(seq) * n)
        elif isinstance(seq, (list, tuple)) and isinstance(n, int) and n > 0:
            chars, items, _ = measure(seq)
            need(chars * n, items * n)
        elif isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise too_big(f"an integer of about {left.bit_length() + right.bit_length()} bits")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            if right > MAX_INT_BITS or right * left.bit_length() > MAX_INT_BITS:
                raise too_big(f"an integer of about {right * left.bit_length()} bits")
    elif operator == "%" and isinstance(left, str):
        check_percent_format(left, right)


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([a-zA-Z%])")


def check_percent_format(fmt: str, values: Any) -> None:
    """`fmt % values`: refused if a width or the values make it too big."""
    chars, _, _ = measure(values)
    specs = 0
    for w, precision, kind in _PERCENT_SPEC.findall(fmt):
        specs += kind != "%"
        for n in (w, precision):
            if n.isdigit():
                width(int(n))
            elif n == "*":  # the width is one of the values
                for v in values if isinstance(values, tuple) else (values,):
                    width(v)
    need(len(fmt) + specs * chars)


def check_str_format(fmt: str, args: tuple, kwargs: dict) -> None:
    """`fmt.format(*args, **kwargs)`: refused if a width or the values make it too big."""
    chars, _, _ = measure((args, kwargs))
    fields = 0
    for _, field, spec, _ in string.Formatter().parse(fmt):
        if field is None:
            continue
        fields += 1
        for n in re.findall(r"\d+", spec or ""):
            width(int(n))
        if spec and "{" in spec:  # a nested width comes from the values
            for v in (*args, *kwargs.values()):
                width(v)
    need(len(fmt) + fields * chars)


def guarded_format(method: Any, sandboxed: Callable[..., str]) -> Callable[..., str]:
    """The sandbox's `str.format` / `str.format_map` wrapper (`sandboxed`, for `method`), refused
    before it formats too big a string."""
    fmt, is_map = method.__self__, method.__name__ == "format_map"

    def format(*args: Any, **kwargs: Any) -> str:
        tick()
        if not is_map:
            check_str_format(fmt, args, kwargs)
        elif args and isinstance(args[0], dict):
            check_str_format(fmt, (), args[0])
        return check(sandboxed(*args, **kwargs))
    return format


def check_str_method(s: str, name: str, args: tuple, kwargs: dict) -> tuple:
    """The args to call `s.<name>` with, refused if it would build too big a string (for `join`,
    its items, gathered within the limits: they may come from a lazy `map`)."""
    if name in ("center", "ljust", "rjust", "zfill"):
        if args:
            width(args[0])
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            need(len(s) + s.count("\t") * size)
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        need(_replaced_size(s, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1)))
    elif name == "join" and args:
        return (bounded_items(args[0], len(s)), *args[1:])
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        need(len(s) * max(longest, 1))
    return args


def _replaced_size(s: str, old: str, new: str, count: Any) -> int:
    hits = len(s) + 1 if old == "" else s.count(old)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * (len(new) - len(old))


# -- filters -------------------------------------------------------------------------------------------------
def _pre_center(value: Any, w: Any = 80, *_: Any, **__: Any) -> None:
    width(w)


def _pre_indent(s: Any, w: Any = 4, *_: Any, **__: Any) -> None:
    text = str(check(s))
    prefix = w if isinstance(w, int) else len(str(w))
    width(prefix)
    need(len(text) + (text.count("\n") + 1) * prefix)


def _pre_wordwrap(s: Any, w: Any = 79, break_long_words: Any = True, wrapstring: Any = None,
                  *_: Any, **__: Any) -> None:
    text = str(check(s))
    need(len(text) * max(8, 1 + len(str(wrapstring or "\n"))))  # and it loops in Python: 8 times under the limit


def _pre_replace(s: Any, old: Any, new: Any, count: Any = None, *_: Any, **__: Any) -> None:
    need(_replaced_size(str(check(s)), str(old), str(new), -1 if count is None else count))


def _pre_format(value: Any, *args: Any, **kwargs: Any) -> None:
    if isinstance(value, str):
        check_percent_format(value, kwargs or args)


def _pre_count(value: Any, count: Any, *_: Any, **__: Any) -> None:
    if isinstance(count, int):
        need(0, count)


def _pre_convert(value: Any, *_: Any, **__: Any) -> None:
    measure(value)


def _pre_tojson(value: Any, ensure_ascii: Any = False, indent: Any = None, *_: Any, **__: Any) -> None:
    chars, items, depth = measure(value)
    step = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 0
    width(step)
    need(chars + items * (4 + max(step, 0) * depth))


def _pre_slow(divisor: int) -> Callable[..., None]:
    """For a filter that loops in Python over its input (no deadline check can stop it midway):
    an input `divisor` times under the limits, so that one call stays well under the time limit."""
    def pre(value: Any, *_: Any, **__: Any) -> None:
        chars, items, _ = measure(value)
        need(chars * divisor, items * divisor)
    return pre


_FILTER_CHECKS: dict[str, Callable[..., None]] = {
    "urlize": _pre_slow(64), "unique": _pre_slow(8), "groupby": _pre_slow(8),
    "dictsort": _pre_slow(8), "striptags": _pre_slow(4),
    "center": _pre_center, "indent": _pre_indent, "wordwrap": _pre_wordwrap, "replace": _pre_replace,
    "format": _pre_format, "batch": _pre_count, "slice": _pre_count, "string": _pre_convert,
    "pprint": _pre_convert, "tojson": _pre_tojson, "e": _pre_convert, "escape": _pre_convert,
    "forceescape": _pre_convert, "urlencode": _pre_convert, "xmlattr": _pre_convert,
}

# What jinja passes before the value to a filter marked pass_context, pass_eval_context or pass_environment.
_PASSED = (jinja2.runtime.Context, jinja2.nodes.EvalContext, jinja2.Environment)


def guarded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """Filter `name` (`f`), with the deadline checked, its arguments checked where they can make
    it build too big a value, and its result measured. (functools.wraps keeps `f`'s pass_context
    kind of mark, so jinja calls the wrapper as it would `f`.)"""
    if name == "join":
        return _guarded_join(f)
    if name == "sum":
        return _guarded_sum(f)
    pre = _FILTER_CHECKS.get(name)

    @functools.wraps(f)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        tick()
        if pre is not None:
            pre(*(args[1:] if args and isinstance(args[0], _PASSED) else args), **kwargs)
        return check(f(*args, **kwargs))
    return guarded


def _guarded_join(f: Callable[..., Any]) -> Callable[..., Any]:
    """`join` over items gathered within the limits (they may come from a lazy `map`)."""
    @functools.wraps(f)
    def join(eval_ctx: Any, value: Any, d: Any = "", attribute: Any = None) -> Any:
        tick()
        return check(f(eval_ctx, bounded_items(value, len(str(d))), d, attribute))
    return join


def _guarded_sum(f: Callable[..., Any]) -> Callable[..., Any]:
    """`sum` refused before it concatenates sequences past the limits (it is quadratic in them)."""
    @functools.wraps(f)
    def sum_(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
        tick()
        items = bounded_items(iterable)
        if isinstance(start, (str, list, tuple)) or any(isinstance(x, (str, list, tuple)) for x in items):
            need(measure(start)[0] + sum(measure(x)[0] for x in items), measure(start)[1] + len(items))
        return check(f(environment, items, attribute, start))
    return sum_


def guarded_test(f: Callable[..., Any]) -> Callable[..., Any]:
    """A test with the deadline checked: `select` and `reject` call one per item."""
    @functools.wraps(f)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        tick()
        return f(*args, **kwargs)
    return guarded
