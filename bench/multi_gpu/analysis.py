"""Pure helpers of the multi-GPU run: /metrics parsing, cache hit by tier, the copy limit curve,
restore-vs-limit ratios and request windows. No I/O and no clocks here (unit-tested)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from rank.link import TransferTiming

CACHE_NS = "deepinfer_cache_"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{label=value,...}": value} (labels sorted; no labels: bare name)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Counter increase between two scrapes (keys of ``after``; absent before = 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def cache_tiers(d: dict[str, float]) -> dict[str, Any]:
    """Cache hit by tier from a (delta of) scrape: prompt tokens, L0/L1 tokens and shares,
    L1 restores (count, total and mean seconds, tokens), writes, moves, evictions."""
    prompt = d.get(CACHE_NS + "prompt_tokens_total", 0.0)
    l0 = d.get(CACHE_NS + "cached_tokens_total{tier=l0}", 0.0)
    l1 = d.get(CACHE_NS + "cached_tokens_total{tier=l1}", 0.0)
    n_restores = d.get(CACHE_NS + "l1_restore_seconds_count", 0.0)
    restore_sum = d.get(CACHE_NS + "l1_restore_seconds_sum", 0.0)
    evicted = sum(v for k, v in d.items() if k.startswith(CACHE_NS + "evicted_blocks_total"))
    restored = d.get(CACHE_NS + "l1_restored_tokens_total", 0.0)
    # A prefetch (the service starts one as soon as it has read a known session's headers)
    # restores blocks before the admission, which then files them under tier "l0"; the
    # restored-tokens counter counts both kinds. So: served from host ~= restored tokens,
    # GPU-resident = all cached - restored (assumes each restored block feeds the next turn).
    cached = l0 + l1
    return {
        "prompt_tokens": int(prompt),
        "l0_tokens": int(l0),
        "l1_tokens": int(l1),
        "hit_l0": l0 / prompt if prompt else float("nan"),
        "hit_l1": l1 / prompt if prompt else float("nan"),
        "hit_total": (l0 + l1) / prompt if prompt else float("nan"),
        "l1_restores": int(n_restores),
        "l1_restore_seconds_sum": restore_sum,
        "l1_restore_mean_s": restore_sum / n_restores if n_restores else float("nan"),
        "l1_restored_tokens": int(restored),
        "hit_resident_corrected": max(0.0, cached - restored) / prompt if prompt else float("nan"),
        "hit_restored_corrected": min(restored, cached) / prompt if prompt else float("nan"),
        "l1_written_blocks": int(d.get(CACHE_NS + "l1_written_blocks_total", 0.0)),
        "sessions_moved": int(d.get(CACHE_NS + "sessions_moved_total", 0.0)),
        "evicted_blocks": int(evicted),
        "admissions": int(d.get(CACHE_NS + "admissions_total{outcome=admitted}", 0.0)),
        "admission_queue_seconds_sum": d.get(CACHE_NS + "admission_queue_seconds_sum", 0.0),
    }


@dataclass(slots=True)
class CopyLimit:
    """Contiguous pinned host -> device copy time as a function of bytes (one device).

    Piecewise linear between measured sizes; below the smallest, that size's time (latency
    floor); above the largest, the largest size's bandwidth."""

    sizes_bytes: list[int]
    times_s: list[float]

    @classmethod
    def from_rows(cls, rows: Iterable[dict[str, Any]], key: str = "contiguous_s") -> CopyLimit:
        pairs = sorted((int(r["bytes"]), float(r[key])) for r in rows)
        if not pairs:
            raise ValueError("no copy measurements")
        return cls([p[0] for p in pairs], [p[1] for p in pairs])

    def time_s(self, nbytes: int) -> float:
        xs, ys = self.sizes_bytes, self.times_s
        if nbytes <= xs[0]:
            return ys[0]
        if nbytes >= xs[-1]:
            return ys[-1] * nbytes / xs[-1]
        i = bisect.bisect_left(xs, nbytes)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile as one of the values (nearest rank, no interpolation): what the
    transfer benchmarks print for their round trips."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def quantiles(values: Sequence[float], qs: Sequence[float] = (0.5, 0.95)) -> list[float]:
    arr = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=np.float64)
    return [float(np.quantile(arr, q)) if arr.size else float("nan") for q in qs]


SMALL_COPY_S = 0.5e-3  # restores whose copy is shorter are also reported apart (below)


def restore_table(restores: list[dict[str, Any]], limits: dict[int, CopyLimit],
                  bytes_per_block: int) -> dict[str, Any]:
    """Restores as the backend timed them (``import_blocks`` round trips) against the copy
    limit of the restoring rank's GPU at each restore's size.

    Also split at a copy of ``SMALL_COPY_S``: a round trip has a floor (command, engine call,
    synchronize, reply: 0.6-1.1 ms on the H200 host, docs/loadtest.md) that alone is more than 3x
    the copy of a restore of a few blocks, so those restores are counted apart (``num_small``,
    their wall ``small_wall_p50_s``) and the ratios of the others given too (``*_large``)."""
    rows = []
    for r in restores:
        if not r.get("ok"):
            continue
        nbytes = r["num_blocks"] * bytes_per_block
        limit = limits.get(r["rank"])
        limit_s = limit.time_s(nbytes) if limit is not None else float("nan")
        rows.append({**r, "bytes": nbytes, "limit_s": limit_s,
                     "ratio": r["wall_s"] / limit_s if limit_s else float("nan")})
    walls = [r["wall_s"] for r in rows]
    ratios = [r["ratio"] for r in rows]
    total_bytes = sum(r["bytes"] for r in rows)
    total_wall = sum(walls)
    total_limit = sum(r["limit_s"] for r in rows)
    p50, p95 = quantiles(walls)
    r50, r95 = quantiles(ratios)
    b50, b95 = quantiles([r["num_blocks"] for r in rows])
    large = [r["ratio"] for r in rows if r["limit_s"] >= SMALL_COPY_S]
    small_walls = [r["wall_s"] for r in rows if not r["limit_s"] >= SMALL_COPY_S]
    l50, l95 = quantiles(large)
    return {
        "num": len(rows),
        "num_failed": sum(1 for r in restores if not r.get("ok")),
        "blocks_p50": b50, "blocks_p95": b95,
        "wall_p50_s": p50, "wall_p95_s": p95,
        "ratio_p50": r50, "ratio_p95": r95,
        "num_small": len(small_walls), "small_wall_p50_s": quantiles(small_walls)[0],
        "ratio_p50_large": l50, "ratio_p95_large": l95,
        "total_bytes": total_bytes,
        "effective_gb_s": total_bytes / total_wall / 1e9 if total_wall else float("nan"),
        "limit_gb_s": total_bytes / total_limit / 1e9 if total_limit else float("nan"),
        "by_rank": {str(k): sum(1 for r in rows if r["rank"] == k)
                    for k in sorted({r["rank"] for r in rows})},
    }


def folded_restores(timings: Iterable[TransferTiming]) -> list[dict[str, Any]]:
    """The restores folded into their turn's add (``RankGroup.transfer_log`` op "fold"), as rows
    like the ``Recorder``'s timed ``import_blocks``. Their wall is the turn's cost: from the add's
    send to the import's end on the rank, when the add goes on to the loop thread (the reply
    itself leaves only once the add is applied, and nothing waits for it)."""
    return [{"t": t.sent, "rank": t.rank, "num_blocks": t.num_blocks, "ok": True, "folded": True,
             "wall_s": t.to_rank_s + t.wait_s + t.engine_s}
            for t in timings if t.op == "fold"]


def phase_table(timings: Iterable[TransferTiming], op: str, t_from: float = -math.inf,
                t_to: float = math.inf) -> dict[str, Any]:
    """One op's round trips (``RankGroup.transfer_log``) split by phase: p50 / p95 / mean per
    phase (seconds) and of their total, in ``TransferTiming.PHASES`` order, sent in [t_from, t_to)."""
    rows = [t for t in timings if t.op == op and t_from <= t.sent < t_to]
    out: dict[str, Any] = {"num": len(rows)}
    for name in (*TransferTiming.PHASES, "total_s"):
        values = [getattr(t, name) for t in rows]
        p50, p95 = quantiles(values)
        out[name] = {"p50": p50, "p95": p95, "mean": float(np.mean(values)) if values else float("nan")}
    return out


def in_window(records: Iterable[Any], t_from: float, t_to: float) -> list[Any]:
    return [r for r in records if t_from <= r.t_start < t_to]


def fault_window(records: Iterable[Any], t_kill: float) -> dict[str, Any]:
    """What the agents saw of a fault: requests in flight at the kill and how they ended."""
    in_flight = [r for r in records if r.t_start <= t_kill < r.t_end]
    failed = [r for r in in_flight if r.error is not None]
    later = [r for r in records if r.t_start > t_kill]
    first_ok_after = min((r.t_end for r in later if r.error is None), default=None)
    errors_after = [r for r in later if r.error is not None]
    return {
        "in_flight_at_kill": len(in_flight),
        "in_flight_failed": len(failed),
        "in_flight_completed": len(in_flight) - len(failed),
        "first_error_end_after_kill_s": (min(r.t_end for r in failed) - t_kill) if failed else None,
        "last_error_end_after_kill_s": (max(r.t_end for r in failed) - t_kill) if failed else None,
        "agent_first_ok_end_after_kill_s": (first_ok_after - t_kill) if first_ok_after is not None else None,
        "requests_started_after_kill": len(later),
        "errors_started_after_kill": len(errors_after),
        "error_samples": sorted({(r.error or "")[:160] for r in failed + errors_after})[:4],
    }
