"""Chat templates: the model's Jinja template, rendered as transformers' `apply_chat_template` does.

The template gets transformers' context (`messages`, `add_generation_prompt`, `bos_token`,
`eos_token`, `tools`, `documents` and any extra keyword) and its helpers (`raise_exception`,
`strftime_now`, a `tojson` that does not HTML-escape, the `{% generation %}` tag, loop controls).
It is untrusted code from a downloaded file, so it runs in a bounded sandbox (template_sandbox.py):
a render past its time or size limit fails with InvalidRequestError("chat template exceeded ...").
"""
from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes

from wallbreaker.errors import InvalidRequestError

from .template_limits import MAX_CHARS, MAX_RENDER_S, TemplateLimitError
from .template_sandbox import BoundedEnvironment, check_jinja2_version, render

if TYPE_CHECKING:
    from wallbreaker.text.tokenizer import Tokenizer

__all__ = ["CHATML_TEMPLATE", "ChatTemplate", "check_jinja2_version", "encode_chat"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplate:
    """A model's chat template, compiled once and rendered per request within `max_render_s`
    seconds and `max_chars` characters."""

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
        try:
            return render(self._template, self.max_render_s, self.max_chars, messages=_checked_messages(messages),
                          add_generation_prompt=add_generation_prompt, **context)
        except TemplateLimitError as e:
            raise InvalidRequestError(f"chat template exceeded {e}") from None
        except InvalidRequestError:
            raise
        except Exception as e:  # a template may fail in any way on input it did not expect
            raise InvalidRequestError(f"chat template failed: {_one_line(e)}") from e


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
        parts = isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("type"), str)
                                                  for p in content)  # a vision model's text and image parts
        if not isinstance(content, str) and not parts and not (content is None and message.get("tool_calls")):
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


def _environment() -> BoundedEnvironment:
    env = BoundedEnvironment(filters={"tojson": _tojson}, trim_blocks=True, lstrip_blocks=True,
                             extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
