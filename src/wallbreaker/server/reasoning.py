"""Reasoning ("thinking") split from the answer, as vLLM, llama.cpp and SGLang return it apart.

Reasoning models (Qwen3, DeepSeek-R1 and its distills) think inside `<think>...</think>` before
they answer. The parser is chosen from the chat template: one that writes `<think>` gets it, others
none. Where the thinking starts follows the prompt: a template that opens the block itself (DeepSeek-R1,
Qwen3 with thinking on ends the prompt in `<think>\\n`) leaves the model already thinking, so its
output up to `</think>` is reasoning; otherwise reasoning is what the output puts between the tags.
A block never closed (the answer cut by max_tokens) is all reasoning, as with vLLM's DeepSeek-R1 parser.

`ReasoningStream` is the same split fed piece by piece (streamed deltas): text that may be the start
of a tag is held back until the next piece tells.

Used by the chat completions handler; the Anthropic Messages and OpenAI Responses handlers can take
the same `ReasoningParser` for their thinking blocks and reasoning items.
"""
from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class Split:
    reasoning: str
    content: str


@dataclass(frozen=True)
class ReasoningParser:
    start: str = THINK_START
    end: str = THINK_END

    @classmethod
    def for_template(cls, template_source: str | None) -> "ReasoningParser | None":
        """The parser a model's chat template calls for (None: the model does not reason in tags)."""
        if template_source and THINK_START in template_source and THINK_END in template_source:
            return cls()
        return None

    def starts_in_reasoning(self, prompt: str | None) -> bool:
        """Whether the prompt leaves a thinking block open, so that the output begins inside it."""
        if not prompt:
            return False
        return prompt.rfind(self.start) > prompt.rfind(self.end)

    def split(self, text: str, prompt: str | None = None) -> Split:
        stream = self.stream(prompt)
        first = stream.feed(text)
        last = stream.finish()
        return Split(first.reasoning + last.reasoning, first.content + last.content)

    def stream(self, prompt: str | None = None) -> "ReasoningStream":
        return ReasoningStream(self, self.starts_in_reasoning(prompt))


class ReasoningStream:
    """The split of an output that arrives in pieces: `feed` each piece, then `finish`."""

    def __init__(self, parser: ReasoningParser, in_reasoning: bool):
        self.parser = parser
        self.in_reasoning = in_reasoning
        self.done = False  # the thinking block has closed: the rest is answer
        self.held = ""

    def feed(self, text: str) -> Split:
        self.held += text
        reasoning, content = [], []
        while self.held:
            if self.done:
                content.append(self.held)
                self.held = ""
            elif self.in_reasoning:
                end = self.held.find(self.parser.end)
                if end >= 0:
                    reasoning.append(self.held[:end])
                    self.held = self.held[end + len(self.parser.end):]
                    self.in_reasoning, self.done = False, True
                    continue
                keep = _partial_tag(self.held, self.parser.end)
                reasoning.append(self.held[:len(self.held) - keep])
                self.held = self.held[len(self.held) - keep:]
                break
            else:  # before any tag: an opening tag may come only at the start of the output
                stripped = self.held.lstrip()
                if stripped.startswith(self.parser.start):
                    self.held = stripped[len(self.parser.start):]
                    self.in_reasoning = True
                    continue
                if self.parser.start.startswith(stripped):
                    break  # all of it may still be the opening tag
                self.done = True
        return Split("".join(reasoning), "".join(content))

    def finish(self) -> Split:
        """What was held back, as it stands at the end of the output."""
        held, self.held = self.held, ""
        if self.in_reasoning:
            return Split(held, "")
        return Split("", held)


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0 if none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
