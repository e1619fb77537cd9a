"""A finished turn survives a crash on an idle pool: written through to L1 (and L2 behind it).

A session whose rank pool never came under pressure used to live on the GPU alone: a rank SIGKILL
two seconds after its turn logged ``kept 0 L1 entries`` and the next turn was 0% cached. Now every
finished turn's new blocks go to L1 beside the step and spill to L2 behind it
(``cache/l1_writes.py``, ``write_through_later``), so a rank kill or the whole backend's death
loses only the turns in flight. The killed backend's L1 pool file in ``/dev/shm`` is removed by
the next backend's start (``rank/shm_claim.py``), and the live one's is not.

Real pieces: ``python -m deepinfer_backend serve`` as a subprocess with 2 CPU rank processes of the
reference engine (``null`` model), 2,048 blocks per rank: the ~185-block session fills 9% of its
rank's pool. Nothing waits for a metric between the turn and the kill: the kill comes ~2 s after
the answer. The cached share comes from the API's own usage.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.e2e_harness import Backend
from tests.e2e.test_warm_restart import _cached_share, _first_turn, _next_turn, _start, _wait_restarted

pytestmark = pytest.mark.timeout(600)

KILL_AFTER_S = 2.0


def _idle_pool_config(l2_dir: Path) -> dict[str, Any]:
    return {"engine": "reference", "reference_model": "null", "block_size": 16, "reference_num_blocks": 2048,
            "max_model_len": 3800, "max_num_batched_tokens": 4096, "l1_host_gb": 0.05,
            "l2_dir": str(l2_dir), "l2_gb": 0.5}


def test_idle_pool_session_survives_a_rank_sigkill(tmp_path: Path, backends: list[Backend]) -> None:
    backend = _start(backends, tmp_path, _idle_pool_config(tmp_path / "l2"))
    history, _, _ = _first_turn(backend, seed=11)
    time.sleep(KILL_AFTER_S)
    pids = backend.rank_pids()
    assert len(pids) == 2, pids
    for pid in pids:  # whichever rank held the session
        os.kill(pid, signal.SIGKILL)
    _wait_restarted(backend, pids)
    usage, took = _next_turn(backend, history)
    share = _cached_share(usage)
    print(f"\nidle pool, rank SIGKILL {KILL_AFTER_S:.0f} s after the turn -> next turn "
          f"{usage['prompt_tokens_details']['cached_tokens']} of {usage['prompt_tokens']} cached "
          f"({share:.1%}), {took:.2f} s")
    assert share >= 0.9, backend.log_text()[-3000:]


def test_idle_pool_session_survives_the_whole_backend_dying(tmp_path: Path, backends: list[Backend]) -> None:
    l2_dir = tmp_path / "l2"
    backend = _start(backends, tmp_path, _idle_pool_config(l2_dir))
    history, _, _ = _first_turn(backend, seed=12)
    time.sleep(KILL_AFTER_S)
    pid = backend.proc.pid
    os.killpg(pid, signal.SIGKILL)  # the backend and its ranks: no flush, no cleanup (the OOM killer)
    backend.proc.wait(timeout=30)
    orphans = list(Path("/dev/shm").glob(f"dib-l1-g{pid}-*"))
    assert orphans, "the killed backend left no pool file: nothing to reclaim"
    again = _start(backends, tmp_path, _idle_pool_config(l2_dir))
    assert not [p for p in orphans if p.exists()], "the next start did not remove the orphan pool file"
    assert list(Path("/dev/shm").glob(f"dib-l1-g{again.proc.pid}-*")), "the live backend's pool is gone"
    usage, took = _next_turn(again, history)
    share = _cached_share(usage)
    print(f"\nidle pool, backend SIGKILL {KILL_AFTER_S:.0f} s after the turn -> new backend, next turn "
          f"{usage['prompt_tokens_details']['cached_tokens']} of {usage['prompt_tokens']} cached "
          f"({share:.1%}), {took:.2f} s")
    assert share >= 0.9, again.log_text()[-3000:]
