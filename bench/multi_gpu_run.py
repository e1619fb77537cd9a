"""Multi-GPU lockstep run: N reference-engine ranks (NCCL on CUDA, gloo on CPU), L0 + L1 cache,
the agent load test over the real HTTP server, a cross-GPU session move and a rank SIGKILL.

    # two H200s (nvidia-h200-x2), 'medium' reference model on CUDA
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    python -m bench.multi_gpu_run --device cuda --ranks 2 --model medium --out $OUT
    # CPU check of the whole script (2 gloo ranks, tiny model, short phases)
    python -m bench.multi_gpu_run --quick --out /tmp/mgpu
    # the backend's levers off, then on, in one invocation (no SIGKILL), with the simulator's
    # prediction for the same setup (bench/multi_gpu/onoff.py); --gpus 1 puts both ranks on GPU 0
    python -m bench.multi_gpu_run --policy both --gpus 1 --ranks 2 --out $OUT

Phases (each writes into ``<out>/multi_gpu_run.json`` as it ends, so a late failure keeps the
earlier figures; ``<out>/multi_gpu_run.md`` is the report):

1. machine: GPUs, their links (``nvidia-smi topo -m``), torch, /dev/shm.
2. copy limit: ``bench.multi_gpu.copy_limit`` on every rank's GPU, at the run's block size:
   the contiguous pinned host -> device copy and the rank's own import path, per restore size.
3. start: ``server.runtime.Runtime`` (the object ``python -m deepinfer_backend serve`` runs) with
   uvicorn on a free port; rank processes via ``RankGroup``; checks that every rank process got
   the NVLink-multicast-off variables (``/proc/<pid>/environ``) and which GPU each one holds.
4. load: ``bench.multi_gpu.load`` (the load generator's own agents) in a child process. While it
   runs: a sampler (pool and L1 use per rank), the session move (a probe session is put on rank
   0, exported there, moved to rank 1, and its next turn restores on rank 1), and the SIGKILL of
   one rank (detection, recovery, first request served after it).
5. analysis: TTFT and per-agent tokens/s before the kill (steady state after the warm-up), cache
   hit by tier from ``/metrics`` deltas, every L1 restore the backend made (timed around
   ``RankGroup.import_blocks``, or, for one folded into its turn's add, from the add's send to
   the import's end on the rank: ``RankGroup.transfer_log`` op "fold") against the copy limit of
   its GPU at its size.

Nothing here passes or fails on a stopwatch; the exit status is 0 when every phase ran.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.multi_gpu.analysis import (
    CopyLimit,
    cache_tiers,
    delta,
    fault_window,
    folded_restores,
    in_window,
    parse_metrics,
    phase_table,
    restore_table,
)
from bench.multi_gpu.report import render_markdown
from cache.sessions import SessionHint

log = logging.getLogger("bench.multi_gpu_run")

NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
PROBE_PREFIX = "mgpu-probe"
_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
          "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango")

GPU_DEFAULTS = {"device": "cuda", "model": "medium", "ranks": 2, "num_blocks": 768, "context": 32_000,
                "size_scale": 1.0, "agents": 16, "duration": 240.0, "warmup": 45.0, "ramp": 20.0,
                "drain": 30.0,
                "move_at": 100.0, "kill_at": 180.0, "probe_tokens": 12_000, "l1_gb": 8.0,
                "batched_tokens": 16_384, "copy_sizes": "1,4,16,64,128,256,512"}
QUICK_DEFAULTS = {"device": "cpu", "model": "tiny", "ranks": 2, "num_blocks": 56, "context": 4_000,
                  "size_scale": 0.1, "agents": 4, "duration": 50.0, "warmup": 10.0, "ramp": 4.0,
                  "drain": 30.0,
                  "move_at": 18.0, "kill_at": 34.0, "probe_tokens": 1_200, "l1_gb": 0.05,
                  "batched_tokens": 2048, "copy_sizes": "1,4,16,64"}


def words(seed: int, n: int) -> str:
    x = (seed * 2654435761) % (1 << 32) or 1
    out = []
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(_WORDS[x % len(_WORDS)])
    return " ".join(out)


class Results:
    """The run's JSON document, saved after every phase."""

    def __init__(self, out_dir: Path, command: str) -> None:
        self.out_dir = out_dir
        self.doc: dict[str, Any] = {"command": command, "phases": {}, "errors": []}

    def put(self, phase: str, value: Any) -> None:
        self.doc["phases"][phase] = value
        self.save()

    def error(self, phase: str, exc: BaseException) -> None:
        log.exception("phase %s failed", phase)
        self.doc["errors"].append(f"{phase}: {type(exc).__name__}: {exc}")
        self.save()

    def save(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        opts = orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
        (self.out_dir / "multi_gpu_run.json").write_bytes(orjson.dumps(self.doc, option=opts, default=str))


# ---------------------------------------------------------------------------------------- phases

def _sh(cmd: list[str], timeout_s: float = 30.0, env: dict[str, str] | None = None) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
        return (res.stdout + res.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"({' '.join(cmd[:2])}: {exc})"


def machine_info(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    shm = os.statvfs("/dev/shm")
    info: dict[str, Any] = {
        "python": sys.version.split()[0], "torch": torch.__version__, "cpus": os.cpu_count(),
        "dev_shm_free_gib": round(shm.f_bavail * shm.f_frsize / 2**30, 1),
        "nvls_env": {k: os.environ.get(k) for k in NVLS_OFF},
    }
    if args.device.startswith("cuda"):
        info["gpus"] = _sh(["nvidia-smi", "-L"])
        info["topology"] = _sh(["nvidia-smi", "topo", "-m"])
        info["nccl_version"] = _sh([sys.executable, "-c", "import torch; print(torch.cuda.nccl.version())"],
                                   120)
    return info


def bytes_per_block(model: str, device: str, block_size: int) -> int:
    import torch

    from rank.reference_model import MODEL_SPECS, kv_bytes_per_block

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    return kv_bytes_per_block(MODEL_SPECS[model], block_size, dtype)


def copy_limits(args: argparse.Namespace, bpb: int) -> dict[str, Any]:
    """The copy-limit sweep on each rank's GPU (one child process per GPU, one after another)."""
    out: dict[str, Any] = {}
    for rank in range(args.ranks):
        path = args.out / f"copy_rank{rank}.json"
        env = dict(os.environ)
        if args.device.startswith("cuda"):
            env["CUDA_VISIBLE_DEVICES"] = _rank_gpus(args)[rank]
        cmd = [sys.executable, "-m", "bench.multi_gpu.copy_limit", "--bytes-per-block", str(bpb),
               "--sizes", args.copy_sizes, "--device", "cuda" if args.device.startswith("cuda") else "cpu",
               "--repeats", "5", "--out", str(path)]
        text = _sh(cmd, 300, env)
        print(text, flush=True)
        out[str(rank)] = orjson.loads(path.read_bytes()) if path.exists() else {"error": text[-2000:]}
    return out


def _rank_gpus(args: argparse.Namespace) -> list[str]:
    listed = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    gpus = listed or [str(i) for i in range(args.ranks)]
    return [gpus[r % len(gpus)] for r in range(args.ranks)]


def workload_config(args: argparse.Namespace) -> dict[str, Any]:
    from bench.multi_gpu.onoff import POLICIES

    return {
        "engine": "reference", "reference_model": args.model, "reference_device": args.device,
        "ep": args.ranks, "reference_num_blocks": args.num_blocks, "block_size": 128,
        "max_num_seqs": 128, "max_num_batched_tokens": args.batched_tokens,
        "prefix_cache": True, "l1_cache": True, "l1_host_gb": args.l1_gb,
        "deepinfer_env": dict(NVLS_OFF), "port": 0, "load_timeout_seconds": 600,
        "request_timeout_secs": 900, **POLICIES.get(args.policy or "", {}),
    }


def run_both(args: argparse.Namespace, argv: list[str]) -> int:
    """``--policy both``: this script once with the levers off and once on (child processes, one
    after the other, no SIGKILL unless ``--kill-at`` is given), then the comparison."""
    from bench.multi_gpu.onoff import report

    rest = _without(argv, "--policy", "--out", "--kill-at")
    rc = 0
    for policy in ("off", "on"):
        cmd = [sys.executable, "-m", "bench.multi_gpu_run", *rest, "--policy", policy,
               "--out", str(args.out / policy), "--kill-at", str(args.kill_at)]
        print(f"=== policy {policy}: {' '.join(cmd[1:])}", flush=True)
        rc |= subprocess.call(cmd)
    print(report(args.out, args.sim_prefill_tok_s), flush=True)
    return rc


def rank_processes(runtime: Any, device: str) -> list[dict[str, Any]]:
    """Each rank process: pid, the NVLS variables it really has, CUDA_VISIBLE_DEVICES, its GPU."""
    rows = []
    apps: dict[int, str] = {}
    if device.startswith("cuda"):
        text = _sh(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id,used_memory", "--format=csv,noheader"])
        for line in text.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) >= 3 and parts[0].isdigit():
                apps[int(parts[0])] = f"{parts[1]} ({parts[2]})"
    for rank, pid in enumerate(runtime.group.pids()):
        env: dict[str, str] = {}
        with contextlib.suppress(OSError):
            raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            env = dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)
        rows.append({
            "rank": rank, "pid": pid,
            "env": {k: env.get(k) for k in (*NVLS_OFF, "CUDA_VISIBLE_DEVICES", "NCCL_DEBUG")},
            "gpu": apps.get(pid),
        })
    return rows


class Recorder:
    """Times every ``import_blocks``/``export_blocks`` round trip the cache makes and every
    admission (rank, cached tokens by tier, queue and restore time). Installed on the instances."""

    def __init__(self, runtime: Any) -> None:
        self.imports: list[dict[str, Any]] = []
        self.exports: list[dict[str, Any]] = []
        self.admissions: list[dict[str, Any]] = []
        group, cache = runtime.group, runtime.cache
        # The whole run's round trips (folded restores are read from it), not the latest 4,096.
        group.messages.transfer_log = collections.deque()
        group.import_blocks = self._timed(group.import_blocks, self.imports, "import")
        group.export_blocks = self._timed(group.export_blocks, self.exports, "export")
        orig_admit = cache.admit

        @functools.wraps(orig_admit)
        async def admit(prompt_ids: Any, session_hint: SessionHint | str | None, max_tokens: int,
                        **kw: Any) -> Any:
            adm = await orig_admit(prompt_ids, session_hint, max_tokens, **kw)
            key = SessionHint.of(session_hint).key or ""  # the service passes a SessionHint
            self.admissions.append({
                "t": time.monotonic(),
                "hint": key if key.startswith(PROBE_PREFIX) else None,
                "rank": adm.rank, "epoch": adm.epoch, "prompt": adm.num_prompt_tokens,
                "l0": adm.cached_tokens_by_tier.l0, "l1": adm.cached_tokens_by_tier.l1,
                "queue_s": adm.queue_time_s, "restore_s": adm.restore_s,
            })
            return adm

        cache.admit = admit

    @staticmethod
    def _timed(fn: Any, sink: list[dict[str, Any]], kind: str) -> Any:
        @functools.wraps(fn)
        async def wrapper(rank: int, *a: Any) -> Any:
            n = len(a[0]) if kind == "export" else int(a[1])
            started = time.monotonic()
            ok = False
            try:
                result = await fn(rank, *a)
                ok = True
                return result
            finally:
                sink.append({"t": started, "rank": rank, "num_blocks": n,
                             "wall_s": time.monotonic() - started, "ok": ok})

        return wrapper


class Sampler(threading.Thread):
    """Every ``every_s``: pool use per rank, L1 use, group state (on the runtime's loop)."""

    def __init__(self, rt: Any, every_s: float) -> None:
        super().__init__(daemon=True, name="mgpu-sampler")
        self.rt, self.every_s = rt, every_s
        self.samples: list[dict[str, Any]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        async def read() -> dict[str, Any]:
            runtime = self.rt.runtime
            group, cache = runtime.group, runtime.cache
            stats = [group.stats(r) for r in range(group.num_ranks)]
            return {
                "t": time.monotonic(), "state": group.state.value, "epoch": group.epoch,
                "free_blocks": [s.num_free_blocks for s in stats],
                "cached_blocks": [s.num_cached_blocks for s in stats],
                "running": [s.num_running for s in stats], "waiting": [s.num_waiting for s in stats],
                "l1_used_slots": cache.l1.alloc.num_used_slots, "l1_slots": cache.l1.num_slots,
                "l1_entries": len(cache.l1.entries),
            }

        while not self.stop.wait(self.every_s):
            with contextlib.suppress(Exception):
                self.samples.append(self.rt.call(read, 10))


class StateWatch(threading.Thread):
    """Polls the group's state every 2 ms after a kill: when it left READY and came back."""

    def __init__(self, group: Any, epoch_before: int) -> None:
        super().__init__(daemon=True, name="mgpu-statewatch")
        self.group, self.epoch_before = group, epoch_before
        self.t_not_ready: float | None = None
        self.t_ready: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            state = self.group.state.value
            now = time.monotonic()
            if self.t_not_ready is None and (state != "ready" or self.group.epoch != self.epoch_before):
                self.t_not_ready = now
            if self.t_not_ready is not None and state == "ready" and self.group.epoch > self.epoch_before:
                self.t_ready = now
                return
            time.sleep(0.002)


class Probe:
    """A conversation of its own session id over ``/v1/messages`` (non-streaming)."""

    def __init__(self, url: str, hint: str, num_words: int, seed: int) -> None:
        self.url, self.hint = url, hint
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": words(seed, num_words)}]
        self.seed = seed
        self.turns: list[dict[str, Any]] = []

    def turn(self, client: httpx.Client, max_tokens: int = 16) -> dict[str, Any]:
        body = {"model": "default", "max_tokens": max_tokens, "messages": self.messages}
        started = time.monotonic()
        resp = client.post(self.url + "/v1/messages", json=body,
                           headers={"X-Claude-Code-Session-Id": self.hint},
                           timeout=600)
        wall = time.monotonic() - started
        if resp.status_code != 200:
            raise RuntimeError(f"probe turn: HTTP {resp.status_code}: {resp.text[:300]}")
        data = resp.json()
        usage = data.get("usage", {})
        self.messages = self.messages + [
            {"role": "assistant", "content": data["content"]},
            {"role": "user", "content": words(self.seed + len(self.turns) + 1, 40)},
        ]
        info = {"wall_s": wall, "input_tokens": usage.get("input_tokens"),
                "cache_read_input_tokens": usage.get("cache_read_input_tokens")}
        self.turns.append(info)
        return info


def _probe_admission(recorder: Recorder, hint: str, after_t: float) -> dict[str, Any] | None:
    rows = [a for a in recorder.admissions if a["hint"] == hint and a["t"] >= after_t]
    return rows[-1] if rows else None


def session_move(rt: Any, recorder: Recorder, url: str, num_words: int, src: int, dst: int,
                 max_tries: int = 6) -> dict[str, Any]:
    """Start a probe session whose cold turn lands on ``src`` (a new session per try: the router
    places new sessions by load), move it to ``dst`` through L1 (export on ``src``'s GPU), and
    serve its next turn on ``dst``, where nothing of it was ever computed (restore on ``dst``'s GPU)."""
    cache = rt.runtime.cache
    out: dict[str, Any] = {"src_rank": src, "dst_rank": dst, "steps": []}
    with httpx.Client() as client:
        probe: Probe | None = None
        for attempt in range(max_tries):
            hint = f"{PROBE_PREFIX}-{os.getpid()}-{attempt}"
            candidate = Probe(url, hint, num_words, seed=4242 + attempt)
            t = time.monotonic()
            candidate.turn(client)
            first = _probe_admission(recorder, hint, t)
            out["steps"].append({"what": f"try {attempt}: cold turn", "admission": first,
                                 **candidate.turns[-1]})
            if first is not None and first["rank"] == src:
                probe = candidate
                break
        if probe is None:
            raise RuntimeError(f"no probe session landed on rank {src} in {max_tries} tries")
        out["session"] = probe.hint
        t_move = time.monotonic()
        n_exports = len(recorder.exports)
        # move_session answers False while a write-through of the session (started when its
        # turn finished on a pool past the watermark) is still in flight: retry until it lands.
        moved, num_move_calls = False, 0
        while not moved and num_move_calls < 50:
            num_move_calls += 1
            moved = rt.call(lambda: cache.move_session(probe.hint, dst), 120)
            if not moved:
                time.sleep(0.1)
        move_s = time.monotonic() - t_move
        exports = [e for e in recorder.exports[n_exports:] if e["rank"] == src]
        out["move"] = {"ok": moved, "wall_s": move_s, "calls": num_move_calls, "exports_on_src": exports}
        n_imports = len(recorder.imports)
        t = time.monotonic()
        probe.turn(client)
        adm = _probe_admission(recorder, probe.hint, t)
        # The service prefetches a known session's blocks from L1 as soon as it has read the
        # headers, so the restore may come before the admission (which then counts them as L0).
        imports = [i for i in recorder.imports[n_imports:] if i["rank"] == dst]
        out["steps"].append({"what": f"turn after the move to rank {dst}", "admission": adm,
                             **probe.turns[-1]})
        restored_blocks = sum(i["num_blocks"] for i in imports if i["ok"])
        out["restored_on_dst"] = {
            "admitted_on_rank": adm["rank"] if adm else None,
            "l1_tokens": adm["l1"] if adm else None, "l0_tokens": adm["l0"] if adm else None,
            "restore_s": adm["restore_s"] if adm else None, "imports_on_dst": imports,
            "restored_blocks": restored_blocks,
            "cache_read_input_tokens": probe.turns[-1]["cache_read_input_tokens"],
        }
        out["ok"] = bool(moved and adm and adm["rank"] == dst and restored_blocks > 0
                         and (probe.turns[-1]["cache_read_input_tokens"] or 0) > 0)
    return out


def sigkill(rt: Any, url: str, victim: int, deadline_s: float) -> dict[str, Any]:
    """SIGKILL one rank process; time the group's detection, its restart and the first request
    a new session gets served after it (small non-streaming probes every 0.25 s)."""
    group = rt.runtime.group
    pid = group.pids()[victim]
    epoch_before = group.epoch
    watch = StateWatch(group, epoch_before)
    watch.start()
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    probes: dict[str, int] = {}
    t_first_ok: float | None = None
    health_ready: float | None = None
    i = 0
    with httpx.Client() as client:
        while time.monotonic() - t_kill < deadline_s and t_first_ok is None:
            i += 1
            body = {"model": "default", "max_tokens": 4,
                    "messages": [{"role": "user", "content": words(9000 + i, 30)}]}
            try:
                resp = client.post(url + "/v1/messages", json=body, timeout=60)
                key = str(resp.status_code)
                if resp.status_code == 200:
                    t_first_ok = time.monotonic()
            except httpx.HTTPError as exc:
                key = type(exc).__name__
            probes[key] = probes.get(key, 0) + 1
            if health_ready is None:
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(url + "/healthz",
                                  timeout=10).status_code == 200 and watch.t_ready is not None:
                        health_ready = time.monotonic()
            if t_first_ok is None:
                time.sleep(0.25)
    watch.join(timeout=max(0.0, deadline_s - (time.monotonic() - t_kill)))
    watch.stop.set()

    def since(t: float | None) -> float | None:
        return None if t is None else t - t_kill

    return {
        "victim_rank": victim, "victim_pid": pid, "t_kill": t_kill,
        "epoch_before": epoch_before, "epoch_after": group.epoch,
        "group_left_ready_after_s": since(watch.t_not_ready),
        "group_teardown_s": group.last_detection_s,
        "group_ready_again_after_s": since(watch.t_ready),
        "healthz_200_after_s": since(health_ready),
        "first_new_request_ok_after_s": since(t_first_ok),
        "last_failure": group.last_failure, "probe_statuses": probes,
        "new_pids": group.pids(),
    }


def scrape(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=30).text)


def run(args: argparse.Namespace) -> int:
    from bench.loadgen.report import Criteria, step_stats
    from bench.multi_gpu.load import record_from_dict
    from bench.support.runtime_thread import RuntimeThread

    args.out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m bench.multi_gpu_run", *sys.argv[1:]])
    res = Results(args.out, command)
    res.doc["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    for key, value in NVLS_OFF.items():
        if os.environ.get(key) != value:
            log.warning("%s was %r; setting %s for this run and its children", key, os.environ.get(key),
                        value)
            os.environ[key] = value
    res.put("machine", machine_info(args))
    bpb = bytes_per_block(args.model, args.device, 128)
    res.doc["bytes_per_block"] = bpb
    limits: dict[int, CopyLimit] = {}
    try:
        copy = copy_limits(args, bpb)
        res.put("copy_limit", copy)
        limits = {int(r): CopyLimit.from_rows(v["sizes"]) for r, v in copy.items() if "sizes" in v}
    except Exception as exc:  # noqa: BLE001 - the run goes on without the limit curve
        res.error("copy_limit", exc)
    config = workload_config(args)
    res.doc["config"] = config
    rt = RuntimeThread(config)
    t0 = time.monotonic()
    rt.start(timeout_s=600)
    ok = True
    try:
        runtime = rt.runtime
        url = rt.url
        res.put("start",
                {"ready_s": time.monotonic() - t0, "url": url, "num_blocks": runtime.group.num_blocks,
                          "bytes_per_block": runtime.group.bytes_per_block,
                          "num_host_slots": runtime.group.num_host_slots,
                          "l1_gib": runtime.group.num_host_slots * runtime.group.bytes_per_block / 2**30,
                          "ranks": rank_processes(runtime, args.device)})
        recorder = Recorder(runtime)
        m0 = scrape(url)
        sampler = Sampler(rt, 1.0)
        sampler.start()
        load_out = args.out / "load_records.json"
        load_cmd = [sys.executable, "-m", "bench.multi_gpu.load", "--url", url, "--context",
                    str(args.context),
                    "--size-scale", str(args.size_scale), "--agents", str(args.agents),
                    "--duration", str(args.duration), "--warmup", str(args.warmup), "--ramp", str(args.ramp),
                    "--drain", str(args.drain), "--pacing", str(args.pacing), "--pacing-dist",
                    args.pacing_dist,
                    "--out", str(load_out)]
        res.doc["load_command"] = " ".join(load_cmd[1:])
        t_load = time.monotonic()
        load = subprocess.Popen(load_cmd, stdout=sys.stdout, stderr=sys.stderr)
        move: dict[str, Any] | None = None
        kill: dict[str, Any] | None = None
        gpu_during_load = ""
        try:
            while load.poll() is None:
                elapsed = time.monotonic() - t_load
                if move is None and elapsed >= args.move_at:
                    try:
                        move = session_move(rt, recorder, url, args.probe_tokens, 0, min(1, args.ranks - 1))
                    except Exception as exc:  # noqa: BLE001
                        move = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                        res.error("move", exc)
                    res.put("move", move)
                    if args.device.startswith("cuda"):
                        gpu_during_load = _sh(["nvidia-smi", "--query-gpu=index,memory.used,utilization.gpu",
                                               "--format=csv,noheader"])
                if kill is None and args.kill_at > 0 and elapsed >= args.kill_at:
                    try:
                        kill = sigkill(rt, url, args.kill_rank, deadline_s=args.recover_deadline)
                        kill["ranks_after"] = rank_processes(runtime, args.device)
                    except Exception as exc:  # noqa: BLE001
                        kill = {"error": f"{type(exc).__name__}: {exc}"}
                        res.error("sigkill", exc)
                    res.put("sigkill", kill)
                if time.monotonic() - t_load > args.duration + args.drain + 120:
                    load.kill()
                    raise RuntimeError("load generator overran its time; killed")
                time.sleep(0.2)
        finally:
            if load.poll() is None:
                load.kill()
            sampler.stop.set()
        m1 = scrape(url)
        # ---------------------------------------------------------------- analysis
        doc = orjson.loads(load_out.read_bytes())
        records = [record_from_dict(d) for d in doc["records"]]
        t_from, t_to = doc["t_measure_from"], doc["t_measure_to"]
        t_kill = kill.get("t_kill") if kill and "t_kill" in kill else None
        steady_to = t_kill if t_kill is not None else t_to
        crit = Criteria()
        # Steady state: started after the warm-up and ended before the kill (the requests the
        # kill cut off are counted in the SIGKILL section).
        steady_records = [r for r in in_window(records, t_from, steady_to) if r.t_end <= steady_to]
        steady = step_stats("steady (warm-up .. kill)", args.context, args.agents, steady_records,
                            t_from, steady_to, crit, max_timeline=0)
        whole = step_stats("whole run incl. warm-up and kill", args.context, args.agents, records,
                           doc["t_launch"], t_to, crit, max_timeline=0)
        load_result: dict[str, Any] = {
            "steady": steady.model_dump(exclude={"timeline"}),
            "whole": whole.model_dump(exclude={"timeline"}),
            "num_records": len(records), "t_load_start": t_load, "t_measure_from": t_from,
            "t_measure_to": t_to,
            "gpu_during_load": gpu_during_load,
        }
        if t_kill is not None:
            ready = kill.get("group_ready_again_after_s")
            after_from = t_kill + (ready or 0.0)
            if after_from < t_to:
                after = step_stats("after recovery", args.context, args.agents,
                                   in_window(records, after_from, t_to),
                                   after_from, t_to, crit, max_timeline=0)
                load_result["after_recovery"] = after.model_dump(exclude={"timeline"})
            kill["agents"] = fault_window(records, t_kill)
            res.put("sigkill", kill)
        res.put("load", load_result)
        m_delta = delta(m1, m0)
        tiers_all = cache_tiers(m_delta)
        timings = rt.call(lambda: _transfer_log(rt.runtime.group), 10)
        # Every restore: the awaited ones (timed import_blocks) and those folded into their add.
        folded = folded_restores(timings)
        restores = sorted(recorder.imports + folded, key=lambda r: r["t"])
        imports_pre_kill = [i for i in restores if t_kill is None or i["t"] < t_kill]
        res.put("cache", {
            "metrics_delta_whole_load": tiers_all,
            "restores": restore_table(restores, limits, bpb),
            "restores_before_kill": restore_table(imports_pre_kill, limits, bpb),
            "restores_awaited_before_kill": restore_table(
                [i for i in imports_pre_kill if not i.get("folded")], limits, bpb),
            "restores_folded_before_kill": restore_table(
                [i for i in imports_pre_kill if i.get("folded")], limits, bpb),
            "exports": restore_table(recorder.exports, limits, bpb),
            "transfer_phases": {op: phase_table(timings, op, t_to=t_kill if t_kill is not None else math.inf)
                                for op in ("import", "fold", "export", "release")},
            "admissions_by_rank": {str(r): sum(1 for a in recorder.admissions if a["rank"] == r)
                                   for r in range(args.ranks)},
            "admission_queue_s_p50_p95": _q2([a["queue_s"] for a in recorder.admissions]),
            "admissions_with_l1": sum(1 for a in recorder.admissions if a["l1"] > 0),
            "num_admissions": len(recorder.admissions),
        })
        steady_adm = [a for a in recorder.admissions if t_from <= a["t"] < steady_to]
        prompt_steady = sum(a["prompt"] for a in steady_adm)
        res.doc["phases"]["cache"]["steady_admissions"] = {
            "num": len(steady_adm), "prompt_tokens": prompt_steady,
            "l0_tokens": sum(a["l0"] for a in steady_adm), "l1_tokens": sum(a["l1"] for a in steady_adm),
            "hit_l0": sum(a["l0"] for a in steady_adm) / prompt_steady if prompt_steady else None,
            "hit_l1": sum(a["l1"] for a in steady_adm) / prompt_steady if prompt_steady else None,
        }
        res.doc["raw_admissions"] = recorder.admissions
        res.put("samples", sampler.samples)
        res.doc["raw_restores"] = restores
        res.doc["raw_exports"] = recorder.exports
        res.save()
    except Exception as exc:  # noqa: BLE001 - recorded; the report shows what ran
        ok = False
        res.error("run", exc)
    finally:
        with contextlib.suppress(Exception):
            rt.stop()
    (args.out / "multi_gpu_run.md").write_text(render_markdown(res.doc), encoding="utf-8")
    print((args.out / "multi_gpu_run.md").read_text(encoding="utf-8"), flush=True)
    return 0 if ok and not res.doc["errors"] else 1


async def _transfer_log(group: Any) -> list[Any]:
    """A copy of ``RankGroup.transfer_log``, taken on the group's event loop."""
    return list(group.transfer_log)


def _q2(values: list[float]) -> list[float]:
    from bench.multi_gpu.analysis import quantiles

    return quantiles(values)


def _without(argv: list[str], *flags: str) -> list[str]:
    """``argv`` less each of ``flags`` with its value (``--flag value`` or ``--flag=value``)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in flags)):
            out.append(a)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.multi_gpu_run", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CPU check: tiny model, gloo, short phases")
    p.add_argument("--out", type=Path, required=True, help="directory for the JSON, the report, raw records")
    p.add_argument("--device", help="cuda or cpu")
    p.add_argument("--model", choices=["null", "tiny", "small", "medium", "large"])
    p.add_argument("--ranks", type=int)
    p.add_argument("--num-blocks", type=int, dest="num_blocks",
                   help="GPU KV blocks per rank (config reference_num_blocks)")
    p.add_argument("--context", type=int)
    p.add_argument("--size-scale", type=float, dest="size_scale")
    p.add_argument("--agents", type=int)
    p.add_argument("--duration", type=float, help="load seconds")
    p.add_argument("--warmup", type=float)
    p.add_argument("--ramp", type=float)
    p.add_argument("--drain", type=float)
    p.add_argument("--pacing", type=float, default=3.0)
    p.add_argument("--pacing-dist", choices=["constant", "lognormal"], default="constant")
    p.add_argument("--move-at", type=float, dest="move_at", help="seconds into the load for the session move")
    p.add_argument("--kill-at", type=float, dest="kill_at",
                   help="seconds into the load for the SIGKILL (0: none)")
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--recover-deadline", type=float, default=180.0)
    p.add_argument("--probe-tokens", type=int, dest="probe_tokens",
                   help="words in the moved session's prompt")
    p.add_argument("--l1-gb", type=float, dest="l1_gb", help="L1 GiB per rank (config l1_host_gb)")
    p.add_argument("--batched-tokens", type=int, dest="batched_tokens")
    p.add_argument("--copy-sizes", dest="copy_sizes", help="restore sizes (blocks) for the copy limit sweep")
    p.add_argument("--gpus", type=int, help="GPUs 0..N-1 for the ranks, round robin (--gpus 1: every "
                   "rank on GPU 0; ranks sharing a GPU vote over gloo instead of NCCL)")
    p.add_argument("--policy", choices=["on", "off", "both"],
                   help="the backend's levers (bench/multi_gpu/onoff.py): on, off, or both in one "
                   "invocation (then no SIGKILL unless --kill-at is given); unset: the backend's defaults")
    p.add_argument("--sim-prefill-tok-s", type=float, default=200_000.0, dest="sim_prefill_tok_s",
                   help="--policy both: the prefill rate the simulator's prediction assumes "
                   "(tokens/s per rank)")
    raw = list(argv) if argv is not None else sys.argv[1:]
    args = p.parse_args(raw)
    defaults = QUICK_DEFAULTS if args.quick else GPU_DEFAULTS
    if args.policy == "both" and args.kill_at is None:
        args.kill_at = 0.0
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.argv = raw
    if args.ranks < 1 or not 0 <= args.kill_rank < args.ranks:
        p.error("need --ranks >= 1 and 0 <= --kill-rank < --ranks")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "deepinfer.service", "deepinfer_backend.symptoms"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = parse_args(argv)
    if args.gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(args.gpus))
    if args.policy == "both":
        return run_both(args, args.argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
