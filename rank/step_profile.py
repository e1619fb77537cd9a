"""Where a rank's loop spends each step, by phase (benchmarks only: ``DIB_RANK_PROFILE``).

``bench/decode_bench.py`` sets ``DIB_RANK_PROFILE=<dir>`` in the backend's environment (the
group passes ``DIB_*`` on to its ranks); each rank then records, for every iteration in which its
group stepped, the wall and CPU (thread) nanoseconds of each phase below, plus how many outputs
and tokens the step produced, and writes ``<dir>/rank<R>.json`` when its loop ends. Without the
variable the worker uses ``NO_PROFILE``, whose ``lap`` does nothing.

Phases (``PHASES``, in loop order; ``lap(i)`` charges the time since the previous lap to ``i``):

* ``drain``: receiving and handling commands (adds, aborts) from the backend;
* ``vote``: the lockstep vote (DeepInfer's ``has_unfinished_requests`` all_reduce);
* ``engine``: the engine's own step (DeepInfer's ``LLMEngine.step``: its scheduler, the forward
  (null in the benchmark), ``process_outputs`` and ``build_request_outputs``), timed by wrapping
  the engine's ``llm.step``/``llm.flush_inflight_reqs`` (``wrap_engine_step``);
* ``adapter``: the adapter's step bookkeeping around it (reading DeepInfer's outputs into
  ``RequestOutput`` records, terminal outputs, kept blocks);
* ``stats``: ``engine.stats()`` for the step message;
* ``encode``: ``wire.encode_step``;
* ``send``: the zmq send of the step message;
* ``other``: the rest of the iteration (periodic stats, loop bookkeeping).

The clocks cost about a microsecond per lap (``time.thread_time_ns`` is a system call).
"""

from __future__ import annotations

import os
import time
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rank.engine import Engine, RequestOutput

PROFILE_ENV = "DIB_RANK_PROFILE"
PHASES = ("drain", "vote", "engine", "adapter", "stats", "encode", "send", "other")
DRAIN, VOTE, ENGINE, ADAPTER, STATS, ENCODE, SEND, OTHER = range(len(PHASES))
_ROW = 2 * len(PHASES) + 2  # (wall, cpu) per phase, then outputs, tokens


class NoProfile:
    """The worker's profile when ``DIB_RANK_PROFILE`` is not set: every call does nothing."""

    def begin(self) -> None:
        pass

    def lap(self, phase: int) -> None:
        pass

    def end(self, busy: bool, outputs: Sequence[RequestOutput] = ()) -> None:
        pass

    def wrap_engine_step(self, engine: Engine) -> None:
        pass

    def write(self) -> None:
        pass


NO_PROFILE = NoProfile()


class StepProfile(NoProfile):
    """Per-iteration phase timings of one rank (module docstring); main thread only."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.rows = array("q")
        self._cur = [0] * _ROW
        self._wall = self._cpu = 0

    def begin(self) -> None:
        self._cur = [0] * _ROW
        self._wall, self._cpu = time.perf_counter_ns(), time.thread_time_ns()

    def lap(self, phase: int) -> None:
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        cur = self._cur
        cur[2 * phase] += wall - self._wall
        cur[2 * phase + 1] += cpu - self._cpu
        self._wall, self._cpu = wall, cpu

    def end(self, busy: bool, outputs: Sequence[RequestOutput] = ()) -> None:
        """Close the iteration (the remainder goes to ``other``); keep it if the group stepped."""
        self.lap(OTHER)
        if busy:
            self._cur[-2] = len(outputs)
            self._cur[-1] = sum(len(out.token_ids) for out in outputs)
            self.rows.extend(self._cur)

    def wrap_engine_step(self, engine: Engine) -> None:
        """Time DeepInfer's own step inside ``engine.step()`` (the ``engine`` phase)."""
        llm = getattr(engine, "llm", None)
        if llm is None:
            return
        for name in ("step", "flush_inflight_reqs"):
            inner = getattr(llm, name)

            def timed(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
                self.lap(ADAPTER)
                result = _inner(*args, **kwargs)
                self.lap(ENGINE)
                return result

            setattr(llm, name, timed)

    def write(self) -> None:
        import orjson

        with open(self.path, "wb") as f:
            f.write(orjson.dumps({"phases": list(PHASES), "row": _ROW, "rows": self.rows.tolist()}))


def from_environment(rank: int) -> NoProfile:
    """``StepProfile`` writing ``$DIB_RANK_PROFILE/rank<rank>.json`` if the variable is set."""
    directory = os.environ.get(PROFILE_ENV)
    if not directory:
        return NO_PROFILE
    return StepProfile(os.path.join(directory, f"rank{rank}.json"))
