"""``RankLedger``: what the planners may plan on per rank, and the one place its counters change.

A rank's pool (``num_blocks - 1``: block 0 is scratch) is split four ways::

    free = capacity - indexed - reserved - releasing

``indexed`` is the rank's L0 index (``cache/l0_index.py``), ``releasing`` the blocks out of the
index whose release has not landed (``cache/releases.py``), and ``reserved`` the blocks promised
to turns and prefetches that may still allocate them. The ledger also counts the router's and
the output room's per-rank load: ``running_tokens`` (context tokens of admitted, unfinished
turns), ``num_open`` (open admissions) and ``worst_blocks`` (their prompt + ``max_tokens``,
``cache/output_room.py``). ``worst_fits`` counts a block that several open turns' prefixes pin
once: the engine holds it once (a system prompt and tools every subagent starts with, say).

Every change goes through a method here, and each keeps the invariants it can see:

* no counter is ever negative, and neither is an admission's share of one;
* ``reserved == unowned + sum of the open admissions' reserved_blocks``, where ``unowned`` is
  what committed plans (``cache/planner.py``, until the admission is built) and prefetches hold;
  likewise for ``running_tokens`` and ``worst_blocks`` (a committed turn's worst case counts from
  its commit on, while it still evicts for itself: a turn admitted meanwhile must see it).
  ``open`` takes a plan's hold over as the admission's, so the
  sums hold at every instant, not only when the cache is quiet (``check``);
* a reservation that was planned to fit (``reserve``) leaves ``indexed + reserved <= capacity``:
  every promised block exists once the pending releases land. ``free`` itself may be below zero
  for a moment: a turn that evicted for itself counts the evicted blocks it will allocate while
  their release is still in flight (they are ``releasing`` and part of its reservation until
  the release lands, before its own command reaches the rank).
* ``grow`` is the one reservation that may go past the pool: a reply's room grown when eviction
  could not cover it (the output room's documented short case, counted there) and the replayed
  block of a restore that failed.

The ledger of an epoch dies with it (``CacheState.reset`` makes new ones); callers check the
epoch before they change it, as they do for the L0 index.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from cache.hashing import common_prefix

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from cache.config import CacheConfig
    from cache.hashing import BlockHash
    from cache.l0_index import RankIndex
    from cache.turns import Admission


class RankLedger:
    """One rank's reservations and load (see the module docstring). One event loop."""

    __slots__ = ("_index", "_keep_out", "_open", "_releasing", "_reserved", "_running",
                 "_unowned_blocks", "_unowned_tokens", "_unowned_worst", "_usable", "_worst",
                 "capacity_blocks")

    def __init__(self, capacity_blocks: int, config: CacheConfig, index: RankIndex,
                 releasing: Callable[[], int]) -> None:
        self.capacity_blocks = capacity_blocks  # num_blocks - 1 (block 0 is scratch)
        self._index = index
        self._releasing = releasing
        # the blocks the cache may use: DeepInfer's prefill watermark counts cached blocks as used,
        # so cached + reserved must stay under ``usable_fraction`` of the pool
        self._usable = math.floor(capacity_blocks * config.usable_fraction + 1e-9)
        self._keep_out = config.reserve_blocks + (capacity_blocks - self._usable)
        self._reserved = 0
        self._running = 0
        self._worst = 0
        self._open: set[Admission] = set()  # open admissions (``worst_fits`` reads their prefixes)
        self._unowned_blocks = 0  # reserved by committed plans and prefetches, no admission yet
        self._unowned_tokens = 0  # running tokens of committed plans, no admission yet
        self._unowned_worst = 0  # worst cases of committed plans, no admission yet

    # ------------------------------------------------------------------ reads

    @property
    def reserved_blocks(self) -> int:
        """Blocks open admissions (and plans and prefetches) may still allocate."""
        return self._reserved

    @property
    def running_tokens(self) -> int:
        """Context tokens of admitted, unfinished turns (the router's load)."""
        return self._running

    @property
    def num_open(self) -> int:
        """Open admissions."""
        return len(self._open)

    @property
    def worst_blocks(self) -> int:
        """Open admissions' prompt + ``max_tokens``, in blocks (``cache/output_room.py``)."""
        return self._worst

    def free_blocks(self) -> int:
        """Blocks nobody holds or plans on. A block whose release is still in flight is held by
        the engine until the release lands, so it is not free yet (planning on it made imports
        fail with CapacityExhausted)."""
        return self.capacity_blocks - len(self._index) - self._reserved - self._releasing()

    def keep_out_blocks(self) -> int:
        """Blocks admission never plans on: ``reserve_blocks`` of slack plus the share above
        ``usable_fraction``."""
        return self._keep_out

    def plannable_free_blocks(self) -> int:
        """Free blocks any planner may take (negative when running replies' growth overcommitted
        the pool)."""
        return self.free_blocks() - self._keep_out

    def usable_blocks(self) -> int:
        """The most blocks one turn may hold: capacity less the keep-out."""
        return self.capacity_blocks - self._keep_out

    def pool_usage(self) -> float:
        """Cached + reserved blocks over the blocks the cache may use (``usable_fraction``)."""
        if self._usable <= 0:
            return 1.0
        return (len(self._index) + self._reserved) / self._usable

    def worst_fits(self, worst_blocks: int, hashes: list[BlockHash] | None = None,
                   num_prefix: int = 0) -> bool:
        """Would a turn whose worst case is ``worst_blocks`` fit beside the open ones' worst cases?
        It would pin ``hashes[:num_prefix]`` from the rank's L0 index. Each worst case counts its
        prefix, but a block in several open turns' prefixes exists once, so when the plain sum
        does not fit, the blocks the prefixes share are taken off once each (``shared_blocks``);
        the rest of a prompt and the reply are each turn's own blocks."""
        usable = self.usable_blocks()
        if self._worst + worst_blocks <= usable:
            return True
        chains = [(a.hashes, a.num_used_blocks) for a in self._open]
        if hashes is not None and num_prefix:
            chains.append((hashes, num_prefix))
        return self._worst + worst_blocks - shared_blocks(chains) <= usable

    # ------------------------------------------------------------------ plans and prefetches

    def reserve(self, num_blocks: int) -> None:
        """Reserve blocks a planner found room for (a committed plan, a prefetch), held until
        ``open`` hands them to an admission or ``unreserve`` gives them back."""
        assert num_blocks >= 0, num_blocks
        self._reserved += num_blocks
        self._unowned_blocks += num_blocks
        assert len(self._index) + self._reserved <= self.capacity_blocks, (
            f"reserved {self._reserved} + indexed {len(self._index)} > capacity {self.capacity_blocks}")

    def unreserve(self, num_blocks: int) -> None:
        """Give back a plan's or a prefetch's reservation (undone, or filed in the index)."""
        self._reserved -= num_blocks
        self._unowned_blocks -= num_blocks
        assert 0 <= self._unowned_blocks <= self._reserved, (self._unowned_blocks, self._reserved)

    def count_running(self, num_tokens: int, worst_blocks: int = 0) -> None:
        """A committed plan's turn counts in the router's load and, with its worst case, in the
        output room's from now on (before its admission exists: a turn routed or admitted
        meanwhile must see this rank busy and its room promised)."""
        self._running += num_tokens
        self._unowned_tokens += num_tokens
        self._worst += worst_blocks
        self._unowned_worst += worst_blocks

    def uncount_running(self, num_tokens: int, worst_blocks: int = 0) -> None:
        self._running -= num_tokens
        self._unowned_tokens -= num_tokens
        self._worst -= worst_blocks
        self._unowned_worst -= worst_blocks
        assert 0 <= self._unowned_tokens <= self._running, (self._unowned_tokens, self._running)
        assert 0 <= self._unowned_worst <= self._worst, (self._unowned_worst, self._worst)

    # ------------------------------------------------------------------ admissions

    def open(self, adm: Admission, reserved_blocks: int, running_tokens: int, worst_blocks: int) -> None:
        """``adm`` takes over a committed plan's ``reserved_blocks``, ``running_tokens`` and
        ``worst_blocks`` (all counted already)."""
        assert not adm.reserved_blocks and not adm.running_tokens and not adm.worst_blocks, adm
        self._unowned_blocks -= reserved_blocks
        self._unowned_tokens -= running_tokens
        self._unowned_worst -= worst_blocks
        assert self._unowned_blocks >= 0 and self._unowned_tokens >= 0 and self._unowned_worst >= 0, (
            f"an admission took over {reserved_blocks} blocks / {running_tokens} tokens / worst case "
            f"{worst_blocks} no plan held")
        adm.reserved_blocks = reserved_blocks
        adm.running_tokens = running_tokens
        adm.worst_blocks = worst_blocks
        self._open.add(adm)

    def restored(self, adm: Admission, num_blocks: int) -> None:
        """``num_blocks`` of ``adm``'s reservation were imported and filed in the index: they
        move from reserved to indexed."""
        assert 0 <= num_blocks <= adm.reserved_blocks, (num_blocks, adm.reserved_blocks)
        adm.reserved_blocks -= num_blocks
        self._reserved -= num_blocks

    def grow(self, adm: Admission, num_blocks: int, num_tokens: int = 0) -> None:
        """``adm`` may allocate ``num_blocks`` more and its context grew by ``num_tokens``
        (a reply's room, ``cache/output_room.py``; or the replayed block of a failed restore).
        The caller evicted what it could first; what the pool still lacks is overcommitted (the
        output room counts it: ``output_room_short_blocks_total``)."""
        assert num_blocks >= 0 and num_tokens >= 0, (num_blocks, num_tokens)
        adm.reserved_blocks += num_blocks
        adm.running_tokens += num_tokens
        self._reserved += num_blocks
        self._running += num_tokens

    def close(self, adm: Admission) -> None:
        """Give back everything ``adm`` holds on the rank."""
        self._reserved -= adm.reserved_blocks
        self._running -= adm.running_tokens
        self._worst -= adm.worst_blocks
        assert adm in self._open, f"close of an admission not open here: {adm}"
        self._open.remove(adm)
        assert min(self._reserved, self._running, self._worst) >= 0, (
            self._reserved, self._running, self._worst)

    def check(self, open_here: Iterable[Admission], quiet: bool) -> None:
        """Assert the sums (module docstring) against the rank's open admissions; ``quiet``: no
        plan or prefetch holds anything either (tests, after ``drain``)."""
        admissions = list(open_here)
        reserved = sum(a.reserved_blocks for a in admissions)
        running = sum(a.running_tokens for a in admissions)
        assert self._reserved == self._unowned_blocks + reserved, (
            f"reserved {self._reserved} != {self._unowned_blocks} unowned + {reserved} of open admissions")
        assert self._running == self._unowned_tokens + running, (
            f"running {self._running} != {self._unowned_tokens} unowned + {running} of open admissions")
        assert self._worst == self._unowned_worst + sum(a.worst_blocks for a in admissions)
        assert set(admissions) == self._open, (len(self._open), len(admissions))
        if quiet:
            assert self._unowned_blocks == 0 and self._unowned_tokens == 0 and self._unowned_worst == 0, (
                f"reserved {self._unowned_blocks} blocks / {self._unowned_tokens} tokens / worst case "
                f"{self._unowned_worst} with no admission")


def shared_blocks(chains: list[tuple[list[BlockHash], int]]) -> int:
    """How many of the blocks ``hashes[:n]`` of each ``(hashes, n)`` are another's too: the sum of
    the ``n`` less the blocks of their union.

    A chain hash names its block and every block before it, so two chains share exactly their
    common head, and that head is found by bisection. Inserted in sorted order, each prefix adds
    its ``n`` less its longest head in common with an earlier one; between sorted chains the
    common head of two is the least of the neighbours' heads between them, so the walk back stops
    once that least cannot beat what was found. No prefix is copied: this runs on every refused
    admission try, with open turns of 4,000 blocks each (copying 30 of them cost 1.5 ms)."""
    items = sorted((c for c in chains if c[1] > 0), key=lambda c: c[0])
    adjacent = [0] * len(items)  # adjacent[i]: the common head of items i - 1 and i (whole chains)
    for i in range(1, len(items)):
        adjacent[i] = common_prefix(items[i - 1][0], items[i][0])
    saved = 0
    for i in range(1, len(items)):
        best, head = 0, items[i][1]  # head: the common head with item j, capped at this n
        for j in range(i - 1, -1, -1):
            head = min(head, adjacent[j + 1])
            if head <= best:
                break
            best = max(best, min(head, items[j][1]))
        saved += best
    return saved
