"""One simulated Claude Code conversation: Claude Code-shaped request bodies that grow turn by turn.

The shape follows what Claude Code 2.1.197 was seen to send (``docs/claude-code.md``):
``system`` is a list of three text blocks (billing header, agent line, main prompt;
the last two with ``cache_control``); 24 tools with JSON-schema inputs; the first user message
is a ``<system-reminder>`` block plus the prompt, followed by a ``system``-role message; thinking
``adaptive``; ``context_management`` and ``output_config``; ``stream: true``; one moving
``cache_control`` marker on the last block of the last non-system message; the header
``X-Claude-Code-Session-Id``. Each assistant turn is appended exactly as it was received (thinking
with its signature, text, tool_use) and answered with synthetic tool results, as Claude Code does.

Deviation (documented in docs/loadtest.md): ``max_tokens`` is the sampled output size instead of
32000, because the reference engine emits random ids and would otherwise run to the limit.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import numpy as np
import orjson

from bench.loadgen.distributions import TurnSpec, WorkloadParams
from bench.loadgen.subagents import subagent_headers
from bench.loadgen.textgen import TextSynth

TOOL_NAMES = ["Agent", "Bash", "CronCreate", "CronDelete", "CronList", "Edit", "EnterWorktree",
              "ExitWorktree", "NotebookEdit", "Read", "ReportFindings", "ScheduleWakeup", "SendMessage",
              "Skill", "TaskCreate", "TaskGet", "TaskList", "TaskOutput", "TaskStop", "TaskUpdate",
              "WebFetch", "WebSearch", "Workflow", "Write"]
SCHEMA_URL = "https://json-schema.org/draft/2020-12/schema"
AGENT_LINE = "You are a Claude agent, built on Anthropic's Claude Agent SDK."
SUBAGENT_LINE = "You are an agent for Claude Code, Anthropic's official CLI for Claude."
SUBAGENT_TOOLS = 8  # a general-purpose subagent's tool set (Claude Code 2.1.332: 8 of the parent's 12)
BLOCK_OVERHEAD_TOKENS = 12  # rendering overhead per content block (role tags, tool-result wrapper)


def build_tools(params: WorkloadParams, synth: TextSynth, seed: int = 7) -> list[dict[str, Any]]:
    """``num_tools`` tool schemas whose JSON totals about the tools budget, identical every call."""
    rng = np.random.default_rng(seed)
    _system, tools_tokens = params.fixed_prefix_tokens()
    names = [TOOL_NAMES[i % len(TOOL_NAMES)] + ("" if i < len(TOOL_NAMES) else str(i))
             for i in range(params.num_tools)]
    per_tool = max(8, tools_tokens // max(1, params.num_tools) - 60)
    tools = []
    for name in names:
        tools.append(
            {
                "name": name,
                "description": synth.text(per_tool, rng),
                "input_schema": {
                    "$schema": SCHEMA_URL,
                    "type": "object",
                    "properties": {
                        "file_path": {"type": "string", "description": "The absolute path to operate on"},
                        "limit": {"type": "integer", "minimum": 1, "maximum": 9007199254740991},
                    },
                    "required": ["file_path"],
                    "additionalProperties": False,
                },
            }
        )
    return tools


class AgentSession:
    """A conversation that grows by appending; the request body is rebuilt from ``messages``.

    Invariants: ``messages`` never ends with an assistant message when a request is sent;
    ``context_tokens`` estimates the rendered prompt size (replaced by the server's own count
    from ``usage`` after every response); every ``tool_use`` received is answered by exactly one
    ``tool_result`` in the next user message.
    """

    def __init__(
        self,
        params: WorkloadParams,
        synth: TextSynth,
        tools: list[dict[str, Any]],
        rng: np.random.Generator,
        initial_tokens: int,
        model: str,
        mid_conversation_system: bool = True,
        *,
        session_id: str | None = None,
        agent_id: str | None = None,
    ) -> None:
        """``agent_id``: a subagent's conversation under its parent's ``session_id`` (its own system
        prompt, the same for every subagent; the caller passes its smaller tool set)."""
        self.params = params
        self.synth = synth
        self.tools = tools
        self.rng = rng
        self.model = model
        self.session_id = str(uuid.UUID(int=int(rng.integers(0, 2**63)) << 64 | int(rng.integers(0, 2**63))))
        if session_id is not None:
            self.session_id = session_id
        self.agent_id = agent_id
        self.device_id = hashlib.sha256(self.session_id.encode()).hexdigest()
        self.messages: list[dict[str, Any]] = []
        self.num_turns = 0
        self._tool_counter = 0
        system_tokens, tools_tokens = params.fixed_prefix_tokens()
        prompt_tokens = max(8,
                            min(initial_tokens // 4,
                                params.first_user.scaled(params.size_scale).sample_int(rng)))
        prompt = synth.text(prompt_tokens, rng)
        suffix = hashlib.sha256(prompt.encode()).hexdigest()[:3]
        system_seed = 11 if agent_id is None else 13  # every subagent shares its own system prompt
        self.system = [
            {"type": "text",
             "text": f"x-anthropic-billing-header: cc_version=2.1.197.{suffix}; cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": AGENT_LINE if agent_id is None else SUBAGENT_LINE,
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": synth.text(system_tokens, np.random.default_rng(system_seed)),
             "cache_control": {"type": "ephemeral"}},
        ]
        reminder = (
            "<system-reminder>\nAs you answer the user's questions, you can use the following context:\n"
            "# currentDate\nToday's date is 2026-11-29.\n</system-reminder>\n\n"
        )
        self.messages.append({"role": "user",
                              "content": [{"type": "text", "text": reminder},
                                          {"type": "text", "text": prompt}]})
        self.context_tokens = system_tokens + tools_tokens + prompt_tokens + 40
        if mid_conversation_system:
            agents_tokens = max(8, min(1_500, initial_tokens // 20))
            self.messages.append({"role": "system", "content": synth.text(agents_tokens, rng)})
            self.context_tokens += agents_tokens + BLOCK_OVERHEAD_TOKENS
        self._read_files_until(initial_tokens)
        self.initial_tokens = self.context_tokens

    # -- growth -----------------------------------------------------------------------------
    def _new_tool_id(self) -> str:
        self._tool_counter += 1
        return f"toolu_{self.session_id[:8]}{self._tool_counter:06d}"

    def _read_files_until(self, target_tokens: int) -> None:
        """Prior Read calls and their results, so the conversation starts at ``target_tokens``."""
        while self.context_tokens < target_tokens:
            size = min(target_tokens - self.context_tokens,
                       int(self.rng.integers(1_000, 6_000) * self.params.size_scale) + 1)
            tool_id = self._new_tool_id()
            path = f"/work/project/src/module_{self._tool_counter}.py"
            self.messages.append(
                {"role": "assistant",
                 "content": [{"type": "tool_use", "id": tool_id, "name": "Read",
                              "input": {"file_path": path}}]}
            )
            self.messages.append(
                {"role": "user",
                 "content": [{"type": "tool_result", "tool_use_id": tool_id,
                              "content": self.synth.text(size, self.rng)}]}
            )
            self.context_tokens += size + 2 * BLOCK_OVERHEAD_TOKENS + 20

    def fits(self, turn: TurnSpec) -> bool:
        """Whether the next request, with this turn's additions and output, stays within the target."""
        return (self.context_tokens + turn.new_input_tokens + turn.output_tokens
                <= self.params.context_target_tokens)

    def append_response(self, blocks: list[dict[str, Any]], turn: TurnSpec) -> None:
        """Append the assistant content received, then the next user message for ``turn``."""
        content = [b for b in blocks if b.get("type") in ("thinking", "text", "tool_use")]
        if not content:
            content = [{"type": "text", "text": "."}]  # an empty reply; the API forbids empty content
        self.messages.append({"role": "assistant", "content": content})
        tool_ids = [b["id"] for b in content if b.get("type") == "tool_use"]
        if tool_ids:
            per_call = max(1, turn.new_input_tokens // len(tool_ids))
            results = []
            for tool_id in tool_ids:
                results.append(
                    {"type": "tool_result", "tool_use_id": tool_id,
                     "content": self.synth.text(per_call, self.rng), "is_error": False}
                )
            self.messages.append({"role": "user", "content": results})
        elif turn.kind == "tool":
            # The model (random weights) made no tool call; the agent still adds a tool-sized input.
            self.messages.append({"role": "user",
                                  "content": self.synth.text(turn.new_input_tokens, self.rng)})
        else:
            self.messages.append({"role": "user",
                                  "content": self.synth.text(turn.new_input_tokens, self.rng)})
        self.context_tokens += turn.new_input_tokens + BLOCK_OVERHEAD_TOKENS
        self.num_turns += 1

    def observe_usage(self, total_input_tokens: int, output_tokens: int) -> None:
        """The server counted the prompt: use its figure from now on."""
        if total_input_tokens > 0:
            self.context_tokens = total_input_tokens + output_tokens

    # -- request ----------------------------------------------------------------------------
    def headers(self) -> dict[str, str]:
        headers = {
            "Content-Type": "application/json",
            "Accept": "application/json",
            "User-Agent": "claude-cli/2.1.197 (external, sdk-cli)",
            "X-Claude-Code-Session-Id": self.session_id,
            "anthropic-version": "2023-06-01",
            "anthropic-beta": ("claude-code-20250219,interleaved-thinking-2025-05-14,"
                               "context-management-2025-06-27"),
            "x-app": "cli",
        }
        if self.agent_id is not None:  # what Claude Code adds on a subagent's requests
            headers.update(subagent_headers(self.session_id, self.agent_id))
        return headers

    def _marked_messages(self) -> list[dict[str, Any]]:
        """Messages with the single moving cache_control marker on the last non-system message."""
        messages = list(self.messages)
        for idx in range(len(messages) - 1, -1, -1):
            if messages[idx]["role"] == "system":
                continue
            msg = messages[idx]
            content = msg["content"]
            if isinstance(content, str):
                blocks = [{"type": "text", "text": content}]
            else:
                blocks = list(content)
            blocks[-1] = {**blocks[-1], "cache_control": {"type": "ephemeral"}}
            messages[idx] = {"role": msg["role"], "content": blocks}
            break
        return messages

    def body(self, max_tokens: int, temperature: float | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self._marked_messages(),
            "system": self.system,
            "tools": self.tools,
            "metadata": {
                "user_id": orjson.dumps(
                    {"device_id": self.device_id, "account_uuid": "", "session_id": self.session_id}
                ).decode()
            },
            "max_tokens": max(1, int(max_tokens)),
            "thinking": {"type": "adaptive"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"},
            "stream": True,
        }
        if temperature is not None:
            body["temperature"] = temperature
        return body

    def body_bytes(self, max_tokens: int) -> bytes:
        return orjson.dumps(self.body(max_tokens))
