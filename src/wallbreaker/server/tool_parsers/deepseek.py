"""DeepSeek's calls, between `<｜tool▁calls▁begin｜>` and `<｜tool▁calls▁end｜>`, one
`<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>` each:
- V3.1 and later: `NAME<｜tool▁sep｜>{arguments}`;
- V3 and R1: `function<｜tool▁sep｜>NAME` then the arguments in a ```json fence."""
from __future__ import annotations

import json
import re

from .base import Call, ToolParser, arguments_json, loads

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(SEP) + r"(.*?)(?:" + re.escape(CALL_END) + r"|$)",
                   re.DOTALL)
_FENCED = re.compile(r"\A([^\n]+)\n```(?:json)?\s*(.*?)\s*```\s*\Z", re.DOTALL)


class DeepSeekParser(ToolParser):
    name = "deepseek"
    markers = (CALLS_BEGIN,)
    special_markers = True

    def _calls(self, text: str) -> list[Call]:
        calls = []
        for m in _CALL.finditer(text):
            head, rest = m.group(1).strip(), m.group(2)
            fenced = _FENCED.match(rest.strip())
            if head == "function" and fenced:
                name, args = fenced.group(1).strip(), loads(fenced.group(2))
            else:
                name, args = head, loads(rest)
            if not name or not isinstance(args, dict):
                return []
            calls.append(Call(name, arguments_json(args)))
        return calls


def deepseek_tool_listing(tools: list[dict]) -> str:
    """The tools as DeepSeek-V3.1's model card describes them, after the system prompt (its chat
    template does not read `tools`: the caller adds this block)."""
    parts = ["## Tools\nYou have access to the following tools:\n"]
    for t in tools:
        f = t["function"]
        parts.append(f"\n### {f['name']}\nDescription: {f.get('description') or ''}\n\n"
                     f"Parameters: {json.dumps(f.get('parameters') or {}, ensure_ascii=False)}\n")
    parts.append("\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
                 f"{CALLS_BEGIN}{CALL_BEGIN}tool_call_name{SEP}tool_call_arguments{CALL_END}{{additional_tool_calls}}{CALLS_END}\n\nWhere:\n"
                 "- `tool_call_name` must be an exact match to one of the available tools\n"
                 "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
                 "- For multiple tool calls, chain them directly without separators or spaces")
    return "".join(parts)
