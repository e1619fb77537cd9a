"""Subagent fan-outs in the lockstep model: per-rank load imbalance and the node's step time.

``python -m bench.simulator [--seed N] subagents --context 500000 --agents 200`` runs one step
per configuration (``ROWS``): ours with branch routing (the default: each subagent its own
routing unit), ours with ``branch_routing`` off (every subagent on its parent's rank), ours
without subagents, and the seed's model with and without them. In lockstep a step lasts as
long as the slowest rank's, so a rank that holds more sequences paces the node: the table gives
the time-weighted running sequences per rank (lowest, mean, highest; highest / mean is the
imbalance) and the mean decode step of the node against the one the ranks' mean load would
give.
"""

from __future__ import annotations

from typing import Any

from bench.loadgen.report import StepStats
from bench.simulator.model import OursPolicy, SimConfig

ROWS: dict[str, str] = {
    "ours": "ours, branch routing (default)",
    "ours-stacked": "ours, branch_routing off",
    "ours-off": "ours, no subagents",
    "seed": "seed model",
    "seed-off": "seed model, no subagents",
}


def row_config(config: SimConfig, row: str, mix: str) -> SimConfig:
    """The step's config for one of ``ROWS`` (``mix``: the subagent mix of the rows with them)."""
    if row not in ROWS:
        raise SystemExit(f"subagents --rows: unknown {row!r}; known: {', '.join(ROWS)}")
    policy = "seed" if row.startswith("seed") else "ours"
    update: dict[str, Any] = {"policy": policy, "subagents": "off" if row.endswith("-off") else mix}
    if row == "ours-stacked":
        ours = config.ours
        update["ours"] = OursPolicy(scheduling=ours.scheduling, place_homeless=ours.place_homeless,
                                    vote_filler=ours.vote_filler,
                                    cache={**ours.cache, "branch_routing": False})
    return config.model_copy(update=update)


def lockstep_figures(engine: dict[str, float]) -> dict[str, float]:
    """Imbalance and step times from ``EngineCounters.summary()`` (decode steps; ms)."""
    steps = max(1, int(engine["decode_steps"]))
    mean = engine["mean_running_per_rank"]
    return {
        "running_min": engine["min_running"], "running_mean": mean, "running_max": engine["max_running"],
        "imbalance": engine["max_running"] / mean if mean else 0.0,
        "decode_step_ms": 1000 * engine["decode_s"] / steps,
        "decode_step_mean_rank_ms": 1000 * engine["decode_mean_s"] / steps,
        "prefill_step_ms": 1000 * engine["prefill_s"] / max(1, int(engine["prefill_steps"])),
        "prefill_step_mean_rank_ms": 1000 * engine["prefill_mean_s"] / max(1, int(engine["prefill_steps"])),
    }


def format_rows(rows: list[tuple[str, StepStats, dict[str, float]]]) -> str:
    head = (f"{'configuration':<31} {'reqs':>5} {'sub %':>5} {'TTFT p50/p95 s':>15} {'tok/s p50/p10':>14} "
            f"{'hit':>6} {'running/rank min/mean/max':>25} {'imbal':>5} {'decode ms node/mean':>19} "
            f"{'prompt ms node/mean':>19}  verdict")
    out = [head]
    for label, s, e in rows:
        f = lockstep_figures(e)
        ttft = f"{s.ttft_p50_s:.2f} / {s.ttft_p95_s:.2f}"
        speed = f"{s.tok_s_p50:.1f} / {s.tok_s_p10:.1f}"
        running = f"{f['running_min']:.1f} / {f['running_mean']:.1f} / {f['running_max']:.1f}"
        decode = f"{f['decode_step_ms']:.1f} / {f['decode_step_mean_rank_ms']:.1f}"
        prompt = f"{f['prefill_step_ms']:.0f} / {f['prefill_step_mean_rank_ms']:.0f}"
        share = 100 * e["subagent_share"]
        out.append(f"{label:<31} {s.num_requests:>5} {share:>5.1f} {ttft:>15} {speed:>14} "
                   f"{100 * s.cache_hit:>5.1f}% {running:>25} {f['imbalance']:>5.2f} {decode:>19} "
                   f"{prompt:>19}  {s.verdict}")
    return "\n".join(out)
