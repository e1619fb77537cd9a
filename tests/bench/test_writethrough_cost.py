"""``bench/writethrough_cost.py`` runs, and the write-through exports what the turns added: with it
on, the simulated agents' turns are exported to L1 as they finish; with it off, only evictions
export (none at this size: the pools hold every session)."""

from __future__ import annotations

from bench.writethrough_cost import V41_BYTES_PER_BLOCK, run


def test_write_through_exports_every_turn_and_off_exports_nothing_without_pressure() -> None:
    on = run(context=20_000, agents=4, duration_s=60.0, watermark=0.0)
    off = run(context=20_000, agents=4, duration_s=60.0, watermark=1.0)
    assert on["requests"] > 0 and off["requests"] > 0
    assert on["blocks_per_s"] > 0
    assert off["blocks_per_s"] == 0
    assert on["bytes_per_s"] == on["blocks_per_s"] * V41_BYTES_PER_BLOCK
