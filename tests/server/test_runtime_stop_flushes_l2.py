"""The runtime's graceful stop hands the cache its close (the L2 flush) before the ranks stop.

Regression (6887c3f, fixed in e6b18d3): the refactor dropped ``Runtime._stop``'s
``hasattr(cache, 'close')`` call as dead while ``CacheManager.close`` (flush idle sessions through
L1 to ``l2_dir/kv``) landed next to it, so a stopped backend left on disk only what had spilled
while serving. Only the slow e2e
``test_a_vanished_l2_directory_is_recreated_and_the_sessions_spill_again`` noticed (its next
backend found nothing cached). Here: one turn with the write-through turned off
(``l1_write_watermark`` 1.0; every turn is written through by default), so nothing reaches disk
unless the stop flushes it.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from server.config import WorkloadConfig, load_config
from server.runtime import Runtime
from tests.server.server_test_helpers import run_runtime
from tests.support.bodies import filler_text

pytestmark = pytest.mark.timeout(120)


def test_stop_flushes_idle_sessions_to_l2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The turn is not written through to L1 (nor spilled to L2) while the backend serves.
    cache_config = WorkloadConfig.cache_config
    monkeypatch.setattr(WorkloadConfig, "cache_config",
                        lambda self, **o: cache_config(self, l1_write_watermark=1.0, **o))
    config = load_config({
        "engine": "reference", "reference_model": "null", "ep": 1, "block_size": 16,
        "reference_num_blocks": 256, "max_model_len": 3800, "max_num_batched_tokens": 4096,
        "l1_host_gb": 0.02, "l2_dir": str(tmp_path / "l2"), "l2_gb": 0.5, "port": 0,
    })
    runtime = Runtime(config, rank_mode="local")
    with run_runtime(runtime):
        store = runtime.l2
        assert store is not None, "L2 off in this config"
        body = {"model": "default", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": filler_text(1, 600)}]}
        r = httpx.post(runtime.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        spilled_while_serving = store.counters.saved_blocks
    # run_runtime's exit ran Runtime.stop
    assert spilled_while_serving == 0, "the turn already spilled while serving: the test proves nothing"
    assert store.counters.saved_blocks > 0, "the stop flushed nothing to L2"
    assert any((tmp_path / "l2" / "kv").glob("*.kv"))


def test_a_failed_flush_is_logged_and_the_stop_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config({
        "engine": "reference", "reference_model": "null", "ep": 1, "block_size": 16,
        "reference_num_blocks": 256, "max_model_len": 3800, "max_num_batched_tokens": 4096,
        "l1_host_gb": 0.02, "l2_dir": str(tmp_path / "l2"), "l2_gb": 0.5, "port": 0,
    })
    runtime = Runtime(config, rank_mode="local")

    async def broken_close() -> None:
        raise OSError("disk gone")

    with run_runtime(runtime):
        assert runtime.cache is not None
        monkeypatch.setattr(runtime.cache, "close", broken_close)
    assert "flushing idle sessions to L2 failed" in caplog.text
    assert "disk gone" in caplog.text
    assert runtime.group is None, "the stop did not go on to close the ranks"
