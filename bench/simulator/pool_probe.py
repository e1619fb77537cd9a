"""Where each rank's KV pool goes under our policy: periodic samples of the real cache's ledgers.

    python -m bench.simulator step --context 500000 --agents 200 --pool-probe 5

The question: can admission hold more turns in flight? Each sample splits a rank's
blocks into: held by admitted turns (the chains of pinned blocks: their prefixes), filed but held
by nobody (idle: what admission may evict), reserved (blocks open admissions may still
allocate), releasing (evicted, their release not landed yet), the keep-out
(``CacheState.keep_out_blocks``: DeepInfer's watermark share and the slack), and the free rest.
Means over the measured window are printed, in blocks and in shares of the rank's capacity.
Printed, not asserted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from cache.l0_index import Node

FIELDS = ("held by turns", "idle", "reserved", "releasing", "keep-out", "free beyond keep-out")


def sample(manager: Any) -> list[list[int]]:
    """One sample per rank: block counts in ``FIELDS`` order; they sum to the rank's capacity
    (the last is negative when running replies overcommitted the pool)."""
    state = manager.state
    out = []
    for rank, ledger in enumerate(state.ledgers):
        nodes = state.l0[rank].nodes.values()
        held: set[int] = set()
        for node in nodes:
            walk: Node | None = node if node.use_count > 0 else None
            while walk is not None and id(walk) not in held:
                held.add(id(walk))
                walk = walk.parent
        keep_out = ledger.keep_out_blocks()
        out.append([len(held), len(nodes) - len(held), ledger.reserved_blocks, state.releases.pending(rank),
                    keep_out, ledger.plannable_free_blocks()])
    return out


class PoolProbe:
    """Samples ``manager`` every ``every_s`` of virtual time from ``start_s`` on (a task)."""

    def __init__(self, manager: Any, clock: Callable[[], float], every_s: float, start_s: float) -> None:
        self.samples: list[list[list[int]]] = []
        self._task = asyncio.ensure_future(self._run(manager, clock, every_s, start_s))

    async def _run(self, manager: Any, clock: Callable[[], float], every_s: float, start_s: float) -> None:
        await asyncio.sleep(max(0.0, start_s - clock()))
        while True:
            self.samples.append(sample(manager))
            await asyncio.sleep(every_s)

    def stop(self) -> None:
        self._task.cancel()

    def summary(self, capacity_blocks: int, block_tokens: int) -> str:
        if not self.samples:
            return "pool probe: no samples"
        mean = np.asarray(self.samples, dtype=float).mean(axis=(0, 1))  # over samples and ranks
        parts = ", ".join(f"{name} {v:.0f} ({100 * v / capacity_blocks:.1f}%)"
                          for name, v in zip(FIELDS, mean, strict=True))
        return (f"pool per rank, mean of {len(self.samples)} samples x {len(self.samples[0])} ranks, "
                f"blocks of {block_tokens} tokens, capacity {capacity_blocks}: {parts}")
