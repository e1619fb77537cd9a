"""The figures ``bench.decode_bench`` prints: the ranks' per-step phases, their threads' CPU, the
backend's CPU split by component (a py-spy sample) and the projection to a quiet node.

What counts as ours on the rank side (``OURS``): the worker's command drain, the adapter's
bookkeeping around DeepInfer's step, ``engine.stats()``, ``wire.encode_step``, the zmq send and
the rest of the loop, plus zmq's I/O thread (``ZMQbg``, which moves our step messages) and the
rank's transfer thread (``rank-transfers``, which takes the commands and forwards the adds). Not ours:
DeepInfer's step (its scheduler, the forward, ``build_request_outputs``) and DeepInfer's lockstep
vote (``LLMEngine.has_unfinished_requests``: a one-int ``all_reduce`` MAX over its gloo group
every step, in the prebuilt package too), whose loop-thread part is the ``vote`` phase and whose
I/O runs in gloo's threads (``gloo_tcp_loop``, ``pt_gloo_runloop``).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import psutil

OURS = ("drain", "adapter", "stats", "encode", "send", "other")
PHASE_LABELS = {"engine": "DeepInfer step (not ours)", "vote": "DeepInfer's vote (not ours)",
                "drain": "command drain", "adapter": "adapter bookkeeping", "stats": "engine stats",
                "encode": "wire encode", "send": "zmq send", "other": "loop rest"}
OUR_THREADS = ("ZMQbg", "rank-transfers")  # zmq's I/O thread (our step messages); the transfer thread
# Backend components, matched on a sample's frames from the innermost out: the first frame that
# contains one of a component's markers names the sample's component.
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
# py-spy starts with the server, so its sample holds the server's start and stop too: imports,
# the tokenizer and token table load, preflight, launching the ranks, the shutdown. A sample
# with any of these frames is left out of the split.
STARTUP = ("_find_and_load (", "Runtime._build_protocol (", "_serve_forever (", "RankGroup._launch (",
           "argparse.py", "_get_module_details (")


def rank_profile(profile_dir: Path, seqs: int) -> dict[str, object]:
    """Mean wall/CPU microseconds per phase over the steady steps (``seqs`` outputs) of every rank."""
    rows = []
    phases: list[str] = []
    for path in sorted(profile_dir.glob("rank*.json")):
        data = json.loads(path.read_text())
        phases = data["phases"]
        rows.append(np.asarray(data["rows"], dtype=np.int64).reshape(-1, data["row"]))
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


def thread_cpu_s(procs: list[psutil.Process]) -> Counter[str]:
    """CPU seconds of the processes' threads, summed by thread name (``/proc/<pid>/task/<tid>/comm``:
    the main thread as ``loop thread``, zmq's ``ZMQbg/...`` as ``ZMQbg``, gloo's and torch's own)."""
    out: Counter[str] = Counter()
    for proc in procs:
        try:
            for t in proc.threads():
                try:
                    name = Path(f"/proc/{proc.pid}/task/{t.id}/comm").read_text().strip()
                except OSError:
                    continue
                if t.id == proc.pid:
                    name = "loop thread"
                elif name.startswith("ZMQ"):
                    name = name.split("/")[0]
                out[name] += t.user_time + t.system_time
        except psutil.NoSuchProcess:
            continue
    return out


def print_rank_table(prof: dict[str, object], threads_us: dict[str, float]) -> dict[str, float]:
    """The loop thread's phases per rank step, then the rank process's threads; returns the figures."""
    wall, cpu = prof["wall_us"], prof["cpu_us"]
    assert isinstance(wall, dict) and isinstance(cpu, dict)
    print(f"rank step, mean over {prof['steady_steps']} steady steps of {prof['ranks']} ranks "
          f"({prof['tokens_per_step']:.0f} tokens per step per rank), loop thread:")
    print(f"  {'phase':<34}{'wall us':>10}{'CPU us':>10}")
    for phase in wall:
        print(f"  {PHASE_LABELS.get(phase, phase):<34}{wall[phase]:>10.1f}{cpu[phase]:>10.1f}")
    ours_wall = sum(wall[p] for p in OURS)
    ours_cpu = sum(cpu[p] for p in OURS)
    print(f"  {'ours (drain..send, loop rest)':<34}{ours_wall:>10.1f}{ours_cpu:>10.1f}")
    figures = {"rank_ours_cpu_us": ours_cpu, "rank_ours_wall_us": ours_wall, "rank_vote_cpu_us": cpu["vote"],
               "rank_vote_wall_us": wall["vote"], "rank_step_cpu_us": sum(cpu.values()),
               "rank_engine_cpu_us": cpu["engine"]}
    if threads_us:
        print("rank process CPU per step by thread (steady window): "
              + ", ".join(f"{n} {us:.0f} us" for n, us in threads_us.items()))
        figures.update({f"rank_thread_{name}_us_per_step": us for name, us in threads_us.items()})
    io_us = sum(threads_us.get(name, 0.0) for name in OUR_THREADS)
    figures["rank_added_cpu_us"] = ours_cpu + io_us
    print(f"added per rank step by our code: {ours_cpu:.0f} us loop thread + {io_us:.0f} us zmq I/O and "
          f"transfer threads = "
          f"{ours_cpu + io_us:.0f} us CPU (DeepInfer's vote: {cpu['vote']:.0f} us loop thread "
          "+ its gloo threads)")
    return figures


def classify(raw: Path) -> tuple[Counter[str], int]:
    """py-spy ``--format raw`` (``root;...;leaf count`` per line) -> samples per component, and
    the samples left out as the server's start and stop (``STARTUP``)."""
    counts: Counter[str] = Counter()
    startup = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, num = line.rpartition(" ")
        if not stack or not num.isdigit():
            continue
        if any(mark in stack for mark in STARTUP):
            startup += int(num)
            continue
        name = "other (event loop, GC)"
        for frame in reversed(stack.split(";")):
            hit = next((c for c, marks in COMPONENTS if any(m in frame for m in marks)), None)
            if hit:
                name = hit
                break
        counts[name] += int(num)
    return counts, startup


def print_backend_split(raw: Path, per_token_us: float) -> dict[str, float]:
    counts, startup = classify(raw)
    total = sum(counts.values()) or 1
    print(f"backend CPU per token by component (py-spy, {total} samples; {startup} of the server's start and "
          f"stop left out; share x {per_token_us:.1f} us):")
    figures = {}
    for name, n in counts.most_common():
        figures[f"backend_{name.split()[0]}_us_per_token"] = per_token_us * n / total
        print(f"  {name:<24}{100 * n / total:>6.1f} %{per_token_us * n / total:>8.2f} us")
    return figures


def print_projection(figures: dict[str, float], ranks: int, seqs: int) -> None:
    """A node where every rank and the backend have a core of their own: a node step takes the
    longest of a rank's whole-process CPU per step and the backend's CPU per node step."""
    tokens_per_step = ranks * seqs
    backend_step_us = figures["backend_cpu_us_per_token"] * tokens_per_step
    # A rank's whole process (zmq and gloo I/O threads, heartbeats) costs more than its loop
    # thread: take the larger of the two.
    rank_process_us = figures["ranks_cpu_us_per_token"] * seqs
    rank_us = max(figures["rank_step_cpu_us"], rank_process_us)
    figures["rank_process_cpu_us_per_step"] = rank_process_us
    figures["projected_node_tokens_per_s"] = tokens_per_step / max(rank_us, backend_step_us) * 1e6
    print(f"projection (one core per rank and one for the backend, null forward): a node step is "
          f"bounded by max(rank CPU {rank_us:.0f} us (loop thread {figures['rank_step_cpu_us']:.0f}, process "
          f"{rank_process_us:.0f}), backend CPU {backend_step_us:.0f} us for {tokens_per_step} tokens) -> "
          f"{figures['projected_node_tokens_per_s']:,.0f} tokens/s for the node")
