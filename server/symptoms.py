"""Runtime symptoms: what preflight cannot see, noticed while serving, in metrics, logs and /healthz.

The service calls one ``RuntimeSymptoms`` from its event loop (it is not thread-safe):

* ``observe_request_start(session_key, now)`` / ``observe_request_end(session_key, now)`` around
  every admitted chat request;
* ``observe_turn(session_key, num_prompt_tokens, num_cached_tokens, ...)`` once the cache has
  answered for a turn;
* ``observe_unknown_model(name)`` when a request names a model this endpoint does not serve;
* ``observe_prompt_too_long(num_prompt_tokens, max_model_len)`` on that 400;
* ``active_warnings()`` for ``/healthz``.

Detectors (each O(1) per call; the divergence scan runs only for an uncached repeat turn):

* Uncached repeats: among the last ``uncached_window_turns`` repeat turns (turn 2+ of a session,
  longer than one block so something was cacheable), at least ``uncached_min_turns`` and
  ``uncached_ratio`` of them had 0 cached tokens. Cause: DeepInfer without the prefix-cache patch,
  or a prompt prefix that changes between turns (the first divergent token position says which).
* Serialised arrivals: ``serial_window_requests`` consecutive requests each started while nothing
  else was in flight, from at least two sessions, mostly starting right after the previous one
  ended (within ``serial_back_to_back_s``), while the backend had capacity for many more. That is
  a queue in front of us, typically the worker's Concurrent requests left at 1. One agent alone
  is also serial, which is why at least two sessions must be interleaved.
* Unknown model names, counted by name with a bounded label set; Claude model ids get the hint
  to set ``ANTHROPIC_MODEL`` / ``ANTHROPIC_DEFAULT_HAIKU_MODEL``.

A warning stays active for ``warning_ttl_s`` after its last evidence, then expires.
"""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge

if TYPE_CHECKING:
    from server.config import WorkloadConfig

SYMPTOMS = ("uncached_repeat", "serial_requests", "unknown_model", "prompt_too_long")
_CLAUDE_RE = re.compile(r"claude|anthropic|sonnet|opus|haiku", re.IGNORECASE)
_LABEL_BAD_RE = re.compile(r"[^\x21-\x7e]")
OTHER_LABEL = "other"


@dataclass(slots=True, frozen=True)
class SymptomSettings:
    prefix_cache_enabled: bool = True
    block_size: int = 128
    capacity_slots: int = 512  # ranks x max_num_seqs: how many requests we could run at once
    served_model_name: str = "deepseek-v4.1-flash"
    uncached_window_turns: int = 32
    uncached_min_turns: int = 4
    uncached_ratio: float = 0.5
    serial_window_requests: int = 24
    serial_min_sessions: int = 2
    serial_back_to_back_s: float = 0.5
    serial_back_to_back_ratio: float = 0.75
    prompt_too_long_events: int = 3
    max_sessions: int = 65_536
    max_model_labels: int = 16
    max_label_chars: int = 64
    log_interval_s: float = 60.0
    warning_ttl_s: float = 900.0


def first_divergent_position(
    previous_prompt_ids: Sequence[int] | np.ndarray,
    previous_output_ids: Sequence[int] | np.ndarray,
    prompt_ids: Sequence[int] | np.ndarray,
) -> int:
    """First index where ``prompt_ids`` differs from previous prompt + output (vectorised).

    Equal to ``min(len(prompt), len(previous))`` when one is a prefix of the other.
    """
    prompt = np.asarray(prompt_ids, dtype=np.int64)
    offset = 0
    for part in (previous_prompt_ids, previous_output_ids):
        prev = np.asarray(part, dtype=np.int64)
        rest = prompt[offset:]
        n = min(len(prev), len(rest))
        diff = np.flatnonzero(prev[:n] != rest[:n])
        if len(diff):
            return offset + int(diff[0])
        offset += n
        if n < len(prev):
            return offset
    return offset


class _RateLimitedLog:
    """At most one line per key per interval; the next line says how many were suppressed."""

    __slots__ = ("_logger", "_interval_s", "_last", "_suppressed")

    def __init__(self, logger: logging.Logger, interval_s: float) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, now: float, message: str) -> bool:
        last = self._last.get(key)
        if last is not None and now - last < self._interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        self._last[key] = now
        skipped = self._suppressed.pop(key, 0)
        suffix = f" ({skipped} similar lines suppressed)" if skipped else ""
        self._logger.warning("symptom %s%s", message, suffix)
        return True


class RuntimeSymptoms:
    """Observer of serving-time symptoms. Invariants: ``in_flight >= 0``; the serial window holds
    only requests that started with nothing else in flight; label sets are bounded."""

    def __init__(
        self, registry: CollectorRegistry, settings: SymptomSettings | None = None, *,
        logger: logging.Logger | None = None, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = s = settings or SymptomSettings()
        self._clock = clock
        self._log = _RateLimitedLog(logger or logging.getLogger("deepinfer_backend.symptoms"),
                                    s.log_interval_s)
        self._active: dict[str, tuple[str, float]] = {}  # symptom -> (message, expires at)
        # uncached repeats
        self._sessions: OrderedDict[str, int] = OrderedDict()  # session -> turns seen (LRU bounded)
        self._uncached_window: deque[bool] = deque(maxlen=s.uncached_window_turns)
        self._num_uncached_in_window = 0
        # serialised arrivals
        self.in_flight = 0
        self._last_end_s: float | None = None
        self._serial_window: deque[tuple[str | None, bool]] = deque()
        self._serial_sessions: dict[str | None, int] = {}
        self._num_back_to_back = 0
        # unknown models / too long
        self._unknown_counts: dict[str, int] = {}
        self._too_long_times: deque[float] = deque(maxlen=s.prompt_too_long_events)

        self.m_repeat_turns = Counter("deepinfer_symptom_repeat_turns", "Repeat turns (turn 2+) of a session "
                                      "with a cacheable prompt", registry=registry)
        self.m_uncached_repeat_turns = Counter(
            "deepinfer_symptom_uncached_repeat_turns", "Repeat turns that reused 0 cached tokens",
            registry=registry)
        self.m_unknown_model = Counter(
            "deepinfer_symptom_unknown_model_requests", "Requests for a model this endpoint does not serve "
            f"(first {s.max_model_labels} names, then '{OTHER_LABEL}')", ["model"], registry=registry)
        self.m_prompt_too_long = Counter(
            "deepinfer_symptom_prompt_too_long", "Requests refused because prompt > max_model_len",
            registry=registry)
        self.m_serial_run = Gauge(
            "deepinfer_symptom_serial_run_requests", "Consecutive requests that started with nothing else in "
            "flight", registry=registry)
        self.m_active = Gauge("deepinfer_symptom_active", "1 while a symptom warning is active", ["symptom"],
                              registry=registry)
        for name in SYMPTOMS:
            self.m_active.labels(symptom=name).set(0)

    @classmethod
    def from_config(cls, config: WorkloadConfig, registry: CollectorRegistry,
                    **kwargs: object) -> RuntimeSymptoms:
        settings = SymptomSettings(
            prefix_cache_enabled=config.prefix_cache, block_size=config.block_size,
            capacity_slots=config.ep * config.max_num_seqs, served_model_name=config.model_name,
        )
        return cls(registry, settings, **kwargs)  # type: ignore[arg-type]

    # ---- warnings -----------------------------------------------------------------------------

    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else now

    def _activate(self, symptom: str, message: str, now: float) -> None:
        self._active[symptom] = (message, now + self.settings.warning_ttl_s)
        self.m_active.labels(symptom=symptom).set(1)

    def _clear(self, symptom: str) -> None:
        if self._active.pop(symptom, None) is not None:
            self.m_active.labels(symptom=symptom).set(0)

    def active_warnings(self, now: float | None = None) -> list[str]:
        """Current symptom warnings, one line each with its fix, for /healthz."""
        t = self._now(now)
        for symptom in [k for k, (_, expires) in self._active.items() if expires <= t]:
            self._clear(symptom)
        return [message for _, (message, _) in sorted(self._active.items())]

    # ---- serialised arrivals ------------------------------------------------------------------

    def observe_request_start(self, session_key: str | None, now: float | None = None) -> None:
        t = self._now(now)
        s = self.settings
        self.in_flight += 1
        if self.in_flight > 1:
            self._reset_serial()
            self._clear("serial_requests")
            return
        back_to_back = self._last_end_s is not None and t - self._last_end_s <= s.serial_back_to_back_s
        self._serial_window.append((session_key, back_to_back))
        self._serial_sessions[session_key] = self._serial_sessions.get(session_key, 0) + 1
        self._num_back_to_back += back_to_back
        if len(self._serial_window) > s.serial_window_requests:
            old_key, old_b2b = self._serial_window.popleft()
            self._num_back_to_back -= old_b2b
            left = self._serial_sessions[old_key] - 1
            if left:
                self._serial_sessions[old_key] = left
            else:
                del self._serial_sessions[old_key]
        self.m_serial_run.set(len(self._serial_window))
        sessions = len(self._serial_sessions) - (None in self._serial_sessions)  # unknown keys do not count
        if (
            s.capacity_slots > 1
            and len(self._serial_window) >= s.serial_window_requests
            and sessions >= s.serial_min_sessions
            and self._num_back_to_back >= s.serial_back_to_back_ratio * s.serial_window_requests
        ):
            message = (
                f"serial_requests: the last {len(self._serial_window)} requests from {sessions} sessions "
                f"arrived strictly one at a time, {self._num_back_to_back} of them right after the previous "
                f"one ended, while the ranks could run {s.capacity_slots}: a queue in front of the backend. "
                "Fix: raise the worker's Concurrent requests for this workload (a pinned workload starts "
                f"at 1) to {s.capacity_slots}."
            )
            self._log.warning("serial_requests", t, message)
            self._activate("serial_requests", message, t)

    def observe_request_end(self, session_key: str | None = None, now: float | None = None) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        self._last_end_s = self._now(now)

    def _reset_serial(self) -> None:
        self._serial_window.clear()
        self._serial_sessions.clear()
        self._num_back_to_back = 0
        self.m_serial_run.set(0)

    # ---- uncached repeat turns ----------------------------------------------------------------

    def observe_turn(
        self, session_key: str | None, num_prompt_tokens: int, num_cached_tokens: int,
        first_divergent_pos: int | None = None, *,
        previous_prompt_ids: Sequence[int] | np.ndarray | None = None,
        previous_output_ids: Sequence[int] | np.ndarray | None = None,
        prompt_ids: Sequence[int] | np.ndarray | None = None, now: float | None = None,
    ) -> None:
        """One turn's cache outcome. Pass ``first_divergent_pos`` if known, or the previous turn's
        prompt and output ids plus this prompt's ids to have it computed (only when uncached)."""
        if session_key is None:
            return  # no way to tell a repeat turn from a new conversation
        s = self.settings
        turns = self._sessions.pop(session_key, 0)
        self._sessions[session_key] = turns + 1
        if len(self._sessions) > s.max_sessions:
            self._sessions.popitem(last=False)
        if turns == 0 or not s.prefix_cache_enabled or num_prompt_tokens <= s.block_size:
            return
        uncached = num_cached_tokens <= 0
        self.m_repeat_turns.inc()
        if len(self._uncached_window) == self._uncached_window.maxlen:
            self._num_uncached_in_window -= self._uncached_window[0]
        self._uncached_window.append(uncached)
        self._num_uncached_in_window += uncached
        t = self._now(now)
        if not uncached:
            if self._num_uncached_in_window / len(self._uncached_window) < s.uncached_ratio:
                self._clear("uncached_repeat")
            return
        self.m_uncached_repeat_turns.inc()
        if first_divergent_pos is None and prompt_ids is not None and previous_prompt_ids is not None:
            first_divergent_pos = first_divergent_position(
                previous_prompt_ids, previous_output_ids if previous_output_ids is not None else (),
                prompt_ids
            )
        where = self._divergence_text(first_divergent_pos)
        self._log.warning(
            "uncached_turn", t,
            f"uncached_repeat: session {session_key[:24]} turn {turns + 1}: 0 of {num_prompt_tokens} prompt "
            f"tokens cached; {where}",
        )
        num, size = self._num_uncached_in_window, len(self._uncached_window)
        if num >= s.uncached_min_turns and num / size >= s.uncached_ratio:
            self._activate(
                "uncached_repeat",
                f"uncached_repeat: {num} of the last {size} repeat turns reused no cached tokens ({where}). "
                "Fix: install DeepInfer with the prefix-cache patch (inferencekey/deepinfer-sm100-cu132) if "
                "prefix_cache_api warned at startup; otherwise find what changes the prompt's start between "
                "turns.",
                t,
            )

    def _divergence_text(self, pos: int | None) -> str:
        if pos is None:
            return "first divergent token unknown"
        if pos < self.settings.block_size:
            return f"the prompt differs from the previous turn at token {pos}, inside the first block"
        return (f"the prompt matches the previous turn for {pos} tokens, so the cache should have hit "
                "(patch missing, blocks evicted, or routed to another rank)")

    # ---- model names, prompt length ------------------------------------------------------------

    def observe_unknown_model(self, name: str, now: float | None = None) -> None:
        s = self.settings
        label = _LABEL_BAD_RE.sub("?", str(name))[: s.max_label_chars] or "?"
        if label not in self._unknown_counts and len(self._unknown_counts) >= s.max_model_labels:
            label = OTHER_LABEL
        self._unknown_counts[label] = self._unknown_counts.get(label, 0) + 1
        self.m_unknown_model.labels(model=label).inc()
        t = self._now(now)
        if _CLAUDE_RE.search(str(name)):
            first, second = ("ANTHROPIC_DEFAULT_HAIKU_MODEL",
                             "ANTHROPIC_MODEL") if "haiku" in str(name).lower() \
                else ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL")
            fix = f"set {first} and {second} to {s.served_model_name} in Claude Code's environment"
        else:
            fix = f"send model {s.served_model_name} (or the workload slug, or 'default')"
        message = (f"unknown_model: {self._unknown_counts[label]} request(s) for model '{label}', which this "
                   f"endpoint does not serve (400). Fix: {fix}.")
        self._log.warning(f"unknown_model:{label}", t, message)
        self._activate("unknown_model", message, t)

    def observe_prompt_too_long(self, num_prompt_tokens: int, max_model_len: int,
                                now: float | None = None) -> None:
        """A 400 'prompt is too long'. Claude Code compacts on it; repeated ones mean its window is
        too big."""
        t = self._now(now)
        self.m_prompt_too_long.inc()
        self._too_long_times.append(t)
        if (len(self._too_long_times) == self._too_long_times.maxlen
                and t - self._too_long_times[0] <= self.settings.warning_ttl_s):
            message = (
                f"prompt_too_long: {len(self._too_long_times)} prompts over max_model_len {max_model_len} "
                f"recently (last {num_prompt_tokens} tokens). Fix: set CLAUDE_CODE_MAX_CONTEXT_TOKENS "
                f"below {max_model_len} (e.g. 500000) so Claude Code compacts before the limit.")
            self._log.warning("prompt_too_long", t, message)
            self._activate("prompt_too_long", message, t)

    def unknown_model_counts(self) -> dict[str, int]:
        return dict(self._unknown_counts)
