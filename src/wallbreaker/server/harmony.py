"""gpt-oss's harmony format, split as the chat answer needs it: the `analysis` channel is
reasoning, `final` (and a `commentary` preamble) is the answer, and a message addressed to a
function (`to=functions.NAME`) is a call.

The output is a run of messages, `[<|start|>ROLE]HEADER<|message|>BODY` ended by `<|end|>`,
`<|call|>` or `<|return|>` (the first has no `<|start|>`: the prompt ends in `<|start|>assistant`).
The header names the channel (`<|channel|>commentary`) and perhaps a recipient (` to=functions.x`,
before or after the channel) and a content type (`<|constrain|>json`). Calls stay in the answer in
one canonical form (`CALL_PREFIX` NAME ` <|constrain|>json<|message|>` ARGS `<|call|>`), which the
tool parser (tool_parsers/harmony.py) reads; without tools they are left as they are, never lost.

Its markers are special tokens: the detokenizer must keep them (`skip_special_tokens=False`).
`HarmonyReasoning` has `ReasoningParser`'s methods, so the chat handler takes either."""
from __future__ import annotations

import re

from .reasoning import Split

CALL_PREFIX = "<|start|>assistant<|channel|>commentary to=functions."
_MESSAGE = re.compile(r"(?:<\|start\|>)?((?:(?!<\|start\|>|<\|end\|>|<\|call\|>|<\|return\|>).)*?)<\|message\|>"
                      r"(.*?)(<\|end\|>|<\|call\|>|<\|return\|>|(?=<\|start\|>)|\Z)", re.DOTALL)
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")


def is_harmony(template_source: str | None) -> bool:
    return bool(template_source) and "<|channel|>" in template_source and "<|message|>" in template_source


def harmony_split(text: str, final: bool = True) -> Split:
    """Reasoning and answer of `text`. Not `final` (more may come): what may still be the start of a
    marker, or an unfinished header, is left out of both."""
    reasoning, content, pos = [], [], 0
    for m in _MESSAGE.finditer(text):
        content.append(_gap(text[pos:m.start()], final=True))
        header, body, end = m.group(1), m.group(2), m.group(3)
        closed = bool(end) or final
        if not closed:
            body = _settled(body)
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient:
            content.append(f"{CALL_PREFIX}{recipient.group(1)} <|constrain|>json<|message|>{body}"
                           + ("<|call|>" if closed else ""))
        elif channel and channel.group(1) == "analysis":
            reasoning.append(body)
        else:
            content.append(body)
        pos = m.end()
    content.append(_gap(text[pos:], final))
    return Split("".join(reasoning), "".join(content))


def _gap(text: str, final: bool) -> str:
    """Text outside any message (a model that wrote no markers, or had them skipped) is answer; the
    tail of an unfinished stream may still be a header (` to=functions.x<|channel|>...`): held."""
    return text if final else ""


def _settled(body: str) -> str:
    """`body` less an end that may be the start of a marker (`<`, `<|en`)."""
    cut = body.rfind("<")
    tail = body[cut:]
    return body[:cut] if cut >= 0 and (tail == "<" or tail.startswith("<|")) and "|>" not in tail else body


class HarmonyReasoning:
    """The harmony split with `ReasoningParser`'s interface."""

    def split(self, text: str, prompt: str | None = None) -> Split:
        return harmony_split(text)

    def stream(self, prompt: str | None = None) -> "HarmonyStream":
        return HarmonyStream()


class HarmonyStream:
    """`harmony_split` of a text that comes in pieces: each piece gives what became settled."""

    def __init__(self) -> None:
        self.text = ""
        self.sent = Split("", "")

    def feed(self, piece: str) -> Split:
        self.text += piece
        return self._advance(harmony_split(self.text, final=False))

    def finish(self) -> Split:
        return self._advance(harmony_split(self.text))

    def _advance(self, now: Split) -> Split:
        if not (now.reasoning.startswith(self.sent.reasoning) and now.content.startswith(self.sent.content)):
            return Split("", "")
        out = Split(now.reasoning[len(self.sent.reasoning):], now.content[len(self.sent.content):])
        self.sent = now
        return out
