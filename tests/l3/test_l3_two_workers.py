"""Two workers on one machine share a Mooncake Store (L3): a session served on worker A has its next
turn on worker B, warm from L3; then every fault of the store, each on its own session.

Real pieces: one ``mooncake_master`` on loopback; two ``python -m deepinfer_backend serve``
subprocesses (reference engine on CPU, one rank each: the ``null`` model by default,
``L3_MODEL=tiny`` for the torch model, whose replies depend on every KV row), each a client of the
master (A lends the pool its RAM, B lends none, so A is the holder of every object); requests
over real HTTP. The cached share comes from the API's usage, the L3 share from B's
``deepinfer_cache_l3_loaded_blocks``. "Answered correctly": B's reply equals the one A gives to the
same request from its own GPU-tier cache (the reference engine is deterministic at temperature 0,
so a restore of wrong KV would change it).

Faults: an object garbled in the store (found through the master's ``/get_all_keys`` and
overwritten with a client of the test's own), the pool full, the master killed (and restarted),
the holder killed. Each costs cached tokens, never a client error, and only verified prefixes
are restored. Run with ``-s`` to print the figures. Needs Mooncake's client (scripts/setup_l3.sh);
without it the test skips, except where ``DIB_L3_REQUIRED=1`` (CI) makes that a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from cache.l3_client import mooncake_available
from tests.e2e.e2e_harness import API_KEY, Backend
from tests.support.bodies import filler_text
from tests.support.ports import free_port

pytestmark = pytest.mark.timeout(240)
BLOCK = 16
MODEL = os.environ.get("L3_MODEL", "null")


def _require_mooncake() -> None:
    missing = mooncake_available()
    if missing is None and _master_binary() is not None:
        return
    why = f"Mooncake Store client not installed ({missing or 'no mooncake_master'}): bash scripts/setup_l3.sh"
    if os.environ.get("DIB_L3_REQUIRED") == "1":
        pytest.fail(why)
    pytest.skip(why)


def _master_binary() -> str | None:
    beside = Path(sys.executable).parent / "mooncake_master"
    return str(beside) if beside.exists() else shutil.which("mooncake_master")


class Master:
    def __init__(self, workdir: Path) -> None:
        self.rpc_port, self.http_port = free_port(), free_port()
        self.log = workdir / "mooncake_master.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def start(self) -> None:
        binary = _master_binary()
        assert binary is not None
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [binary, f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                 f"--metrics_port={self.http_port}", "--metrics_host=127.0.0.1"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.rpc_port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"mooncake_master did not listen: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def keys(self) -> set[str]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/get_all_keys", timeout=5) as r:
            return {k for k in r.read().decode().split() if k}


def _config(master: Master, segment_gb: float) -> dict[str, Any]:
    # 256 blocks of 16 tokens: a ~2,950-token session (~185 blocks) fills over half of the rank's pool, past
    # l1_write_watermark (0.5), so its finished turn is written through to L1, and so on to L3 (write-behind).
    return {"engine": "reference", "reference_model": MODEL, "block_size": BLOCK, "reference_num_blocks": 256,
            "max_model_len": 3800, "max_num_batched_tokens": 4096, "l1_host_gb": 0.02, "ep": 1,
            "l3": {"master": master.address, "segment_gb": segment_gb, "buffer_mb": 8, "timeout_secs": 2,
                   "probe_timeout_secs": 0.5, "retry_secs": 2,
                   "prefill_tokens_per_sec": 20_000}}  # a CPU reference engine, not a node of H200s


def _chat(backend: Backend, messages: list[dict[str, str]]) -> dict[str, Any]:
    r = httpx.post(f"{backend.base_url}/v1/chat/completions", timeout=300,
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": "default", "messages": messages, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    return dict(r.json())


def _reply(body: dict[str, Any]) -> str:
    return str(body["choices"][0]["message"]["content"] or "")


def _l3(backend: Backend, name: str) -> float:
    return backend.metrics().get(f"deepinfer_cache_l3_{name}", 0.0)


def _wait(what: str, cond: Any, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Session:
    """A session's first turn on ``a`` (saved to L3 behind it), and its next turn."""

    def __init__(self, a: Backend, seed: int, words: int = 1800) -> None:
        self.history = [{"role": "system", "content": "You are a coding agent."},
                        {"role": "user", "content": filler_text(seed, words)}]
        saved = _l3(a, "saved_blocks")
        body = _chat(a, self.history)
        self.first_prompt = body["usage"]["prompt_tokens"]
        self.history.append({"role": "assistant", "content": _reply(body)})
        self.next = self.history + [{"role": "user", "content": "And the tests?"}]
        self.saved_before = saved

    def wait_saved(self, a: Backend) -> None:
        _wait("the first turn's write-behind save to L3",
              lambda: _l3(a, "saved_blocks") - self.saved_before >= self.first_prompt // BLOCK - 2)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, Any]]:
    _require_mooncake()
    master = Master(tmp_path)
    master.start()
    script = tmp_path / "unused-script.txt"
    script.write_text("")
    pool = ThreadPoolExecutor(max_workers=2)  # the two workers load side by side
    starts = [pool.submit(Backend.start, script, ranks=1, config=_config(master, segment_gb=gb),
                          timeout_s=180) for gb in (0.25, 0.0)]
    try:
        a, b = (f.result() for f in starts)
        yield {"master": master, "a": a, "b": b}
    finally:
        for f in starts:
            if f.exception() is None:
                f.result().stop()
        pool.shutdown()
        master.kill()


_CLIENT = """
import os, sys
from mooncake.store import MooncakeDistributedStore
client = MooncakeDistributedStore()
assert client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", sys.argv[1]) == 0
if sys.argv[2] == "garble":
    raw = bytearray(client.get(sys.argv[3]))
    raw[len(raw) // 2] ^= 0x5A
    rc = client.upsert(sys.argv[3], bytes(raw))
else:
    rc = min(client.put(f"junk/{i}", b"x" * (1 << 20)) for i in range(int(sys.argv[3])))
print("rc", rc, flush=True)
os._exit(0)  # no teardown: a client's close waits on its peers
"""


def _store_client(master: Master, *args: str) -> str:
    """A client of the test's own, in a subprocess (a store call that hangs cannot hang the test)."""
    done = subprocess.run([sys.executable, "-c", _CLIENT, master.address, *args], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_session_moves_to_another_worker_warm_from_l3_and_survives_every_store_fault(
    cluster: dict[str, Any],
) -> None:
    master, a, b = cluster["master"], cluster["a"], cluster["b"]
    assert _l3(a, "up") == 1 and _l3(b, "up") == 1

    # 1. The session's next turn on B comes from L3, and B answers as A does.
    s1 = Session(a, seed=1)
    s1.wait_saved(a)
    loaded = _l3(b, "loaded_blocks")
    started = time.perf_counter()
    on_b = _chat(b, s1.next)
    warm_s = time.perf_counter() - started
    usage = on_b["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    from_l3 = (_l3(b, "loaded_blocks") - loaded) * BLOCK
    print(f"\nworker A -> worker B: {cached} of {usage['prompt_tokens']} prompt tokens cached "
          f"({cached / usage['prompt_tokens']:.1%}), {from_l3:.0f} from L3; turn {warm_s:.2f} s")
    assert cached >= 0.9 * usage["prompt_tokens"]
    assert from_l3 >= 0.9 * usage["prompt_tokens"]
    assert _reply(on_b) == _reply(_chat(a, s1.next))

    # 2. A garbled object: B restores the blocks before it, recomputes the rest, answers the same.
    keys_before = master.keys()
    s2 = Session(a, seed=2)
    s2.wait_saved(a)
    new_keys = sorted(master.keys() - keys_before)
    assert len(new_keys) >= s2.first_prompt // BLOCK - 2
    assert "rc 0" in _store_client(master, "garble", new_keys[len(new_keys) // 2])
    rejected, loaded = _l3(b, "rejected_objects"), _l3(b, "loaded_blocks")
    on_b = _chat(b, s2.next)
    assert _l3(b, "rejected_objects") == rejected + 1
    assert _l3(b, "loaded_blocks") - loaded < len(new_keys)  # only the verified prefix
    assert _reply(on_b) == _reply(_chat(a, s2.next))

    # 3. The pool full: A's saves store what fits (or evict), B restores only whole verified prefixes.
    print("pool filled:", _store_client(master, "fill", "400").strip())  # 400 MiB against A's 256 MiB
    s3 = Session(a, seed=3)
    time.sleep(1.0)
    rejected = _l3(b, "rejected_objects")
    on_b = _chat(b, s3.next)
    assert _l3(b, "rejected_objects") == rejected
    assert _reply(on_b) == _reply(_chat(a, s3.next))

    # 4. The master killed mid-run: B answers (L3 off, on /metrics), and takes L3 up again once the
    #    master is back (empty: a restarted master has lost every key).
    s4 = Session(a, seed=4)
    s4.wait_saved(a)
    expected = _reply(_chat(a, s4.next))
    master.kill()
    outages = _l3(b, "outages")
    started = time.perf_counter()
    on_b = _chat(b, s4.next)
    print(f"master killed: B's turn {time.perf_counter() - started:.2f} s, "
          f"{on_b['usage']['prompt_tokens_details']['cached_tokens']} tokens cached")
    assert _reply(on_b) == expected
    assert _l3(b, "outages") == outages + 1 and _l3(b, "up") == 0
    master.start()
    time.sleep(2.5)  # retry_secs: the next turn on A starts its reconnect (in the background)
    _wait("A back on L3", lambda: _chat(a, [{"role": "user", "content": "ping"}]) and _l3(a, "up") == 1, 60)
    s5 = Session(a, seed=5)
    s5.wait_saved(a)

    # 5. The holder killed: its keys may still look present while every get fails; B recomputes.
    expected = _reply(_chat(a, s5.next))
    os.killpg(a.proc.pid, signal.SIGKILL)
    a.proc.wait(timeout=30)
    for leftover in Path("/dev/shm").glob(f"dib-l1-g{a.proc.pid}-*"):
        leftover.unlink(missing_ok=True)
    rejected = _l3(b, "rejected_objects")
    on_b = _chat(b, s5.next)
    assert _reply(on_b) == expected
    assert _l3(b, "rejected_objects") == rejected
    print(f"holder killed: B cached {on_b['usage']['prompt_tokens_details']['cached_tokens']} tokens; "
          f"get failures {_l3(b, 'get_failures'):.0f}, outages {_l3(b, 'outages'):.0f}")
