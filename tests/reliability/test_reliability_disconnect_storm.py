"""1,000 streams cut by their clients at random points.

Raw-socket clients (``bench/reliability/storm.py``) cut in the request headers, in the body, after
the request, or after a random number of response bytes, with FIN or RST. Afterwards every engine
request has ended (aborted, or finished before the cut), and free blocks, cache-held blocks and
L1 slots balance exactly (engine ``check_accounting``, ``CacheManager.check_balance``, free +
cache-held == pool). Default run: in-process ranks (``LocalRankGroup``), null model. The slow
variant runs 4 rank processes (``RankGroup``).
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from bench.reliability.storm import StormReport, run_storm, storm_config
from tests.support.runtime_thread import RuntimeThread


def _check(report: StormReport, caplog: pytest.LogCaptureFixture) -> None:
    print("\n" + "\n".join(report.lines()))
    assert report.balance_error is None, report.balance_error
    assert not report.problems, report.problems[:10]
    assert "hung" not in report.client_saw
    engine = report.engine
    assert engine["submitted"] > report.num_streams // 2
    # the storm really cut streams that were running in the engine
    assert engine.get("finish_abort", 0) >= report.num_streams // 10
    assert engine.get("finish_abort", 0) <= engine["abort_calls"]
    after = report.sizes_after
    assert after["open_admissions"] == 0 and after["running"] == [0] * len(after["running"])
    assert [f + c for f, c in zip(after["engine_free_blocks"], after["engine_cached_blocks"])] == \
        [after["num_blocks"] - 1] * len(after["running"])
    # a client going away is normal: never an error with a traceback in the server's log
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors[:5]]


@pytest.mark.timeout(600)
def test_disconnect_storm_1000_streams_local_ranks(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with RuntimeThread(storm_config(rank_mode="local"), rank_mode="local") as rt:
        report = asyncio.run(run_storm(rt, num_streams=1000, concurrency=64, seed=7))
    _check(report, caplog)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_disconnect_storm_1000_streams_4_rank_processes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    config = storm_config(rank_mode="process", num_ranks=4, reference_num_blocks=1024)
    with RuntimeThread(config, rank_mode="process") as rt:
        report = asyncio.run(run_storm(rt, num_streams=1000, concurrency=64, seed=11))
    _check(report, caplog)
