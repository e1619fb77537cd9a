"""A rank group restart does not wait for the L1 pool's pin (``rank/host_pool.py``, background pin).

``cudaHostRegister`` of a fresh ``/dev/shm`` mapping took 0.46-0.58 s per GiB on an H200 host, so a
rank that pinned its 128 GiB share before saying ready took minutes at every restart. Now the pool
serves at once (pageable) and is pinned by a thread. On this CPU host there is no
``cudaHostRegister``: the test knob ``DIB_HOST_POOL_PIN_S_PER_GIB`` stretches the pin phase instead,
here to ~``PIN_S`` per rank, and the test shows: the group restarted after a rank SIGKILL is ready
and serves the session from L1 (>= 90% cached) long before the pin phase ends; the pin ends later
(the rank logs ``pinned in``). The H200 figure with a real pool is not measured here.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.e2e_harness import Backend
from tests.e2e.test_warm_restart import _cached_share, _first_turn, _next_turn, _wait_restarted

pytestmark = pytest.mark.timeout(600)

POOL_GB = 0.05  # per rank; the shared pool is 0.1 GiB for 2 ranks
PIN_S = 60.0


def test_restart_is_ready_and_warm_before_the_pool_is_pinned(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DIB_HOST_POOL_PIN_S_PER_GIB", str(PIN_S / (2 * POOL_GB)))
    script = tmp_path / "unused-script.txt"
    script.write_text("")
    config = {"engine": "reference", "reference_model": "null", "block_size": 16,
              "reference_num_blocks": 2048, "max_model_len": 3800, "max_num_batched_tokens": 4096,
              "l1_host_gb": POOL_GB}
    backend = Backend.start(script, ranks=2, config=config, timeout_s=300)
    try:
        history, _, _ = _first_turn(backend, seed=31)
        time.sleep(2.0)
        pids = backend.rank_pids()
        killed_at = time.monotonic()
        offset = len(backend.log_text())  # what the restarted epoch logs comes after this
        os.kill(pids[0], signal.SIGKILL)
        _wait_restarted(backend, pids)
        ready_s = time.monotonic() - killed_at
        usage, took = _next_turn(backend, history)
        after = backend.log_text()[offset:]
        print(f"\nrank SIGKILL -> group ready in {ready_s:.1f} s with the new ranks' pools pinning in the "
              f"background (simulated {PIN_S:.0f} s each); next turn "
              f"{usage['prompt_tokens_details']['cached_tokens']} of {usage['prompt_tokens']} cached "
              f"({_cached_share(usage):.1%}) in {took:.2f} s")
        assert _cached_share(usage) >= 0.9
        assert after.count("pinning in the background") == 2, after[-3000:]
        assert "pinned in" not in after, "the restarted ranks' pins ended before the turn: too short a pin"
        new_pids = backend.rank_pids()
        deadline = time.monotonic() + PIN_S + 60
        while time.monotonic() < deadline and backend.log_text()[offset:].count("pinned in") < 2:
            time.sleep(1.0)
        final = re.findall(r"pinned in ([\d.]+) s", backend.log_text()[offset:])
        print(f"the restarted ranks' pin phases ended after {final} s; ready had taken {ready_s:.1f} s")
        assert len(final) == 2 and backend.rank_pids() == new_pids
    finally:
        backend.stop()
