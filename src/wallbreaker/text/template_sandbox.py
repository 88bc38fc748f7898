"""The environment chat templates run in: jinja's immutable sandbox, with every render bounded.

A chat template comes from a downloaded file, so it is untrusted code. It runs in jinja's
`ImmutableSandboxedEnvironment` (which needs jinja2 >= 3.1.6: older releases have sandbox
escapes), and every render is held to a deadline and a size limit (template_limits.py) by
jinja's public API only (the sandbox's hooks, extensions, the documented syntax-tree nodes),
so that a jinja2 upgrade keeps the bounds or fails loudly, never silently drops them:

- time: the deadline is checked at every call (macros, `caller()`, `loop()`, methods, globals),
  filter, test, attribute or item lookup and at every chunk of output. A loop whose body does
  none of these (`{% for c in s %}{% endfor %}`) would escape them, so each template's syntax
  tree is rewritten before it compiles, to check the deadline at the start of every iteration
  (and at every item a loop's `if` filters out);
- size: `*`, `**`, `+` and `%` are intercepted, and `str.format`, the str methods and the
  filters that can grow a value are checked, before they build a value over the limit
  (template_guards.py); every call's and filter's result and every `{{ ... }}` value is
  measured; `~`, rewritten like the loops, measures its operands and its result; the output is
  counted as it is generated.

A render over either limit raises TemplateLimitError.
"""
from __future__ import annotations

import re
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes as nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .template_guards import check_binop, check_str_method, guarded_filter, guarded_format, guarded_test
from .template_limits import Namespace, TemplateLimitError, bounded, check, max_chars, tick, too_big

MIN_JINJA2 = (3, 1, 6)


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


class _Bounds(jinja2.ext.Extension):
    """Rewrites a parsed template so that its loops check the deadline and its `~` the size, with
    calls of this extension's methods (which the sandbox's `call` makes without further ado)."""

    def bound(self, tree: nodes.Template) -> nodes.Template:
        for node in [tree, *tree.find_all(nodes.Node)]:
            if isinstance(node, nodes.For):
                node.body.insert(0, nodes.ExprStmt(self.call_method("tick", lineno=node.lineno), lineno=node.lineno))
                if node.test is not None:
                    node.test = self.call_method("ticked", [node.test], lineno=node.lineno)
            if isinstance(node, nodes.Concat):
                node.nodes = [n if isinstance(n, nodes.Const) else self._checked(n) for n in node.nodes]
                continue
            for field, value in node.iter_fields():
                if isinstance(value, nodes.Concat):
                    setattr(node, field, self._checked(value))
                elif isinstance(value, list) and any(isinstance(v, nodes.Concat) for v in value):
                    setattr(node, field, [self._checked(v) if isinstance(v, nodes.Concat) else v for v in value])
        tree.set_environment(self.environment)
        return tree

    def _checked(self, node: nodes.Expr) -> nodes.Call:
        return self.call_method("checked", [node], lineno=node.lineno)

    @staticmethod
    def tick() -> None:
        tick()

    @staticmethod
    def ticked(value: Any) -> Any:
        tick()
        return value

    @staticmethod
    def checked(value: Any) -> Any:
        return check(value)


_REWRITTEN = frozenset({_Bounds.tick, _Bounds.ticked, _Bounds.checked})
_FUNCTION = type(tick)
_BUILTIN_METHOD = type("".join)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with its hooks checking the render's limits. `filters` are added to jinja's
    own, and all of them are guarded; `lipsum` is removed (`lipsum(10**9)` is one Python call no
    deadline can stop)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, *, filters: dict[str, Any] | None = None, **options: Any) -> None:
        options["extensions"] = [*options.get("extensions", ()), _Bounds]
        super().__init__(finalize=check, **options)
        self.globals.pop("lipsum", None)
        self.globals["namespace"] = Namespace
        self.filters.update(filters or {})
        for name, f in list(self.filters.items()):
            self.filters[name] = guarded_filter(name, f)
        for name, test in list(self.tests.items()):
            self.tests[name] = guarded_test(test)

    def compile(self, source: str | nodes.Template, name: str | None = None, filename: str | None = None,
                raw: bool = False, defer_init: bool = False) -> Any:
        """Every template compiled here is bounded: `from_string` comes through here."""
        if isinstance(source, str):
            source = self.parse(source, name, filename)
        source = self.extensions[_Bounds.identifier].bound(source)
        return super().compile(source, name, filename, raw, defer_init)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        """The intercepted operators (never folded at compile time), refused before they build too
        big a value."""
        if operator == "+" and type(left) is str and type(right) is str:  # the common case, kept cheap
            if len(left) + len(right) > max_chars():
                raise too_big(f"a string of {len(left) + len(right)} characters")
            return left + right
        tick()
        check_binop(operator, left, right)
        return check(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        tick()
        if type(__obj) is _FUNCTION and __obj in _REWRITTEN:  # in every loop iteration and `~`: kept cheap
            return __obj(*args)
        if type(__obj) is _BUILTIN_METHOD and isinstance(__obj.__self__, str):
            args = check_str_method(__obj.__self__, __obj.__name__, args, kwargs)
        return check(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Any:
        sandboxed = super().wrap_str_format(value)
        return None if sandboxed is None else guarded_format(value, sandboxed)

    def getattr(self, obj: Any, attribute: str) -> Any:
        """(Filters such as `map(attribute=...)` look up one per item, within one call.)"""
        tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        tick()
        return super().getitem(obj, argument)


def render(template: jinja2.Template, seconds: float, chars: int, **context: Any) -> str:
    """`template` rendered with `context`, in at most `seconds` and `chars` characters."""
    with bounded(seconds, chars):
        parts, total = [], 0
        for chunk in template.generate(**context):
            tick()
            total += len(chunk)
            if total > chars:
                raise TemplateLimitError(f"its size limit: more than {chars} characters of output")
            parts.append(chunk)
        return "".join(parts)
