"""A rank dies (SIGKILL) or stalls (SIGSTOP) under 64 open streams.

Real pieces: ``Runtime`` with its HTTP server, ``CacheManager``, ``RankGroup`` of 4 CPU rank
processes (reference engine, 'null' model by default; RELIABILITY_MODEL=tiny for the real torch
model), streams over real HTTP (httpx), half ``/v1/messages`` and half ``/v1/chat/completions``.
The scenario lives in ``bench/fault_injection.py`` (also a command); these tests assert on the
outcomes only and print the figures (detection and recovery times are reported, not asserted).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest

from bench.fault_injection import FaultReport, fault_config, run_fault
from tests.support.runtime_thread import RuntimeThread

NUM_RANKS = 4
NUM_STREAMS = 64
MODEL = os.environ.get("RELIABILITY_MODEL", "null")


@pytest.fixture(scope="module")
def rt() -> Iterator[RuntimeThread]:
    with RuntimeThread(fault_config(num_ranks=NUM_RANKS, model=MODEL)) as handle:
        yield handle


def _check(report: FaultReport) -> None:
    print("\n" + "\n".join(report.lines()))
    n = report.num_in_flight_at_fault
    assert n > 0, "no stream was in flight at the fault: the test proved nothing"
    # every in-flight stream ended, none hung, each with its own API's error frame
    assert report.endings == {"error": n}, report.endings
    # Claude Code's non-streaming retry succeeded for every one of them once the group was back
    assert report.num_retried_ok == n and report.num_lost == 0
    # new requests during the restart: 503 + Retry-After in the route's shape, nothing else
    assert report.probes_503 >= 1
    assert report.probes_503_without_retry_after == 0
    assert not report.probe_shape_problems, report.probe_shape_problems
    assert set(report.probes_other) <= {"200"}, report.probes_other
    # /healthz said so, then recovered by itself
    assert any(s.startswith("503:") for s in report.healthz_states), report.healthz_states
    assert report.healthz_states[-1] == "200:ready"
    assert report.epoch_after == report.epoch_before + 1
    assert report.serves_after_restart
    # nothing of the dead epoch survived in L0; the new epoch's index equals the engines'. (L1's
    # committed copies do survive: tests/e2e/test_warm_restart.py; this load never writes L1.)
    assert sum(report.sizes_before_fault["l0_blocks"]) > 0, "warm-up filed nothing: weak test"
    restart = report.sizes_at_restart
    assert restart, "the restart listener never ran"
    assert restart["l0_blocks"] == [0] * NUM_RANKS
    assert restart["cache_epoch"] == restart["epoch"] == report.epoch_after
    after = report.sizes_after_settle
    assert after["l0_blocks"] == after["engine_cached_blocks"]


@pytest.mark.timeout(1200)
def test_sigkill_one_rank_under_64_streams(rt: RuntimeThread) -> None:
    report = asyncio.run(run_fault(rt, "kill", num_streams=NUM_STREAMS, victim_rank=1))
    _check(report)


@pytest.mark.timeout(1200)
def test_sigstop_one_rank_under_64_streams(rt: RuntimeThread) -> None:
    report = asyncio.run(run_fault(rt, "stop", num_streams=NUM_STREAMS, victim_rank=2))
    _check(report)
    assert "stalled" in (report.last_failure or ""), report.last_failure
