"""The model families' own ways of writing tool calls, one file a format, and the choice of one
from what the chat template writes (as server/reasoning.py chooses the reasoning split)."""
from __future__ import annotations

from collections.abc import Sequence

from ...text.chat_template import ChatTemplate
from ..harmony import is_harmony
from .base import Call, ToolParser, call_from, loads
from .deepseek import DeepSeekParser
from .harmony import HarmonyParser
from .hermes import HermesParser
from .llama3 import Llama3JsonParser
from .mistral import MistralParser
from .qwen3_coder import Qwen3CoderParser

__all__ = ["Call", "ToolParser", "call_from", "loads", "parser_for", "DeepSeekParser", "HarmonyParser",
           "HermesParser", "Llama3JsonParser", "MistralParser", "Qwen3CoderParser"]


def parser_for(template: ChatTemplate, tools: Sequence[dict] = ()) -> ToolParser:
    """The format the model writes calls in, judged from what its template writes."""
    source = template.source or ""
    if is_harmony(source):
        return HarmonyParser(tools)
    if "<｜tool▁calls▁begin｜>" in source:
        return DeepSeekParser(tools)
    if "[TOOL_CALLS]" in source:
        return MistralParser(tools)
    if "<function=" in source and "<parameter=" in source:
        return Qwen3CoderParser(tools)
    if "<tool_call>" in source or not template.supports_tools:  # no tools in the template: ours, Hermes's
        return HermesParser(tools)
    if "<|python_tag|>" in source or "<|start_header_id|>" in source:
        return Llama3JsonParser(tools)
    return HermesParser(tools)
