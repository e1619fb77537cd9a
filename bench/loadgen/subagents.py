"""Subagent fan-outs: how many, how large, how long, and the headers Claude Code sends with them.

Claude Code's Agent tool starts 1-4 subagents at once, each with a fresh context of ~10K tokens
that grows to ~70K over ~11 steps (~2 min) while the parent waits for their reports
(``docs/loadtest.md``, "Subagents", lists the sources). A subagent's requests carry the parent's
``X-Claude-Code-Session-Id`` and its own ``x-claude-code-agent-id`` (17 hex characters, the same
on all its turns), and nothing else of the CLI's agent labels (``docs/claude-code.md``). Siblings
share their system prompt and tools (4,736 tokens with Claude Code 2.1.332), none of the parent's.

Mixes (``SUBAGENT_MIXES``): ``heavy`` (every session spawns; about 40% of requests come from
subagents, as in the corpora chosen for them), ``light`` (3% of sessions spawn, as in the
public Claude Code traces), ``off``. The load generator and the simulator draw spawns from a
random stream of their own, so a parent's own turns are the same with subagents on or off.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from bench.loadgen.distributions import LogNormal
from cache.sessions import SessionHint
from server.agent_hints import agent_hint

SubagentMix = Literal["off", "light", "heavy"]
SUBAGENT_MIXES: tuple[str, ...] = ("off", "light", "heavy")
SESSION_HEADER = "X-Claude-Code-Session-Id"
AGENT_HEADER = "x-claude-code-agent-id"


class SubagentParams(BaseModel):
    """The shape of one mix's fan-outs (tokens are DeepSeek tokens, scaled by ``size_scale``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mix: SubagentMix = "heavy"
    session_share: float = Field(1.0, ge=0, le=1, description="conversations that spawn subagents at all")
    target_request_share: float = Field(
        0.40, ge=0, lt=1, description="heavy: requests off the main thread in a spawning conversation")
    per_spawn: tuple[int, int] = (1, 4)  # uniform, both included
    first_context: LogNormal = LogNormal(p50=10_300, p90=14_000, min_value=2_000, max_value=40_000)
    steps: LogNormal = LogNormal(p50=11, p90=17, min_value=1, max_value=60)
    # Growth per step (tool results; the step's own output comes on top): ~5K, so 10K -> ~70K
    # over 11 steps.
    step_input: LogNormal = LogNormal(p50=4_000, p90=10_000, min_value=50, max_value=60_000)
    sibling_prefix_tokens: int = 4_736  # a subagent type's system prompt and tools (2.1.332)
    size_scale: float = 1.0

    @property
    def prefix_tokens(self) -> int:
        return max(1, round(self.sibling_prefix_tokens * self.size_scale))

    @property
    def enabled(self) -> bool:
        return self.mix != "off" and self.session_share > 0

    def mean_subagent_requests(self) -> float:
        """Requests per spawn: mean count x mean steps (the steps' clipped lognormal, estimated)."""
        lo, hi = self.per_spawn
        s = self.steps
        return (lo + hi) / 2 * _mean_steps(s.mu, s.sigma, s.min_value, s.max_value)

    @property
    def spawn_probability(self) -> float:
        """The chance that a main-thread step ending in a tool call is an Agent call with a fan-out.
        heavy: what gives ``target_request_share``; light: ~1.5 spawns in a ~50-step session."""
        if not self.enabled:
            return 0.0
        if self.mix == "light":
            return 0.03
        share = self.target_request_share
        return share / (1 - share) / self.mean_subagent_requests()


@functools.lru_cache(maxsize=16)
def _mean_steps(mu: float, sigma: float, lo: float, hi: float) -> float:
    """The mean of a clipped, rounded lognormal (estimated on a fixed draw)."""
    draws = np.random.default_rng(0).lognormal(mu, sigma, 20_000)
    return float(np.clip(draws, lo, hi).round().mean())


def subagent_params(mix: str, size_scale: float = 1.0) -> SubagentParams:
    if mix not in SUBAGENT_MIXES:
        raise ValueError(f"subagents: unknown mix {mix!r}; known: {', '.join(SUBAGENT_MIXES)}")
    share = {"off": 0.0, "light": 0.03, "heavy": 1.0}[mix]
    return SubagentParams(mix=mix, session_share=share, size_scale=size_scale)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True, slots=True)
class SubagentPlan:
    """One subagent of a spawn: its id, its first prompt's size and its number of steps."""

    agent_id: str
    first_tokens: int
    steps: int


class SpawnSource:
    """Draws a conversation's fan-outs from a random stream of its own (``rng``)."""

    def __init__(self, params: SubagentParams, rng: np.random.Generator) -> None:
        self.params = params
        self.rng = rng

    def conversation_spawns(self) -> bool:
        """Whether a new conversation is one that spawns subagents (drawn once per conversation)."""
        p = self.params
        return p.enabled and bool(self.rng.random() < p.session_share)

    def spawn(self, main_step_ends_in_tool: bool) -> list[SubagentPlan]:
        """The subagents a main-thread step starts (none for most steps)."""
        p = self.params
        if not main_step_ends_in_tool or not p.enabled or self.rng.random() >= p.spawn_probability:
            return []
        lo, hi = p.per_spawn
        count = int(self.rng.integers(lo, hi + 1))
        return [SubagentPlan(agent_id=self.new_agent_id(),
                             first_tokens=max(p.prefix_tokens,
                                              round(p.first_context.sample(self.rng) * p.size_scale)),
                             steps=max(1, p.steps.sample_int(self.rng)))
                for _ in range(count)]

    def step_input_tokens(self) -> int:
        p = self.params
        return max(1, round(p.step_input.sample(self.rng) * p.size_scale))

    def new_agent_id(self) -> str:
        """17 hex characters, as Claude Code's agent ids are."""
        return "a" + "".join(f"{int(x):x}" for x in self.rng.integers(0, 16, 16))


def subagent_headers(session_id: str, agent_id: str) -> dict[str, str]:
    """What Claude Code (2.1.197, 2.1.332) sends on a subagent's request beside its usual headers."""
    return {SESSION_HEADER: session_id, AGENT_HEADER: agent_id}


def hint_from_headers(headers: dict[str, str]) -> SessionHint:
    """The hint the server builds from a request's headers (``server/agent_hints.py``, and the
    session key the protocol layer reads from ``X-Claude-Code-Session-Id``)."""
    lower = {k.lower(): v for k, v in headers.items()}
    return dataclasses.replace(agent_hint(lower), key=lower.get(SESSION_HEADER.lower()))


def subagent_hint(session_id: str, agent_id: str) -> SessionHint:
    return hint_from_headers(subagent_headers(session_id, agent_id))
