"""Sessions stay warm across a rank SIGKILL (from L1) and a full backend restart (from L2).

Real pieces: ``python -m deepinfer_backend serve`` as a subprocess (the product's entry point),
its ``RankGroup`` of 2 CPU rank processes with the reference engine (``null`` model by default,
``WARM_MODEL=tiny`` for the torch model), requests over real HTTP. A session's first turn is
~2,950 prompt tokens; its second turn repeats the first (with the reply) and adds a question.
The cached share of the second turn's prompt comes from the API's own usage
(``prompt_tokens_details.cached_tokens``), the tier from the ``deepinfer_cached_tokens_total``
metric. Run with ``-s`` to print the figures (times are printed, never asserted).

Damaged or foreign L2 files between the two backends (a byte flipped inside an extent, an
extent written by another model under the same served name) cost cached tokens, never a client
error: the turn answers 200 with the same reply and the backend logs why it did not load them.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import struct
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.e2e_harness import API_KEY, Backend
from tests.support.bodies import filler_text

pytestmark = pytest.mark.timeout(600)

MODEL = os.environ.get("WARM_MODEL", "null")


def _config(l2_dir: Path | None = None, model: str = MODEL) -> dict[str, Any]:
    # 256 blocks of 16 tokens per rank: one ~2,950-token session (~185 blocks) fills over half of a rank's
    # pool (every finished turn is written through to L1; test_writethrough_crash.py: an idle pool).
    raw: dict[str, Any] = {
        "engine": "reference", "reference_model": model, "block_size": 16, "reference_num_blocks": 256,
        "max_model_len": 3800, "max_num_batched_tokens": 4096, "l1_host_gb": 0.02,
    }
    if l2_dir is not None:
        raw.update(l2_dir=str(l2_dir), l2_gb=0.5)
    return raw


def _chat(backend: Backend, messages: list[dict[str, str]]) -> tuple[dict[str, Any], float]:
    started = time.perf_counter()
    r = httpx.post(f"{backend.base_url}/v1/chat/completions", timeout=300,
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": "default", "messages": messages, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json(), time.perf_counter() - started


def _first_turn(backend: Backend, seed: int) -> tuple[list[dict[str, str]], dict[str, Any], float]:
    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": filler_text(seed, 1800)}]
    body, took = _chat(backend, messages)
    reply = body["choices"][0]["message"]["content"] or ""
    return messages + [{"role": "assistant", "content": reply}], body["usage"], took


def _next_turn(backend: Backend, history: list[dict[str, str]]) -> tuple[dict[str, Any], float]:
    usage, _, took = _next_turn_reply(backend, history)
    return usage, took


def _next_turn_reply(backend: Backend, history: list[dict[str, str]]) -> tuple[dict[str, Any], str, float]:
    body, took = _chat(backend, history + [{"role": "user", "content": "And the tests?"}])
    return body["usage"], body["choices"][0]["message"]["content"] or "", took


def _cached_share(usage: dict[str, Any]) -> float:
    return usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"]


def _tier_tokens(backend: Backend, tier: str) -> float:
    return backend.metrics().get(f'deepinfer_cached_tokens_total{{tier="{tier}"}}', 0.0)


def _wait_restarted(backend: Backend, old_pids: list[int], timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = set(backend.rank_pids())
        fresh = len(pids) == len(old_pids) and not pids & set(old_pids)
        if fresh and backend.health().get("status") == "ready":
            return
        time.sleep(0.2)
    raise AssertionError(f"the rank group did not come back: {backend.health()}")


def _wait_l1_written(backend: Backend, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if backend.metric_sum("deepinfer_cache_l1_written_blocks_total") > 0:
            return
        time.sleep(0.1)
    raise AssertionError("the first turn was never written through to L1")


def _start(backends: list[Backend], tmp_path: Path, config: dict[str, Any]) -> Backend:
    script = tmp_path / "unused-script.txt"
    script.write_text("")
    backend = Backend.start(script, ranks=2, config=config, timeout_s=300)
    backends.append(backend)
    return backend


def test_next_turn_after_a_rank_sigkill_restores_from_l1(tmp_path: Path, backends: list[Backend]) -> None:
    backend = _start(backends, tmp_path, _config())
    history, first, cold_s = _first_turn(backend, seed=1)
    _wait_l1_written(backend)
    pids = backend.rank_pids()
    assert len(pids) == 2, pids
    os.kill(pids[1], signal.SIGKILL)
    _wait_restarted(backend, pids)
    l1_before = _tier_tokens(backend, "l1")
    usage, warm_s = _next_turn(backend, history)
    share = _cached_share(usage)
    print(f"\nrank SIGKILL -> next turn: {usage['prompt_tokens_details']['cached_tokens']} of "
          f"{usage['prompt_tokens']} prompt tokens cached ({share:.1%}), "
          f"{_tier_tokens(backend, 'l1') - l1_before:.0f} from L1; turn {warm_s:.2f} s "
          f"(first turn, cold: {cold_s:.2f} s for {first['prompt_tokens']} tokens) [{MODEL}]")
    assert share >= 0.9
    assert _tier_tokens(backend, "l1") - l1_before >= 0.9 * usage["prompt_tokens"]


def _kill_backend(backend: Backend) -> None:
    """SIGKILL the backend and its ranks (an OOM kill, a lost host): no flush, no cleanup; the
    host pool file it leaves in /dev/shm is removed here (a new backend uses its own name)."""
    pid = backend.proc.pid
    os.killpg(pid, signal.SIGKILL)
    backend.proc.wait(timeout=30)
    for leftover in Path("/dev/shm").glob(f"dib-l1-g{pid}-*"):
        leftover.unlink(missing_ok=True)


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_next_turn_after_a_full_backend_restart_restores_from_l2(
    tmp_path: Path, backends: list[Backend], stop: str
) -> None:
    """SIGTERM: a graceful stop (a redeploy) flushes idle sessions to disk. SIGKILL of the whole
    backend: what the write-behind spill had saved (the session was written through to L1) is
    all there is, and it is enough."""
    l2_dir = tmp_path / "l2"
    backend = _start(backends, tmp_path, _config(l2_dir))
    history, first, cold_s = _first_turn(backend, seed=2)
    if stop == "sigterm":
        backend.stop()
    else:
        _wait_saved(backend, 0)
        _kill_backend(backend)
    assert backend.proc.returncode is not None
    assert any(name.endswith(".kv") for name in os.listdir(l2_dir / "kv"))
    again = _start(backends, tmp_path, _config(l2_dir))
    usage, warm_s = _next_turn(again, history)
    share = _cached_share(usage)
    l2_tokens = _tier_tokens(again, "l2")
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    print(f"\nfull backend restart ({stop}) -> next turn: {cached} of {usage['prompt_tokens']} prompt "
          f"tokens cached ({share:.1%}), {l2_tokens:.0f} from L2; turn {warm_s:.2f} s (first turn, cold: "
          f"{cold_s:.2f} s for {first['prompt_tokens']} tokens) [{MODEL}]")
    assert share >= 0.9
    assert l2_tokens >= 0.9 * usage["prompt_tokens"]
    # The protocol state under l2_dir/protocol came back too: the first turn's reply in the output
    # ledger (its ids re-render exactly) and its tokenized pieces.
    restored = re.search(r"(\d+) tokenized pieces and (\d+) ledger entries restored", again.log_text())
    assert restored is not None and int(restored[1]) > 0 and int(restored[2]) >= 1, again.log_text()[-3000:]


def _flip_payload_byte(path: Path) -> int:
    """Flip one byte in the middle of an extent's payload (the header stays valid); returns the
    extent's block count. Layout: cache/l2_format.py (payload last, padded to 4 KiB)."""
    raw = path.read_bytes()
    # After magic, version, header length (16 B) and first_block (4 B).
    num_blocks, bytes_per_block = struct.unpack_from("<IQ", raw, 16 + 4)
    payload_bytes = -(-num_blocks * bytes_per_block // 4096) * 4096
    offset = len(raw) - payload_bytes + (num_blocks // 2) * bytes_per_block + 1
    with path.open("r+b") as f:
        f.seek(offset)
        f.write(bytes([raw[offset] ^ 0x5A]))
    return int(num_blocks)


def test_a_corrupted_l2_file_costs_cached_tokens_never_the_reply(
    tmp_path: Path, backends: list[Backend]
) -> None:
    """'tiny' (real float KV): the next turn after the restart reads the verified prefix of the
    damaged extent from disk, recomputes the rest, and answers exactly as the first backend did
    with the session warm on its GPU. The L2 token count and the log line are what would catch a
    skipped checksum (one flipped byte left the 8-token greedy reply unchanged when tried)."""
    l2_dir = tmp_path / "l2"
    backend = _start(backends, tmp_path, _config(l2_dir, model="tiny"))
    history, _, _ = _first_turn(backend, seed=3)
    _, reference_reply, _ = _next_turn_reply(backend, history)
    backend.stop()
    extents = sorted((l2_dir / "kv").glob("*.kv"), key=lambda p: p.stat().st_mtime)
    assert extents, "nothing was spilled at the graceful stop"
    flipped = {p.name: _flip_payload_byte(p) for p in extents}
    again = _start(backends, tmp_path, _config(l2_dir, model="tiny"))
    usage, reply, _ = _next_turn_reply(again, history)
    l2_tokens = _tier_tokens(again, "l2")
    log_text = again.log_text()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    print(f"\ncorrupted L2 extents {flipped} -> next turn: {cached} of {usage['prompt_tokens']} prompt "
          f"tokens cached, {l2_tokens:.0f} from L2 (the verified prefix)")
    assert reply == reference_reply
    assert "failed its checksum" in log_text, log_text[-3000:]
    assert 0 < l2_tokens < 0.9 * usage["prompt_tokens"]  # the first extent's blocks before the flipped one
    assert not any((l2_dir / "kv" / name).exists() for name in flipped)  # dropped with their dependants


def test_another_models_l2_files_are_rejected_at_start(tmp_path: Path, backends: list[Backend]) -> None:
    """Same engine and served model name (so the same chain hashes), another reference model:
    the stamp (geometry, KV layout) keeps the first backend's KV out of the second."""
    l2_dir = tmp_path / "l2"
    backend = _start(backends, tmp_path, _config(l2_dir, model="null"))
    history, _, _ = _first_turn(backend, seed=4)
    backend.stop()
    written = {p.name for p in (l2_dir / "kv").glob("*.kv")}
    assert written
    again = _start(backends, tmp_path, _config(l2_dir, model="tiny"))
    log_text = again.log_text()
    assert "foreign" in log_text and "deleted" in log_text, log_text[-3000:]
    usage, _, _ = _next_turn_reply(again, history)
    assert _tier_tokens(again, "l2") == 0
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert not written & {p.name for p in (l2_dir / "kv").glob("*.kv")}


def _kv_bytes(l2_dir: Path) -> int:
    return sum(p.stat().st_size for p in (l2_dir / "kv").iterdir() if p.is_file())


def _wait_saved(backend: Backend, above: float, timeout_s: float = 60) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        saved = backend.metric_sum("deepinfer_cache_l2_saved_blocks") + backend.metric_sum(
            "deepinfer_cache_l2_skipped_saves")
        if saved > above:
            return saved
        time.sleep(0.1)
    raise AssertionError("no spill to L2 after the turn")


def test_spills_hold_the_disk_bound(tmp_path: Path, backends: list[Backend]) -> None:
    """``l2_gb`` = 40 KiB: room for two ~16 KiB extents ('null': 64 B per block of 16 tokens, a
    ~185-block session plus a 4 KiB header). Four sessions spill one after another; the oldest
    extents are evicted (LRU) and ``kv/`` never holds more than the bound once a spill is done."""
    l2_dir = tmp_path / "l2"
    bound = 40 * 1024
    backend = _start(backends, tmp_path, {**_config(l2_dir, model="null"), "l2_gb": bound / (1 << 30)})
    done = 0.0
    sizes = []
    for seed in range(10, 14):
        _first_turn(backend, seed=seed)
        done = _wait_saved(backend, done)
        sizes.append(_kv_bytes(l2_dir))
        assert sizes[-1] <= bound, sizes
    gauges = backend.metrics()
    print(f"\nL2 bound {bound} B: kv/ after each spill {sizes} B; "
          f"{gauges['deepinfer_cache_l2_evicted_extents']:.0f} extents evicted, "
          f"{gauges['deepinfer_cache_l2_saved_blocks']:.0f} blocks saved")
    assert gauges["deepinfer_cache_l2_bound_bytes"] == bound
    assert gauges["deepinfer_cache_l2_used_bytes"] <= bound
    assert gauges["deepinfer_cache_l2_evicted_extents"] >= 1  # the bound was reached and held by eviction
    assert gauges["deepinfer_cache_l2_write_errors"] == 0


def test_a_vanished_l2_directory_is_recreated_and_the_sessions_spill_again(
    tmp_path: Path, backends: list[Backend]
) -> None:
    """``kv/`` is removed under a running backend (rm -rf, an unmounted disk): the next spill
    fails, the store forgets its index and recreates the directory, and the graceful stop writes
    every idle session again, so a new backend still finds both sessions on disk."""
    l2_dir = tmp_path / "l2"
    backend = _start(backends, tmp_path, _config(l2_dir))
    first_history, _, _ = _first_turn(backend, seed=5)
    saved = _wait_saved(backend, 0)
    shutil.rmtree(l2_dir / "kv")
    second_history, _, _ = _first_turn(backend, seed=6)
    deadline = time.monotonic() + 60
    while backend.metric_sum("deepinfer_cache_l2_write_errors") < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "is gone" in backend.log_text(), backend.log_text()[-3000:]
    assert (l2_dir / "kv").is_dir()
    backend.stop()
    again = _start(backends, tmp_path, _config(l2_dir))
    prompt_tokens = 0
    for history in (first_history, second_history):
        usage, _ = _next_turn(again, history)
        assert _cached_share(usage) >= 0.9, (saved, usage)
        prompt_tokens += usage["prompt_tokens"]
    assert _tier_tokens(again, "l2") >= 0.9 * prompt_tokens
