"""Runs one openai-agents task against the backend (inside the openai-agents venv).

    python agents_driver.py BASE_URL API_KEY MODEL responses|chat_completions PROJECT_DIR PROMPT

Uses the SDK's defaults: ``set_default_openai_client`` + ``set_default_openai_api`` and a model
given by name, so "responses" is the SDK's default model class (OpenAIResponsesModel) and
"chat_completions" its OpenAIChatCompletionsModel. Prints one JSON line with the result.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from agents import (
    Agent,
    Runner,
    function_tool,
    set_default_openai_api,
    set_default_openai_client,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

base_url, api_key, model, api, project, prompt = sys.argv[1:7]
calls: list[dict] = []


@function_tool
def read_file(path: str) -> str:
    """Read a text file of the project."""
    calls.append({"name": "read_file", "path": path})
    return (Path(project) / path).read_text()


async def main() -> None:
    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0),
                              use_for_tracing=False)
    set_default_openai_api(api)
    agent = Agent(name="assistant", instructions="Answer with the tools.", tools=[read_file], model=model)
    result = await Runner.run(agent, prompt, max_turns=6)
    usage = result.context_wrapper.usage
    print(json.dumps({"final": result.final_output, "calls": calls, "requests": usage.requests,
                      "input_tokens": usage.input_tokens,
                      "cached_tokens": getattr(usage.input_tokens_details, "cached_tokens", None)}))


asyncio.run(main())
