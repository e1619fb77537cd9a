"""The backend's levers on and off in one invocation, and what the simulator predicts for it.

``python -m bench.multi_gpu_run --policy both ...`` runs the whole multi-GPU script twice, one
child process each (a fresh server and rank group): ``off`` (``place_homeless`` and
``submit_gate`` false: the cache code alone) then ``on`` (``place_homeless``: rule 4's late
binding, ``cache/router.py``; the submit gate stays off, it lengthened the tail wherever it was
tried, docs/loadtest.md). Each run's JSON lies in
``<out>/off`` and ``<out>/on``; this module reads them and prints one table (``<out>/onoff.md``,
``<out>/onoff.json``):

* the steady window's TTFT, per-agent speed, cache hit and errors, the admission queue, and the
  L1 restores' wall time against the pinned-copy time of their bytes (the target:
  <= 1.5x at the p50 and <= 3x at the p95);
* the simulator's prediction for the same setup (``bench/simulator``, virtual time) with the
  same levers on and off: the deployment is the run's (ranks, GPU blocks, L1, block size, the
  measured copy limit as the restore rate), the engine is the reference engine's shape (one
  token per decode step, a prompt step whenever one is waiting: vote intervals 1), its decode
  step the ``off`` run's measured per-agent speed and its prefill rate ``--sim-prefill-tok-s``
  (not measured by the run: an assumption, printed). Arrivals are the load generator's
  (``fresh``), and two facts of how it talks to the reference engine (docs/loadtest.md, "Why
  the model queued 20 s where the real run did not"):

  - every conversation starts with the same prefix: its system prompt and tools are identical in
    every request, so the cache holds them once per rank (the one-H200 run: 17 of 22 cold turns
    were served 9,856 tokens = 77 blocks from other sessions, a 78-block shared prefix whose
    last block is replayed). The size is measured from the run's cold turns where its records
    are there, else the workload's system + tools;
  - every reply is cut at max_tokens (the load generator sets it to the sampled reply size), so
    the service reports an unknown stop kind and the cache never protects the idle session from
    a queued turn (``SimConfig.reply_end="length"``).

  A 16-agent, 100 s window is a small sample (the queue p50 jumps between 0 and the 5 s force
  point from seed to seed), so each figure is the median over ``seeds`` simulator seeds, printed
  with its range.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import orjson

POLICIES: dict[str, dict[str, bool]] = {
    "off": {"place_homeless": False, "submit_gate": False},
    "on": {"place_homeless": True, "submit_gate": False},  # the gate hurt everywhere (docs/loadtest.md)
}
RESTORE_TARGETS = (1.5, 3.0)  # wall / copy at the p50 and the p95


def _num(v: Any) -> float:
    return float("nan") if v is None else float(v)


def measured(doc: dict[str, Any]) -> dict[str, float]:
    """One run's figures: the steady window (after the warm-up, before any kill) and the cache."""
    ph = doc.get("phases", {})
    steady = ph.get("load", {}).get("steady") or {}
    cache = ph.get("cache", {})
    restores = cache.get("restores_before_kill") or {}
    queue = cache.get("admission_queue_s_p50_p95") or [None, None]
    queued_share = float("nan")
    load = ph.get("load", {})
    if doc.get("raw_admissions") is not None and "t_measure_from" in load:
        # The steady window's admissions, as the simulator counts its own (the whole-load figures
        # include the warm-up, where nothing queues).
        lo, hi = load["t_measure_from"], load["t_measure_to"]
        waits = [a["queue_s"] for a in doc["raw_admissions"] if lo <= a["t"] < hi]
        if waits:
            queue = [float(np.percentile(waits, 50)), float(np.percentile(waits, 95))]
            queued_share = float(np.mean([w > 0 for w in waits]))
    return {
        "requests": _num(steady.get("num_requests")), "errors": _num(steady.get("error_rate")),
        "ttft_p50_s": _num(steady.get("ttft_p50_s")), "ttft_p95_s": _num(steady.get("ttft_p95_s")),
        "tok_s_p50": _num(steady.get("tok_s_p50")), "tok_s_p10": _num(steady.get("tok_s_p10")),
        "hit": _num(steady.get("cache_hit")),
        "queue_p50_s": _num(queue[0]), "queue_p95_s": _num(queue[1]), "queued_share": queued_share,
        "restores": _num(restores.get("num")),
        "restore_wall_p50_ms": _num(restores.get("wall_p50_s")) * 1e3,
        "restore_wall_p95_ms": _num(restores.get("wall_p95_s")) * 1e3,
        "restore_ratio_p50": _num(restores.get("ratio_p50")),
        "restore_ratio_p95": _num(restores.get("ratio_p95")),
        "restores_small": _num(restores.get("num_small")),
        "restore_small_wall_p50_ms": _num(restores.get("small_wall_p50_s")) * 1e3,
        "restore_ratio_p50_large": _num(restores.get("ratio_p50_large")),
        "restore_ratio_p95_large": _num(restores.get("ratio_p95_large")),
    }


def copy_gb_s(doc: dict[str, Any]) -> float:
    """The contiguous pinned-copy rate at the largest size measured on rank 0's GPU (GB/s)."""
    rows = doc.get("phases", {}).get("copy_limit", {}).get("0", {}).get("sizes", [])
    return float(max(rows, key=lambda r: r["bytes"])["contiguous_gb_s"]) if rows else float("nan")


def shared_prefix_tokens(records: list[dict[str, Any]], block_size: int) -> int | None:
    """The prefix the load generator's conversations share, as the run measured it: the most
    common cached-token count of a cold turn (a new conversation's first turn) that hit at all,
    plus the one block the engine replays (the last matched block is recomputed,
    ``rank/engine.py`` ``usable_prefix_blocks``). None when no cold turn hit."""
    hits = [int(r.get("cached_tokens") or 0) for r in records if r.get("cold") and r.get("status") == 200]
    hits = [h for h in hits if h > 0]
    return max(set(hits), key=lambda h: (hits.count(h), h)) + block_size if hits else None


def predict(settings: dict[str, Any], bytes_per_block: int, decode_tok_s: float, restore_gb_s: float,
            prefill_tok_s: float, shared_tokens: int | None = None, seeds: int = 1,
            reply_end: str = "length") -> dict[str, dict[str, float]]:
    """The simulator on this setup, levers off and on (see the module docstring).
    ``shared_tokens``: the prefix every conversation shares (None: the workload's system prompt +
    tools, ``WorkloadParams.fixed_prefix_tokens``). Each figure is the median over ``seeds``
    simulator seeds; with more than one, ``<figure>_min`` and ``<figure>_max`` give the range."""
    from bench.loadgen.distributions import WorkloadParams
    from bench.simulator.agents import simulate_step
    from bench.simulator.model import ARRIVALS, Deployment, EngineModel, OursPolicy, SimConfig
    from bench.simulator.vclock import run_virtual
    from server.scheduling import SchedulingConfig

    bpt = bytes_per_block / 128
    deployment = Deployment(
        num_ranks=int(settings["ranks"]), gpu_kv_tokens_per_rank=int(settings["num_blocks"]) * 128,
        l1_tokens_per_rank=int(float(settings["l1_gb"]) * 2**30 / bpt), block_tokens=128,
        kv_bytes_per_token=max(1, int(bpt)),
        restore_tokens_per_s=16.7e6 if math.isnan(restore_gb_s) else restore_gb_s * 1e9 / bpt,
    )
    step_s = 0.05 if math.isnan(decode_tok_s) or decode_tok_s <= 0 else 1.0 / decode_tok_s
    batched = int(settings["batched_tokens"])
    engine = EngineModel(
        prefill_tokens_per_s=prefill_tok_s, prefill_attn_s_per_token2=0.0, decode_base_s=step_s,
        decode_per_seq_s=0.0, decode_per_kv_token_s=0.0, decode_tokens_per_step=1.0, decode_accept_sigma=0.0,
        nextn=0, prefill_all_interval_steps=1, prefill_any_interval_steps=1, kv_watermark=1.0,
        max_num_batched_tokens=batched,
    )
    params = WorkloadParams(
        context_target_tokens=int(settings["context"]), size_scale=float(settings["size_scale"]),
        pacing=settings.get("pacing_dist", "constant"), pacing_s=float(settings.get("pacing", 3.0)),
    )
    shared = sum(params.fixed_prefix_tokens()) if shared_tokens is None else shared_tokens
    out: dict[str, dict[str, float]] = {}
    for name, levers in POLICIES.items():
        gate = SchedulingConfig(enabled=levers["submit_gate"], engine_budget_tokens=batched)
        ours = OursPolicy(scheduling=gate, place_homeless=levers["place_homeless"])
        rows = []
        for seed in range(max(1, seeds)):
            config = SimConfig(
                deployment=deployment, engine=engine, arrivals=ARRIVALS["fresh"], policy="ours", ours=ours,
                duration_s=float(settings["duration"]), warmup_s=float(settings["warmup"]),
                ramp_s=float(settings["ramp"]), shared_prefix_tokens=shared, reply_end=reply_end, seed=seed,
            )
            result = run_virtual(simulate_step(config, int(settings["context"]), int(settings["agents"]),
                                               params))
            s, phases = result.stats, result.phases()
            lo, hi = result.t_measure
            queues = [ph[4] for ph in result.totals.phases if lo <= ph[0] < hi]
            rows.append({
                "queued_share": float(np.mean([q > 0 for q in queues])) if queues else float("nan"),
                "requests": float(s.num_requests), "errors": s.error_rate, "ttft_p50_s": s.ttft_p50_s,
                "ttft_p95_s": s.ttft_p95_s, "tok_s_p50": s.tok_s_p50, "tok_s_p10": s.tok_s_p10,
                "hit": s.cache_hit, "queue_p50_s": phases["queue_p50_s"],
                "queue_p95_s": phases["queue_p95_s"],
            })
        out[name] = {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
        if len(rows) > 1:
            for k in rows[0]:
                out[name][f"{k}_min"] = min(r[k] for r in rows)
                out[name][f"{k}_max"] = max(r[k] for r in rows)
    return out


def _cell(v: float, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _sim_cell(row: dict[str, float], key: str, spec: str) -> str:
    """The median, and the range over the seeds when there was more than one."""
    cell = _cell(row.get(key, float("nan")), spec)
    lo, hi = row.get(f"{key}_min"), row.get(f"{key}_max")
    if lo is None or hi is None or cell == "-":
        return cell
    return f"{cell} ({_cell(lo, spec)}-{_cell(hi, spec)})"


ROWS = (
    ("requests (steady window)", "requests", ".0f"),
    ("TTFT p50 s", "ttft_p50_s", ".2f"),
    ("TTFT p95 s", "ttft_p95_s", ".2f"),
    ("tok/s p50", "tok_s_p50", ".1f"),
    ("tok/s p10", "tok_s_p10", ".1f"),
    ("cache hit", "hit", ".1%"),
    ("errors", "errors", ".2%"),
    ("admission queue p50 s", "queue_p50_s", ".2f"),
    ("admission queue p95 s", "queue_p95_s", ".2f"),
    ("turns that queued", "queued_share", ".0%"),
    ("L1 restores", "restores", ".0f"),
    ("restore wall p50 ms", "restore_wall_p50_ms", ".1f"),
    ("restore wall p95 ms", "restore_wall_p95_ms", ".1f"),
    ("restore wall / copy p50 (<= 1.5)", "restore_ratio_p50", ".2f"),
    ("restore wall / copy p95 (<= 3)", "restore_ratio_p95", ".2f"),
    ("restores with a copy < 0.5 ms", "restores_small", ".0f"),
    ("their wall p50 ms", "restore_small_wall_p50_ms", ".2f"),
    ("restore wall / copy p50, copy >= 0.5 ms", "restore_ratio_p50_large", ".2f"),
    ("restore wall / copy p95, copy >= 0.5 ms", "restore_ratio_p95_large", ".2f"),
)


def render(runs: dict[str, dict[str, float]], sim: dict[str, dict[str, float]] | None, note: str) -> str:
    lines = ["| figure | off (measured) | on (measured) | off (simulated) | on (simulated) |",
             "| --- | --- | --- | --- | --- |"]
    for label, key, spec in ROWS:
        cells = [_cell(runs.get(p, {}).get(key, float("nan")), spec) for p in ("off", "on")]
        cells += [_sim_cell((sim or {}).get(p, {}), key, spec) for p in ("off", "on")]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    verdict = []
    for p in ("off", "on"):
        r50, r95 = runs.get(p, {}).get("restore_ratio_p50"), runs.get(p, {}).get("restore_ratio_p95")
        if r50 is not None and not math.isnan(r50):
            ok = r50 <= RESTORE_TARGETS[0] and r95 is not None and r95 <= RESTORE_TARGETS[1]
            verdict.append(f"{p}: restore wall / copy {r50:.2f} / {r95:.2f} -> {'meets' if ok else 'misses'} "
                           f"<= {RESTORE_TARGETS[0]:g}x p50, <= {RESTORE_TARGETS[1]:g}x p95")
    return "\n".join(["Levers: " + ", ".join(f"{k}" for k in POLICIES["on"]) + " (off: all false).", "",
                      *lines, "", *verdict, "", note]) + "\n"


def measured_shared_prefix(out_dir: Path, block_size: int) -> int | None:
    """``shared_prefix_tokens`` of the first run whose load records are there (off, then on)."""
    for p in POLICIES:
        path = out_dir / p / "load_records.json"
        if path.exists():
            found = shared_prefix_tokens(orjson.loads(path.read_bytes()).get("records", []), block_size)
            if found is not None:
                return found
    return None


def report(out_dir: Path, prefill_tok_s: float, simulate: bool = True, seeds: int = 5) -> str:
    docs = {p: orjson.loads((out_dir / p / "multi_gpu_run.json").read_bytes())
            for p in POLICIES if (out_dir / p / "multi_gpu_run.json").exists()}
    runs = {p: measured(d) for p, d in docs.items()}
    sim = None
    note = "simulator: not run"
    base = docs.get("off") or docs.get("on")
    if simulate and base is not None:
        settings = base["settings"]
        decode = runs.get("off", runs.get("on", {})).get("tok_s_p50", float("nan"))
        restore = copy_gb_s(base)
        bpb = int(base.get("bytes_per_block") or 0) or 128
        shared = measured_shared_prefix(out_dir, int(base.get("config", {}).get("block_size") or 128))
        sim = predict(settings, bpb, decode, restore, prefill_tok_s, shared, seeds)
        shared_note = (f"{shared:,} tokens (measured: cold turns' hit + the replayed block)"
                       if shared is not None else
                       "the workload's system + tools (assumed)")
        st = settings
        note = (f"simulator: this setup ({st['ranks']} ranks x {st['num_blocks']} blocks, "
                f"L1 {st['l1_gb']} GiB per rank, {st['agents']} agents at {st['context']} tokens, "
                f"fresh arrivals, {st['duration']:g} s with {st['warmup']:g} s warm-up); engine: "
                f"1 token per decode step at the off run's measured {decode:.1f} tok/s, prefill "
                f"{prefill_tok_s:,.0f} tok/s (assumed), prompt steps whenever a prompt waits; "
                f"restores at the measured copy rate {restore:.1f} GB/s; prefix shared by every "
                f"conversation {shared_note}; median (range) over {max(1, seeds)} seed(s).")
    text = render(runs, sim, note)
    (out_dir / "onoff.md").write_text(text, encoding="utf-8")
    doc = {"measured": runs, "simulated": sim, "note": note}
    opts = orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY
    (out_dir / "onoff.json").write_bytes(orjson.dumps(doc, option=opts))
    return text
