"""An `openai-agents` agent with one function tool, pointed at a local server; run with the Python
that has `openai-agents` installed (not wallbreaker's): python agent_with_tool.py BASE_URL MODEL API.

API is "responses" (the SDK's default) or "chat_completions". The first model call is forced to the
tool (a small model would not call it on its own); the SDK then resets `tool_choice`, runs the tool
and asks the model again, which answers in text. Prints the tool's calls as `TOOL CALLED city=...`
lines, then `ANSWER: <final output>`.
"""
from __future__ import annotations

import asyncio
import sys

from agents import (Agent, ModelSettings, Runner, function_tool, set_default_openai_api, set_default_openai_client,
                    set_tracing_disabled)
from openai import AsyncOpenAI


@function_tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    print(f"TOOL CALLED city={city!r}", flush=True)
    return f"It is 21 C and sunny in {city}."


async def main(base_url: str, model: str, api: str) -> None:
    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=base_url, api_key="x"), use_for_tracing=False)
    set_default_openai_api(api)
    agent = Agent(name="weather", instructions="Answer in one short sentence.", model=model, tools=[get_weather],
                  model_settings=ModelSettings(tool_choice="get_weather", max_tokens=64, temperature=0.0))
    result = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    print(f"ANSWER: {result.final_output}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
