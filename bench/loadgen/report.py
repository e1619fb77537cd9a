"""Per-step statistics, the seed's pass/fail verdict, a text table, JSON and PNG charts.

Pass criteria (the seed deployment guide, "Run DeepInfer with InferenceKey", "Results on
4x B200"): TTFT p95 <= 15 s, per-agent speed p50 >= 20 tok/s and p10 >= 10 tok/s, cache hit
>= 90 %, errors < 1 %. Speed is per stream (each request's decode rate as its agent saw it).
Cache hit = sum(cache_read_input_tokens) / sum(all input tokens) over the requests that started
after the warm-up.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from pydantic import BaseModel, Field

from bench.loadgen.client import RequestRecord


class Criteria(BaseModel):
    ttft_p95_max_s: float = 15.0
    tok_s_p50_min: float = 20.0
    tok_s_p10_min: float = 10.0
    cache_hit_min: float = 0.90
    error_rate_max: float = 0.01  # strictly below


class StepStats(BaseModel):
    """One step (one agent count) of a run."""

    label: str
    context_target_tokens: int
    num_agents: int
    duration_s: float
    num_requests: int
    num_errors: int
    error_rate: float
    ttft_p50_s: float
    ttft_p95_s: float
    tok_s_p50: float
    tok_s_p10: float
    cache_hit: float
    cache_hit_all: float = Field(description="including the warm-up requests")
    input_tokens_per_s: float
    output_tokens_per_s: float
    mean_input_tokens: float
    verdict: str
    failed: list[str]
    errors_sample: list[str] = Field(default_factory=list)
    timeline: list[dict[str, Any]] = Field(default_factory=list, description="per-request summaries (capped)")


_FLOAT_FIELDS = frozenset(
    name for name, info in StepStats.model_fields.items() if info.annotation is float
)


def _q(values: list[float], q: float) -> float:
    return float(np.quantile(np.asarray(values, dtype=np.float64), q)) if values else float("nan")


def verdict(stats: dict[str, float], criteria: Criteria) -> tuple[str, list[str]]:
    failed = []
    if not stats["ttft_p95_s"] <= criteria.ttft_p95_max_s:
        failed.append(f"TTFT p95 {stats['ttft_p95_s']:.1f} s > {criteria.ttft_p95_max_s:g} s")
    if not stats["tok_s_p50"] >= criteria.tok_s_p50_min:
        failed.append(f"tok/s p50 {stats['tok_s_p50']:.1f} < {criteria.tok_s_p50_min:g}")
    if not stats["tok_s_p10"] >= criteria.tok_s_p10_min:
        failed.append(f"tok/s p10 {stats['tok_s_p10']:.1f} < {criteria.tok_s_p10_min:g}")
    if not stats["cache_hit"] >= criteria.cache_hit_min:
        failed.append(f"cache {stats['cache_hit']:.1%} < {criteria.cache_hit_min:.0%}")
    if not stats["error_rate"] < criteria.error_rate_max:
        failed.append(f"errors {stats['error_rate']:.2%} >= {criteria.error_rate_max:.0%}")
    return ("pass" if not failed else "fail"), failed


def step_stats(
    label: str,
    context_target_tokens: int,
    num_agents: int,
    records: list[RequestRecord],
    t_measure_start: float,
    t_measure_end: float,
    criteria: Criteria,
    max_timeline: int = 4000,
) -> StepStats:
    """Statistics over requests that started inside ``[t_measure_start, t_measure_end)``."""
    window = [r for r in records if t_measure_start <= r.t_start < t_measure_end]
    ok = [r for r in window if r.error is None]
    errors = [r for r in window if r.error is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    speeds = [s for s in (r.tokens_per_s for r in ok) if s is not None]
    total_in = sum(r.total_input_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    all_ok = [r for r in records if r.error is None]
    total_in_all = sum(r.total_input_tokens for r in all_ok)
    duration = max(1e-9, t_measure_end - t_measure_start)
    values = {
        "ttft_p50_s": _q(ttfts, 0.5),
        "ttft_p95_s": _q(ttfts, 0.95),
        "tok_s_p50": _q(speeds, 0.5),
        "tok_s_p10": _q(speeds, 0.1),
        "cache_hit": cached / total_in if total_in else float("nan"),
        "error_rate": len(errors) / len(window) if window else 1.0,
    }
    word, failed = verdict(values, criteria)
    t0 = min((r.t_start for r in records), default=0.0)
    timeline = []
    for r in records[-max_timeline:]:
        item = r.summary()
        item["t_start"] = round(r.t_start - t0, 3)
        item["t_end"] = round(r.t_end - t0, 3)
        item["measured"] = t_measure_start <= r.t_start < t_measure_end
        timeline.append(item)
    return StepStats(
        label=label,
        context_target_tokens=context_target_tokens,
        num_agents=num_agents,
        duration_s=round(duration, 2),
        num_requests=len(window),
        num_errors=len(errors),
        error_rate=values["error_rate"],
        ttft_p50_s=values["ttft_p50_s"],
        ttft_p95_s=values["ttft_p95_s"],
        tok_s_p50=values["tok_s_p50"],
        tok_s_p10=values["tok_s_p10"],
        cache_hit=values["cache_hit"],
        cache_hit_all=sum(r.cached_tokens for r in all_ok) / total_in_all if total_in_all else float("nan"),
        input_tokens_per_s=total_in / duration,
        output_tokens_per_s=sum(r.output_tokens for r in ok) / duration,
        mean_input_tokens=total_in / len(ok) if ok else 0.0,
        verdict=word,
        failed=failed,
        errors_sample=sorted({r.error or "" for r in errors})[:5],
        timeline=timeline,
    )


def _fmt(value: float, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def format_table(steps: list[StepStats]) -> str:
    head = (
        f"{'context':>8} {'agents':>6} {'reqs':>6} {'TTFT p50/p95 s':>16} {'tok/s p50/p10':>14} "
        f"{'cache':>6} {'errors':>7} {'in tok/s':>9}  verdict"
    )
    lines = [head, "-" * len(head)]
    for s in steps:
        ctx = f"{s.context_target_tokens // 1000}K"
        lines.append(
            f"{ctx:>8} {s.num_agents:>6} {s.num_requests:>6} "
            f"{_fmt(s.ttft_p50_s, '.2f') + ' / ' + _fmt(s.ttft_p95_s, '.2f'):>16} "
            f"{_fmt(s.tok_s_p50, '.1f') + ' / ' + _fmt(s.tok_s_p10, '.1f'):>14} "
            f"{_fmt(s.cache_hit * 100, '.1f') + '%':>6} {_fmt(s.error_rate * 100, '.2f') + '%':>7} "
            f"{_fmt(s.input_tokens_per_s, ',.0f'):>9}  {s.verdict}"
            + (f" ({'; '.join(s.failed)})" if s.failed else "")
        )
    return "\n".join(lines)


def save_json(path: str | Path, meta: dict[str, Any], steps: list[StepStats]) -> None:
    doc = {"meta": meta, "steps": [s.model_dump() for s in steps]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(orjson.dumps(doc,
                                        option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY
                                        | orjson.OPT_NON_STR_KEYS))


def load_json(path: str | Path) -> tuple[dict[str, Any], list[StepStats]]:
    doc = orjson.loads(Path(path).read_bytes())
    steps = []
    for raw in doc.get("steps", []):
        # JSON has no NaN: orjson wrote missing figures as null
        fixed = {k: (float("nan") if v is None and k in _FLOAT_FIELDS else v) for k, v in raw.items()}
        steps.append(StepStats.model_validate(fixed))
    return doc.get("meta", {}), steps


def compare(a_path: str, b_path: str) -> str:
    """Side-by-side of two runs, matched by (context, agents)."""
    _ma, a_steps = load_json(a_path)
    _mb, b_steps = load_json(b_path)
    b_by_key = {(s.context_target_tokens, s.num_agents): s for s in b_steps}
    lines = [f"A = {a_path}", f"B = {b_path}", ""]
    head = f"{'context':>8} {'agents':>6} {'metric':>12} {'A':>10} {'B':>10} {'B-A':>10}"
    lines += [head, "-" * len(head)]
    metrics = [
        ("ttft_p50_s", ".2f"),
        ("ttft_p95_s", ".2f"),
        ("tok_s_p50", ".1f"),
        ("tok_s_p10", ".1f"),
        ("cache_hit", ".3f"),
        ("error_rate", ".4f"),
    ]
    for a in a_steps:
        b = b_by_key.get((a.context_target_tokens, a.num_agents))
        for name, spec in metrics:
            va = getattr(a, name)
            vb = getattr(b, name) if b else float("nan")
            lines.append(
                f"{a.context_target_tokens // 1000:>7}K {a.num_agents:>6} {name:>12} {_fmt(va, spec):>10} "
                f"{_fmt(vb, spec):>10} {_fmt(vb - va, '+' + spec):>10}"
            )
        lines.append(f"{'':>8} {'':>6} {'verdict':>12} {a.verdict:>10} {(b.verdict if b else '-'):>10}")
    return "\n".join(lines)


def write_charts(steps: list[StepStats], out_dir: str | Path, title: str, criteria: Criteria) -> list[Path]:
    """summary.png (TTFT, speed, cache hit per agent count) and timeline.png (per request)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    agents = [s.num_agents for s in steps]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    ax.plot(agents, [s.ttft_p50_s for s in steps], "o-", label="p50")
    ax.plot(agents, [s.ttft_p95_s for s in steps], "s-", label="p95")
    ax.axhline(criteria.ttft_p95_max_s, color="r", ls="--", lw=1,
               label=f"p95 limit {criteria.ttft_p95_max_s:g} s")
    ax.set(xlabel="agents", ylabel="TTFT (s)", title="Time to first token")
    ax.legend()
    ax = axes[1]
    ax.plot(agents, [s.tok_s_p50 for s in steps], "o-", label="p50")
    ax.plot(agents, [s.tok_s_p10 for s in steps], "s-", label="p10")
    ax.axhline(criteria.tok_s_p50_min, color="r", ls="--", lw=1, label="p50 min")
    ax.axhline(criteria.tok_s_p10_min, color="m", ls=":", lw=1, label="p10 min")
    ax.set(xlabel="agents", ylabel="tokens/s per stream", title="Per-agent speed")
    ax.legend()
    ax = axes[2]
    ax.plot(agents, [100 * s.cache_hit for s in steps], "o-", label="steady state")
    ax.plot(agents, [100 * s.cache_hit_all for s in steps], "x--", label="incl. warm-up")
    ax.axhline(100 * criteria.cache_hit_min, color="r", ls="--", lw=1, label="min")
    ax.set(xlabel="agents", ylabel="% of input tokens", title="Cache hit", ylim=(0, 101))
    ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    paths = [out / "summary.png"]
    fig.savefig(paths[0], dpi=90)
    plt.close(fig)

    fig, axes = plt.subplots(2, 1, figsize=(12, 6.5), sharex=True)
    offset = 0.0
    for s in steps:
        ts = [e["t_start"] + offset for e in s.timeline if e.get("ttft_s") is not None]
        tt = [e["ttft_s"] for e in s.timeline if e.get("ttft_s") is not None]
        axes[0].scatter(ts, tt, s=4, label=f"{s.num_agents} agents")
        hits = [(e["t_start"] + offset, e["cached"] / e["in"]) for e in s.timeline if e.get("in")]
        if hits:
            axes[1].scatter([h[0] for h in hits], [100 * h[1] for h in hits], s=4)
        offset = max([offset] + [e["t_end"] + offset for e in s.timeline]) + 5
    axes[0].set(ylabel="TTFT (s)", title="Every request")
    axes[0].legend(markerscale=3, fontsize=8)
    axes[1].set(xlabel="time (s)", ylabel="cached % of input", ylim=(-2, 102))
    fig.tight_layout()
    paths.append(out / "timeline.png")
    fig.savefig(paths[1], dpi=90)
    plt.close(fig)
    return paths
