"""Chat templates: the model's Jinja template, rendered as transformers' `apply_chat_template` does.

A chat template comes from a downloaded file, so it is untrusted code. It runs in Jinja's immutable
sandbox (which needs jinja2 >= 3.1.6: older releases have sandbox escapes), and every render is
bounded in time and in size, so that no template can hang a server thread or exhaust memory:

- time: the compiled template checks a per-render deadline at every loop iteration, `if` branch
  and macro call, and at every filter, call and intercepted operator (`ChatTemplate.max_render_s`);
- size: `*`, `**`, `+` and `%` are intercepted and refused before they build a value over the limit;
  so are `~`, `{{ ... }}`, the filters and the string methods that can grow a value (width, indent,
  replace, join, format, tojson...); every filter's and call's result is measured, and the output
  is counted as it is produced (`ChatTemplate.max_chars`).

A template over either limit fails with InvalidRequestError("chat template exceeded ...").
"""
from __future__ import annotations

import functools
import json
import math
import re
import string
import threading
import time
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.filters import make_attrgetter
from jinja2.sandbox import ImmutableSandboxedEnvironment

from wallbreaker.errors import InvalidRequestError

if TYPE_CHECKING:
    from wallbreaker.formats.tokenizer import Tokenizer

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MIN_JINJA2 = (3, 1, 6)
MAX_RENDER_S = 1.0  # wall-clock seconds one render may take
MAX_CHARS = 1 << 22  # characters of the output, or of any one string a render builds (about 1M tokens)
MAX_ITEMS = 1 << 20  # items in any one value a render builds, nested ones included
MAX_INT_BITS = 1 << 16  # bits of any integer a render computes
_COMPILE_TIME_CHARS = 1 << 12  # a constant Jinja may fold into the compiled template


def check_jinja2_version(version: str) -> None:
    """Refuse jinja2 older than 3.1.6: 3.1.0-3.1.5 let a template escape the sandbox
    (CVE-2024-56326, CVE-2025-27516), and chat templates come from downloaded model files."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    found = tuple(int(g or 0) for g in m.groups()) if m else (0,)
    if found < MIN_JINJA2:
        raise ImportError(
            f"wallbreaker needs jinja2>={'.'.join(map(str, MIN_JINJA2))}, found {version}: older releases let a chat "
            "template escape the sandbox (CVE-2024-56326, CVE-2025-27516); pip install -U 'jinja2>=3.1.6'")


check_jinja2_version(jinja2.__version__)


class TemplateLimitError(Exception):
    """A render went past a limit; its message completes "chat template exceeded ..."."""


class _Render(threading.local):
    """The render running in this thread, if any (each server thread renders on its own)."""

    active = False
    deadline = math.inf
    seconds = MAX_RENDER_S
    max_chars = MAX_CHARS


_render = _Render()


def _tick(now: Callable[[], float] = time.perf_counter) -> None:
    if now() > _render.deadline:
        raise TemplateLimitError(f"its time limit of {_render.seconds:g} s")


def _max_chars() -> int:
    return _render.max_chars if _render.active else _COMPILE_TIME_CHARS


def _too_big(what: str) -> TemplateLimitError:
    return TemplateLimitError(f"its size limit: {what} (at most {_max_chars()} characters, {MAX_ITEMS} items)")


def _measure(value: Any) -> tuple[int, int, int]:
    """(characters, items, depth) of `value` as text: strings, the items of containers (shared ones
    counted each time they appear), integers' digits. Refuses a value past the limits as soon as
    it is seen to be, so the walk itself is bounded."""
    if type(value) is str:
        if len(value) > _max_chars():
            raise _too_big(f"a string of {len(value)} characters")
        return len(value), 1, 0
    limit = _max_chars()
    chars = items = depth = 0
    stack = [(value, 0)]
    while stack:
        v, d = stack.pop()
        items += 1
        depth = max(depth, d)
        if items > MAX_ITEMS:
            raise _too_big(f"a value of more than {MAX_ITEMS} items")
        if isinstance(v, str):
            chars += len(v)
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend((x, d + 1) for x in v)
        elif isinstance(v, dict):
            stack.extend((x, d + 1) for kv in v.items() for x in kv)
        elif isinstance(v, jinja2.utils.Namespace):
            stack.append((object.__getattribute__(v, "_Namespace__attrs"), d + 1))
        elif isinstance(v, int):
            if v.bit_length() > MAX_INT_BITS:
                raise _too_big(f"an integer of {v.bit_length()} bits")
            chars += v.bit_length() // 3 + 1
        else:
            chars += 8
        if chars > limit:
            raise _too_big(f"a value of more than {limit} characters")
    return chars, items, depth


def _check(value: Any) -> Any:
    """`value`, measured (cheaply for a string or a number) and refused if over the limits."""
    kind = type(value)
    if kind is str:
        if len(value) > _max_chars():
            raise _too_big(f"a string of {len(value)} characters")
    elif kind is int:
        if value.bit_length() > MAX_INT_BITS:
            raise _too_big(f"an integer of {value.bit_length()} bits")
    elif kind is float or kind is bool or value is None:
        pass
    elif isinstance(value, (str, list, tuple, dict, set, frozenset, int, jinja2.utils.Namespace)):
        _measure(value)
    return value


def _need(chars: int, items: int = 0) -> None:
    """Refuse an operation whose result would hold `chars` characters or `items` items."""
    if chars > _max_chars():
        raise _too_big(f"a value of {chars} characters")
    if items > MAX_ITEMS:
        raise _too_big(f"a value of {items} items")


def _width(value: Any) -> None:
    if isinstance(value, int) and value > _max_chars():
        raise _too_big(f"a width of {value}")


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([a-zA-Z%])")


def _check_percent_format(fmt: str, values: Any) -> None:
    """`fmt % values`, refused before it runs if a width or the values make it too big."""
    chars, _, _ = _measure(values)
    specs = 0
    for width, precision, kind in _PERCENT_SPEC.findall(fmt):
        specs += kind != "%"
        for n in (width, precision):
            if n.isdigit():
                _width(int(n))
            elif n == "*":  # the width is one of the values
                for v in values if isinstance(values, tuple) else (values,):
                    _width(v)
    _need(len(fmt) + specs * chars)


def _check_str_format(fmt: str, args: tuple, kwargs: dict) -> None:
    """`fmt.format(*args, **kwargs)`, refused before it runs if a width or the values make it too big."""
    chars, _, _ = _measure((args, kwargs))
    fields = 0
    for _, field, spec, _ in string.Formatter().parse(fmt):
        if field is None:
            continue
        fields += 1
        for n in re.findall(r"\d+", spec or ""):
            _width(int(n))
        if spec and "{" in spec:  # a nested width comes from the values
            for v in (*args, *kwargs.values()):
                _width(v)
    _need(len(fmt) + fields * chars)


def _bounded_items(iterable: Any, separator: int = 0) -> list:
    """The items of `iterable`, refused as soon as they (as text, with separators) pass the limits."""
    items, chars = [], 0
    for item in iterable:
        _tick()
        chars += _measure(item)[0] + separator
        _need(chars, len(items))
        items.append(item)
    return items


# -- string methods a template may call --------------------------------------------------------------------
def _check_str_method(s: str, name: str, args: tuple, kwargs: dict) -> tuple | None:
    """Refuse a call of `s.<name>(...)` that would build too big a string; for `join`, the args
    to call it with instead (its items, gathered within the limits)."""
    if name in ("center", "ljust", "rjust", "zfill"):
        if args:
            _width(args[0])
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            _need(len(s) + s.count("\t") * size)
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _need(_replaced_size(s, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1)))
    elif name == "join" and args:
        return (_bounded_items(args[0], len(s)), *args[1:])
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        _need(len(s) * max(longest, 1))
    return None


def _replaced_size(s: str, old: str, new: str, count: Any) -> int:
    hits = len(s) + 1 if old == "" else s.count(old)
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * (len(new) - len(old))


# -- filters -------------------------------------------------------------------------------------------------
def _pre_center(value: Any, width: Any = 80, *_: Any, **__: Any) -> None:
    _width(width)


def _pre_indent(s: Any, width: Any = 4, *_: Any, **__: Any) -> None:
    text = str(_check(s))
    prefix = width if isinstance(width, int) else len(str(width))
    _width(prefix)
    _need(len(text) + (text.count("\n") + 1) * prefix)


def _pre_wordwrap(s: Any, width: Any = 79, break_long_words: Any = True, wrapstring: Any = None,
                  *_: Any, **__: Any) -> None:
    text = str(_check(s))
    _need(len(text) * max(8, 1 + len(str(wrapstring or "\n"))))  # and it loops in Python: 8 times under the limit


def _pre_replace(s: Any, old: Any, new: Any, count: Any = None, *_: Any, **__: Any) -> None:
    _need(_replaced_size(str(_check(s)), str(old), str(new), -1 if count is None else count))


def _pre_format(value: Any, *args: Any, **kwargs: Any) -> None:
    if isinstance(value, str):
        _check_percent_format(value, kwargs or args)


def _pre_count(value: Any, count: Any, *_: Any, **__: Any) -> None:
    if isinstance(count, int):
        _need(0, count)


def _pre_convert(value: Any, *_: Any, **__: Any) -> None:
    _measure(value)


def _pre_tojson(value: Any, ensure_ascii: Any = False, indent: Any = None, *_: Any, **__: Any) -> None:
    chars, items, depth = _measure(value)
    step = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 0
    _width(step)
    _need(chars + items * (4 + max(step, 0) * depth))


def _pre_slow(divisor: int) -> Callable[..., None]:
    """For a filter that loops in Python over its input (no deadline check can stop it midway):
    an input `divisor` times under the limits, so that one call stays well under the time limit."""
    def check(value: Any, *_: Any, **__: Any) -> None:
        chars, items, _ = _measure(value)
        _need(chars * divisor, items * divisor)
    return check


_FILTER_CHECKS: dict[str, Callable[..., None]] = {
    "urlize": _pre_slow(64), "unique": _pre_slow(8), "groupby": _pre_slow(8),
    "dictsort": _pre_slow(8), "striptags": _pre_slow(4),
    "center": _pre_center, "indent": _pre_indent, "wordwrap": _pre_wordwrap, "replace": _pre_replace,
    "format": _pre_format, "batch": _pre_count, "slice": _pre_count, "string": _pre_convert,
    "pprint": _pre_convert, "tojson": _pre_tojson, "e": _pre_convert, "escape": _pre_convert,
    "forceescape": _pre_convert, "urlencode": _pre_convert, "xmlattr": _pre_convert,
}


def _guarded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """`f` with the render's deadline checked, its arguments checked where they can make it build
    too big a value, and its result measured."""
    passes_arg = jinja2.utils._PassArg.from_obj(f) is not None
    check = _FILTER_CHECKS.get(name)

    @functools.wraps(f)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _tick()
        if check is not None:
            check(*args[passes_arg:], **kwargs)
        return _check(f(*args, **kwargs))
    return guarded


def _join_filter(f: Callable[..., Any]) -> Callable[..., Any]:
    """`join` over items gathered within the limits (they may come from a lazy `map`)."""
    @functools.wraps(f)
    def join(eval_ctx: Any, value: Any, d: Any = "", attribute: Any = None) -> Any:
        _tick()
        if attribute is not None:
            value = map(make_attrgetter(eval_ctx.environment, attribute), value)
        return _check(f(eval_ctx, _bounded_items(value, len(str(d))), d))
    return join


def _sum_filter(f: Callable[..., Any]) -> Callable[..., Any]:
    """`sum` refused before it concatenates sequences past the limits (it is quadratic in them)."""
    @functools.wraps(f)
    def sum_(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
        _tick()
        if attribute is not None:
            iterable = map(make_attrgetter(environment, attribute), iterable)
        items = _bounded_items(iterable)
        if isinstance(start, (str, list, tuple)) or any(isinstance(x, (str, list, tuple)) for x in items):
            _need(_measure(start)[0] + sum(_measure(x)[0] for x in items), _measure(start)[1] + len(items))
        return _check(f(environment, items, None, start))
    return sum_


# -- the environment -----------------------------------------------------------------------------------------
class _GuardedCodeGenerator(jinja2.compiler.CodeGenerator):
    """Compiles a deadline check into every block body (loop iterations, branches, macro calls)
    and a size check into every `~`."""

    def blockvisit(self, nodes: Any, frame: Any) -> None:
        try:
            self.writeline("environment.tick()")
            for node in nodes:
                self.visit(node, frame)
        except jinja2.compiler.CompilerExit:
            pass

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        self.write("environment.checked(")
        super().visit_Concat(node, frame)
        self.write(")")


class _GuardedEnvironment(ImmutableSandboxedEnvironment):
    code_generator_class = _GuardedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(finalize=_finalize, **kwargs)
        self.globals.pop("lipsum", None)  # lipsum(10**9) is one Python call no deadline can stop
        for name, f in list(self.filters.items()):
            self.filters[name] = _guarded_filter(name, f)
        self.filters["join"] = _join_filter(jinja2.filters.FILTERS["join"])
        self.filters["sum"] = _sum_filter(jinja2.filters.FILTERS["sum"])

    @staticmethod
    def tick() -> None:
        _tick()

    @staticmethod
    def checked(value: Any) -> Any:
        return _check(value)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        """The intercepted operators: refused before they build too big a value. (Intercepted ones
        are never folded at compile time; a render's loops and calls check its deadline.)"""
        if operator == "+":
            if type(left) is str and type(right) is str:  # the common case, kept cheap
                if len(left) + len(right) > _render.max_chars:
                    raise _too_big(f"a string of {len(left) + len(right)} characters")
                return left + right
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                a, b = _measure(left), _measure(right)
                _need(a[0] + b[0], a[1] + b[1])
        elif operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, str) and isinstance(n, int):
                _need(len(seq) * n)
            elif isinstance(seq, (list, tuple)) and isinstance(n, int) and n > 0:
                chars, items, _ = _measure(seq)
                _need(chars * n, items * n)
            elif isinstance(left, int) and isinstance(right, int):
                if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    raise _too_big(f"an integer of about {left.bit_length() + right.bit_length()} bits")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                if right > MAX_INT_BITS or right * left.bit_length() > MAX_INT_BITS:
                    raise _too_big(f"an integer of about {right * left.bit_length()} bits")
        elif operator == "%" and isinstance(left, str):
            _check_percent_format(left, right)
        return _check(self.binop_table[operator](left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _tick()
        kind = type(__obj)
        if kind is _BUILTIN_METHOD:
            owner = __obj.__self__
            if isinstance(owner, str):
                replaced = _check_str_method(owner, __obj.__name__, args, kwargs)
                if replaced is not None:
                    args = replaced
        elif kind is _FUNCTION:  # the sandbox's wrapper of str.format / str.format_map
            wrapped = __obj.__dict__.get("__wrapped__")
            fmt = getattr(wrapped, "__self__", None)
            if isinstance(fmt, str):
                if __obj.__name__ == "format":
                    _check_str_format(fmt, args, kwargs)
                elif __obj.__name__ == "format_map" and args and isinstance(args[0], dict):
                    _check_str_format(fmt, (), args[0])
        return _check(super().call(__context, __obj, *args, **kwargs))


_BUILTIN_METHOD = type("".join)
_FUNCTION = type(_check)


def _finalize(value: Any) -> Any:
    """Every `{{ ... }}` value, measured before it is turned into text."""
    return _check(value)


class ChatTemplate:
    max_render_s: float = MAX_RENDER_S
    max_chars: int = MAX_CHARS

    def __init__(self, source: str | None, bos_token: str | None, eos_token: str | None, *,
                 max_render_s: float | None = None, max_chars: int | None = None) -> None:
        self.source = source if source else CHATML_TEMPLATE
        self.bos_token = bos_token
        self.eos_token = eos_token
        if max_render_s is not None:
            self.max_render_s = max_render_s
        if max_chars is not None:
            self.max_chars = max_chars
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template does not compile: {_one_line(e)}") from e
        except TemplateLimitError as e:
            raise InvalidRequestError(f"chat template exceeded {e}") from e
        except (RecursionError, MemoryError, ValueError, TypeError) as e:  # a parser pushed past its limits
            raise InvalidRequestError(f"chat template does not compile: {_one_line(e)}") from e

    @functools.cached_property
    def supports_tools(self) -> bool:
        """Whether the template reads `tools` (transformers passes them; a template that never reads
        them would drop them)."""
        import jinja2.meta
        try:
            return "tools" in jinja2.meta.find_undeclared_variables(_environment().parse(self.source))
        except jinja2.TemplateError:
            return False

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text for `messages`. Extra keyword arguments (`tools`, `enable_thinking`...)
        are passed to the template, as with transformers."""
        context: dict[str, Any] = {"tools": None, "documents": None}
        context.update({k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token)) if v})
        context.update(kwargs)
        saved = (_render.active, _render.deadline, _render.seconds, _render.max_chars)
        _render.active, _render.seconds, _render.max_chars = True, self.max_render_s, self.max_chars
        _render.deadline = time.perf_counter() + self.max_render_s
        try:
            parts, total = [], 0
            for chunk in self._template.generate(
                messages=_checked_messages(messages), add_generation_prompt=add_generation_prompt, **context
            ):
                total += len(chunk)
                if total > self.max_chars:
                    raise TemplateLimitError(f"its size limit: more than {self.max_chars} characters of output")
                parts.append(chunk)
            return "".join(parts)
        except TemplateLimitError as e:
            raise InvalidRequestError(f"chat template exceeded {e}") from None
        except InvalidRequestError:
            raise
        except Exception as e:  # a template may fail in any way on input it did not expect
            raise InvalidRequestError(f"chat template failed: {_one_line(e)}") from e
        finally:
            _render.active, _render.deadline, _render.seconds, _render.max_chars = saved


def encode_chat(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    messages: list[dict],
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> list[int]:
    """Render and tokenize a conversation, without a second BOS when the template wrote one."""
    text = template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    ids = tokenizer.encode(text, add_special_tokens=True)
    bos = tokenizer.bos_token_id
    if tokenizer.add_bos and tokenizer.bos_token and text.startswith(tokenizer.bos_token) and ids[1:2] == [bos]:
        del ids[0]
    return ids


def _checked_messages(messages: Any) -> list[dict[str, Any]]:
    """A fresh copy of `messages` with None-valued keys dropped, as transformers passes them."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise InvalidRequestError("messages must be a list of {role, content} objects")
    checked = []
    for n, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{n}] must be an object with role and content")
        if not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages[{n}].role must be a string")
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise InvalidRequestError(f"messages[{n}].content must be a string")
        checked.append({k: v for k, v in message.items() if v is not None})
    return checked


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson`: unlike Jinja's own, it does not HTML-escape."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationTag(jinja2.ext.Extension):
    """Accepts transformers' `{% generation %}...{% endgeneration %}` blocks (used to mask
    assistant tokens in training) and renders their body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes, closing a path out of the sandbox."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _environment() -> ImmutableSandboxedEnvironment:
    env = _GuardedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _guarded_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env
