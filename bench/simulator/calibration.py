"""The seed's published figures and the calibration table: simulated / published / residual per cell.

The seed deployment guide ("Run DeepInfer with InferenceKey") publishes, for 4x B200:

* "Results on 4x B200": four steps with TTFT p50 / p95, per-agent tok/s p50 / p10 and cache hit;
* "Limits": at 500K, 200 agents "exceed the pool ... the cache hit fell to 41 % and TTFT p50 rose
  to 151 s" (no p95 or speeds).

A cell is within tolerance when ``|simulated - published| <= 25% of published``. The collapse is
judged on its direction (TTFT p50 up and hit down against the 500K x 100 row, hit under the 90%
pass line) and its order of magnitude (simulated / published within 0.1-10x for both figures).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

COLUMNS = ("ttft_p50_s", "ttft_p95_s", "tok_s_p50", "tok_s_p10", "cache_hit")
LABELS = ("TTFT p50 s", "TTFT p95 s", "tok/s p50", "tok/s p10", "cache hit")
# (context, agents): the five columns in COLUMNS order, as published.
PUBLISHED: dict[tuple[int, int], tuple[float, float, float, float, float]] = {
    (128_000, 300): (5.6, 14.8, 35.0, 16.0, 0.98),
    (500_000, 50): (2.5, 4.4, 163.0, 100.0, 1.00),
    (500_000, 100): (2.6, 37.0, 135.0, 39.0, 0.99),
    (1_000_000, 48): (3.6, 28.9, 69.0, 22.0, 1.00),
}
COLLAPSE_STEP = (500_000, 200)
COLLAPSE_PUBLISHED = {"ttft_p50_s": 151.0, "cache_hit": 0.41}
COLLAPSE_REFERENCE_STEP = (500_000, 100)  # the published step the collapse is compared against
TOLERANCE = 0.25
PASS_HIT = 0.90


@dataclass(frozen=True, slots=True)
class Cell:
    column: str
    simulated: float
    published: float
    tolerance: float = TOLERANCE

    @property
    def residual(self) -> float:
        """(simulated - published) / published; NaN when the simulation has no figure."""
        return (self.simulated - self.published) / self.published

    @property
    def within(self) -> bool:
        return not math.isnan(self.simulated) and abs(self.residual) <= self.tolerance + 1e-9  # 25.0% is in


def row_cells(simulated: Mapping[str, float], published: Sequence[float]) -> list[Cell]:
    """The five cells of one step (``simulated``: a StepStats dump, or any mapping with COLUMNS)."""
    return [Cell(col, float(simulated[col]), float(pub)) for col, pub in zip(COLUMNS, published, strict=True)]


def _fmt(value: float, column: str) -> str:
    if math.isnan(value):
        return "-"
    if column == "cache_hit":
        return f"{100 * value:.1f}%"
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def format_table(rows: Sequence[tuple[int, int, list[Cell]]]) -> str:
    """One line per step: ``sim / pub (residual)`` per column, a star on cells outside tolerance."""
    head = f"{'step':>11} | " + " | ".join(f"{label:^24}" for label in LABELS)
    lines = [head, "-" * len(head)]
    for context, agents, cells in rows:
        parts = []
        for c in cells:
            mark = " " if c.within else "*"
            parts.append(f"{_fmt(c.simulated, c.column):>7} / {_fmt(c.published, c.column):<6} "
                         f"{c.residual:+5.0%}{mark}"
                         .rjust(24))
        lines.append(f"{f'{context // 1000}K x {agents}':>11} | " + " | ".join(parts))
    n_in = sum(c.within for _, _, cells in rows for c in cells)
    n_all = sum(len(cells) for _, _, cells in rows)
    lines.append(f"cells within {TOLERANCE:.0%} of the published figure: {n_in} of {n_all} (* = outside)")
    return "\n".join(lines)


def _same_order(simulated: float, published: float) -> bool:
    return simulated > 0 and 0.1 <= simulated / published <= 10.0


def collapse_verdict(collapse: Mapping[str, float], reference: Mapping[str, float]) -> dict[str, object]:
    """Is the simulated 500K x 200 step the published collapse? ``reference``: the simulated
    500K x 100 step of the same model."""
    p50, hit = float(collapse["ttft_p50_s"]), float(collapse["cache_hit"])
    direction = (p50 > float(reference["ttft_p50_s"]) and hit < float(reference["cache_hit"])
                 and hit < PASS_HIT)
    return {
        "ttft_p50_s": p50,
        "cache_hit": hit,
        "published": dict(COLLAPSE_PUBLISHED),
        "direction": direction,
        "order_ttft_p50": _same_order(p50, COLLAPSE_PUBLISHED["ttft_p50_s"]),
        "order_cache_hit": _same_order(hit, COLLAPSE_PUBLISHED["cache_hit"]),
    }


def format_collapse(label: str, verdict: Mapping[str, object]) -> str:
    yes = {True: "yes", False: "NO"}
    return (f"  {label:34} TTFT p50 {verdict['ttft_p50_s']:7.1f} s (published 151) | hit "
            f"{100 * float(verdict['cache_hit']):5.1f}% (published 41%) | direction "
            f"{yes[bool(verdict['direction'])]}, "
            f"order of magnitude: TTFT p50 {yes[bool(verdict['order_ttft_p50'])]}, "
            f"hit {yes[bool(verdict['order_cache_hit'])]}")
