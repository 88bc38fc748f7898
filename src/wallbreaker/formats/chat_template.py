"""Chat templates: the model's Jinja template, rendered as transformers' `apply_chat_template` does."""
from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
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


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str | None, eos_token: str | None) -> None:
        self.source = source if source else CHATML_TEMPLATE
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(self.source)
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template does not compile: {_one_line(e)}") from e

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text for `messages`. Extra keyword arguments (`tools`, `enable_thinking`...)
        are passed to the template, as with transformers."""
        context: dict[str, Any] = {"tools": None, "documents": None}
        context.update({k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token)) if v})
        context.update(kwargs)
        try:
            return self._template.render(
                messages=_checked_messages(messages), add_generation_prompt=add_generation_prompt, **context
            )
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
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env
