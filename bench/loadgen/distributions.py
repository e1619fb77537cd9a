"""Turn-size distributions of a simulated coding agent, with defaults from public agent traces.

Every default below comes from the public agent traces listed in ``docs/loadtest.md``, which cites
the sources; the tags in brackets are that note's:

* [W3] counts over the public kv-cache-tester Claude Code traces (github.com/callanjfox/kv-cache-tester,
  710 traces): system prompt p50 2,772; tool definitions p50 12,262; first user message p50 3,868,
  p90 10,739; growth per tool-result step p50 677, p90 3,649; new input at a user prompt p50 549,
  p90 2,751; output per step p50 216, p90 899; 93.8% of steps end in tool_use; 39% carry thinking.
* [W1] kv-cache-tester README: output P10/P50/P90 = 103/218/937.
* [T1] TraceLab (github.com/uw-syfi/TraceLab) session counts: tool calls per step avg 1.2,
  p50 1, p90 2, p99 4.
* [T8] TraceLab adjusted prefix append: the append without the replayed previous output has a
  median of ~250 tokens.
* [P1] Claude Code 2.1.197 sends 24 tools, 63,161 bytes (about 15.8K tokens).
* [P2] the seed deployment's load test: 3 s between turns.

A lognormal is fixed by its median and 90th percentile: ``sigma = ln(p90 / p50) / z90``.
Sizes are scaled with ``size_scale`` for engines that cannot afford real sizes (the CPU reference
engine): every token count except the fixed prefix is multiplied by it.

A trace file (JSONL, one step per line) replaces the parametric per-step model; see
``TraceTurnSource``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator

Z90 = 1.2815515655446004  # standard normal 90th percentile


class LogNormal(BaseModel):
    """A lognormal size (tokens or seconds) given by its median and 90th percentile, clipped."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    p50: float = Field(gt=0)
    p90: float = Field(gt=0)
    min_value: float = Field(1.0, ge=0)
    max_value: float = Field(1e9, gt=0)

    @model_validator(mode="after")
    def _ordered(self) -> LogNormal:
        if self.p90 < self.p50:
            raise ValueError(f"p90 ({self.p90}) must be >= p50 ({self.p50})")
        if self.max_value < self.min_value:
            raise ValueError("max_value must be >= min_value")
        return self

    @property
    def mu(self) -> float:
        return math.log(self.p50)

    @property
    def sigma(self) -> float:
        return math.log(self.p90 / self.p50) / Z90

    @property
    def mean(self) -> float:
        """Mean of the unclipped distribution."""
        return math.exp(self.mu + self.sigma**2 / 2)

    def scaled(self, factor: float) -> LogNormal:
        return LogNormal(
            p50=self.p50 * factor,
            p90=self.p90 * factor,
            min_value=min(self.min_value, self.p50 * factor),
            max_value=max(self.max_value * factor, self.p90 * factor),
        )

    def sample(self, rng: np.random.Generator) -> float:
        value = rng.lognormal(self.mu, self.sigma) if self.sigma > 0 else self.p50
        return float(min(self.max_value, max(self.min_value, value)))

    def sample_int(self, rng: np.random.Generator) -> int:
        return round(self.sample(rng))


class WorkloadParams(BaseModel):
    """Everything that shapes one simulated agent's conversation (token counts are DeepSeek tokens).

    Session life: an agent starts a conversation whose initial context (system + tools + first
    prompt + files read so far) is ``start_fraction`` x ``context_target_tokens``. It grows turn
    by turn (model output + tool results or a new prompt) until the next request would pass the
    target; then the agent "compacts": it starts a new conversation (new session id, new prefix,
    one uncached turn) from a fresh initial context. With the default 0.4-0.6 start this keeps
    active contexts between about half the target and the target, and the one cold turn per
    conversation costs about 2% of input tokens at 128K (the seed's 98% row).
    """

    model_config = ConfigDict(extra="forbid")

    context_target_tokens: int = Field(128_000, ge=1_000)
    start_fraction_min: float = Field(0.4, gt=0, le=1)
    start_fraction_max: float = Field(0.6, gt=0, le=1)
    system_tokens: int = Field(3_000, ge=50, description="[W3] p50 2,772; [C2] 2.5K")
    tools_tokens: int = Field(15_000, ge=0, description="[P1] 24 tools ~15.8K; [W3] p50 12,262")
    num_tools: int = Field(24, ge=1, le=64, description="[P1] 24 tools in -p mode")
    fixed_max_fraction: float = Field(
        0.25, gt=0, le=1, description="system + tools are shrunk to at most this share of the target"
    )
    first_user: LogNormal = LogNormal(p50=3_900, p90=10_700, max_value=30_000)  # [W3]
    # Fitted so that output + tool result reproduces the [W3] growth per tool step (p50 677, p90
    # 3,649, p99 16,646): sampled sums give about p50 720, p90 3.6K, p99 19K; the median tool
    # result alone is close to [T8]'s ~250.
    tool_result: LogNormal = LogNormal(p50=300, p90=3_000, max_value=60_000)
    user_prompt: LogNormal = LogNormal(p50=550, p90=2_750, max_value=30_000)  # [W3]
    output: LogNormal = LogNormal(p50=220, p90=900, min_value=8, max_value=32_000)  # [W3], [W1]
    p_tool_step: float = Field(0.94, ge=0, le=1, description="[W3] 93.8% of stops are tool_use")
    p_thinking: float = Field(0.39, ge=0, le=1, description="[W3] 39% of steps have thinking")
    tool_calls_per_step: dict[int, float] = Field(
        default_factory=lambda: {1: 0.85, 2: 0.10, 3: 0.03, 4: 0.02}, description="[T1] fitted"
    )
    pacing: Literal["constant", "lognormal"] = "constant"
    pacing_s: float = Field(3.0, ge=0, description="[P2] the seed used 3 s between turns")
    pacing_lognormal: LogNormal = LogNormal(p50=9.0, p90=74.0, min_value=0.0, max_value=900.0)  # [W3]
    size_scale: float = Field(1.0, gt=0, le=10, description="multiplies every per-turn size")

    @model_validator(mode="after")
    def _check(self) -> WorkloadParams:
        if self.start_fraction_max < self.start_fraction_min:
            raise ValueError("start_fraction_max must be >= start_fraction_min")
        total = sum(self.tool_calls_per_step.values())
        if not self.tool_calls_per_step or total <= 0 or min(self.tool_calls_per_step) < 1:
            raise ValueError("tool_calls_per_step needs positive counts with positive weights")
        return self

    def fixed_prefix_tokens(self) -> tuple[int, int]:
        """(system, tools) sizes after shrinking them to ``fixed_max_fraction`` of the target."""
        total = self.system_tokens + self.tools_tokens
        cap = self.fixed_max_fraction * self.context_target_tokens
        factor = min(1.0, cap / total) if total else 1.0
        return max(50, int(self.system_tokens * factor)), int(self.tools_tokens * factor)


@dataclass(slots=True, frozen=True)
class TurnSpec:
    """What the agent does after one model response (the sizes of its next request's additions)."""

    kind: str  # "tool" (tool results follow) or "user" (a new user prompt follows)
    new_input_tokens: int  # tool-result tokens (all calls together) or user-prompt tokens
    output_tokens: int  # max_tokens for the next request (the reference engine emits random ids)
    num_tool_calls: int
    thinking: bool
    gap_s: float  # pause between the response's end and the next request


class ParametricTurnSource:
    """Draws each turn independently from ``WorkloadParams``."""

    def __init__(self, params: WorkloadParams) -> None:
        self.params = params
        scale = params.size_scale
        self._tool_result = params.tool_result.scaled(scale)
        self._user_prompt = params.user_prompt.scaled(scale)
        self._output = params.output.scaled(scale)
        counts = sorted(params.tool_calls_per_step)
        weights = np.array([params.tool_calls_per_step[c] for c in counts], dtype=np.float64)
        self._call_counts = np.array(counts)
        self._call_weights = weights / weights.sum()

    def next_turn(self, rng: np.random.Generator) -> TurnSpec:
        p = self.params
        is_tool = bool(rng.random() < p.p_tool_step)
        calls = int(rng.choice(self._call_counts, p=self._call_weights)) if is_tool else 0
        new_tokens = (self._tool_result if is_tool else self._user_prompt).sample_int(rng)
        if p.pacing == "constant":
            gap_s = p.pacing_s
        else:
            gap_s = p.pacing_lognormal.sample(rng)
        return TurnSpec(
            kind="tool" if is_tool else "user",
            new_input_tokens=max(1, new_tokens),
            output_tokens=max(1, self._output.sample_int(rng)),
            num_tool_calls=calls,
            thinking=bool(rng.random() < p.p_thinking),
            gap_s=gap_s,
        )


class TraceError(ValueError):
    """A trace file that cannot be used; the message names the line."""


class TraceTurnSource:
    """Replays steps from a JSONL trace instead of the parametric model.

    One JSON object per line: ``{"kind": "tool"|"user", "new_input_tokens": int,
    "output_tokens": int}`` plus optional ``"num_tool_calls"`` (default 1 for tool steps),
    ``"thinking"`` (bool, default false) and ``"gap_s"`` (default: the params' pacing). Each agent
    walks the trace in order from its own random starting line (wrapping around), so the
    correlations between consecutive steps of the recorded sessions survive.
    """

    def __init__(self, path: str | Path, params: WorkloadParams) -> None:
        self.params = params
        self.steps: list[TurnSpec] = []
        with open(path, "rb") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                self.steps.append(self._parse(line, lineno, params))
        if not self.steps:
            raise TraceError(f"{path}: no steps")
        self._cursors: dict[int, int] = {}

    @staticmethod
    def _parse(line: bytes, lineno: int, params: WorkloadParams) -> TurnSpec:
        try:
            raw = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise TraceError(f"line {lineno}: not JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise TraceError(f"line {lineno}: expected an object")
        kind = raw.get("kind", "tool")
        if kind not in ("tool", "user"):
            raise TraceError(f"line {lineno}: kind must be 'tool' or 'user', got {kind!r}")
        try:
            new_tokens = int(raw["new_input_tokens"])
            out_tokens = int(raw["output_tokens"])
        except (KeyError, TypeError, ValueError):
            raise TraceError(f"line {lineno}: needs integer new_input_tokens and output_tokens") from None
        if new_tokens < 1 or out_tokens < 1:
            raise TraceError(f"line {lineno}: token counts must be >= 1")
        scale = params.size_scale
        return TurnSpec(
            kind=kind,
            new_input_tokens=max(1, int(new_tokens * scale)),
            output_tokens=max(1, int(out_tokens * scale)),
            num_tool_calls=int(raw.get("num_tool_calls", 1 if kind == "tool" else 0)),
            thinking=bool(raw.get("thinking", False)),
            gap_s=float(raw.get("gap_s", params.pacing_s)),
        )

    def next_turn(self, rng: np.random.Generator, agent_key: int = 0) -> TurnSpec:
        cursor = self._cursors.get(agent_key)
        if cursor is None:
            cursor = int(rng.integers(len(self.steps)))
        self._cursors[agent_key] = (cursor + 1) % len(self.steps)
        return self.steps[cursor]


TurnSource = ParametricTurnSource | TraceTurnSource


def make_turn_source(params: WorkloadParams, trace_path: str | None) -> TurnSource:
    return TraceTurnSource(trace_path, params) if trace_path else ParametricTurnSource(params)


def next_turn(source: TurnSource, rng: np.random.Generator, agent_key: int) -> TurnSpec:
    if isinstance(source, TraceTurnSource):
        return source.next_turn(rng, agent_key)
    return source.next_turn(rng)


def initial_context_tokens(params: WorkloadParams, rng: np.random.Generator) -> int:
    """Tokens a new conversation starts with (system + tools + prompt + files read so far)."""
    frac = rng.uniform(params.start_fraction_min, params.start_fraction_max)
    system, tools = params.fixed_prefix_tokens()
    first = params.first_user.scaled(params.size_scale).sample_int(rng)
    return max(system + tools + first, int(frac * params.context_target_tokens))


def iter_quantiles(values: list[float], qs: tuple[float, ...]) -> Iterator[float]:
    arr = np.asarray(values, dtype=np.float64)
    for q in qs:
        yield float(np.quantile(arr, q)) if arr.size else float("nan")
