"""``SimGroup``: a modelled lockstep rank group that implements the ``RankClient`` protocol.

The real ``cache.manager.CacheManager`` drives it exactly as it drives ``rank.group.RankGroup``:
``submit`` with prefix blocks, streams of ``RequestOutput``, ``release``, ``export_blocks`` and
``import_blocks`` into a host pool. Instead of computing, each group step sleeps (virtual time,
``vclock.py``) for the modelled duration of the slowest rank (``model.EngineModel``).

Block bookkeeping follows ``rank/engine.py``'s invariants: a block is free exactly when its
sequence refs + cache refs are 0; a finished request's first ``(prompt + output - 1) // bs``
blocks are handed to the cache (its seq refs become cache refs); ``release`` drops one cache ref;
``import_blocks`` allocates fresh blocks with one cache ref each or raises ``CapacityExhausted``
with nothing changed. ``check_accounting`` asserts all of it.

Scheduling per rank, as DeepInfer 0.1.0 does it (``docs/deepinfer.md``): FIFO admission with
head-of-line blocking (a head whose prompt blocks do not fit waits; ``pressure_hook`` may free
cache blocks first, which is how the seed's LRU eviction is modelled), at most ``max_num_seqs``
running, prefill chunks of at most ``max_num_batched_tokens`` per step, prefill and decode never
in the same step, prefill only at vote points while anything decodes, and, when decode growth
finds no free block, preemption of the running sequence with the longest output (recomputed later
from scratch, without its prefix).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from bench.simulator.model import Deployment, EngineModel
from rank.client import GroupState, RequestStream
from rank.engine import (
    CapacityExhausted,
    EngineMisuse,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestOutput,
)
from rank.vote_filler import MAX_STREAK as FILLER_MAX_STREAK


@dataclass(slots=True, eq=False)
class _Seq:
    request: EngineRequest
    stream: RequestStream
    prompt_len: int
    num_cached: int  # tokens served from prefix blocks (0 after a preemption)
    max_tokens: int
    blocks: list[int] = field(default_factory=list)
    admitted: bool = False
    computed: int = 0  # tokens with KV (prefill progress)
    target: int = 0  # tokens that need KV before the next token (prompt, + output after preemption)
    generated: float = 0.0  # output tokens so far (fractional: speculative decoding)
    emitted: int = 0  # output token ids already pushed
    output_ids: np.ndarray | None = None
    aborted: bool = False
    num_preemptions: int = 0
    tokens_per_step: float = 1.0  # this request's speculative acceptance (see EngineModel.accepted_tokens)


class _Rank:
    """One rank's blocks and queues. Invariant: ``free`` holds exactly the ids in 1..n-1 whose
    seq_refs + cache_refs == 0."""

    def __init__(self, rank: int, num_blocks: int) -> None:
        self.rank = rank
        self.num_blocks = num_blocks
        self.seq_refs = np.zeros(num_blocks, dtype=np.int32)
        self.cache_refs = np.zeros(num_blocks, dtype=np.int32)
        self.free: list[int] = list(range(num_blocks - 1, 0, -1))
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.in_step: list[_Seq] = []  # prompts completing in the prefill step now running
        self.num_cached_tokens_total = 0
        self.num_prompt_tokens_total = 0
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0

    def take(self, n: int) -> list[int]:
        assert n <= len(self.free)
        ids = self.free[-n:] if n else []
        del self.free[len(self.free) - n :]
        return ids

    def drop_seq_refs(self, ids: list[int]) -> None:
        for b in ids:
            self.seq_refs[b] -= 1
            assert self.seq_refs[b] >= 0
            if self.seq_refs[b] == 0 and self.cache_refs[b] == 0:
                self.free.append(b)

    def kv_tokens(self) -> int:
        return sum(s.prompt_len + int(s.generated) for s in self.running)


@dataclass(slots=True)
class EngineCounters:
    """Where the group's time went (``reset`` at the end of a warm-up): seconds in decode and
    prompt steps, and the decode-time integrals of the mean running sequences and KV tokens per
    rank (divide by ``decode_s`` for the time-weighted mean batch a decode step saw)."""

    decode_s: float = 0.0
    prefill_s: float = 0.0
    seq_s: float = 0.0
    kv_token_s: float = 0.0
    vote_points: int = 0  # vote points reached while something decodes
    votes_passed: int = 0  # ... that became a prompt step
    rank_votes_no_queue: int = 0  # rank x vote point: nothing waiting
    rank_votes_over_mark: int = 0  # rank x vote point: waiting, but KV usage over the watermark
    prefill_mean_s: float = 0.0  # what prompt steps would take at the ranks' mean, not their max
    decode_mean_s: float = 0.0  # the same for decode steps
    left_hol: int = 0  # sequences left waiting by a prompt step: a head that did not fit
    left_budget: int = 0  # ... by the step's token budget (or a chunked head)
    left_not_wanted: int = 0  # ... on a rank that did not take part (its vote was no)
    filler_votes: int = 0  # vote points that passed only because of the vote filler
    max_seq_s: float = 0.0  # decode-time integral of the largest rank's running sequences
    min_seq_s: float = 0.0
    transfer_stall_s: float = 0.0  # the group stood for copies at step boundaries (*_at_boundary)
    decode_steps: int = 0
    prefill_steps: int = 0

    def mean_running(self) -> float:
        return self.seq_s / self.decode_s if self.decode_s else 0.0

    def mean_kv_tokens(self) -> float:
        return self.kv_token_s / self.decode_s if self.decode_s else 0.0

    def summary(self) -> dict[str, float]:
        busy = self.decode_s + self.prefill_s
        return {"decode_s": round(self.decode_s, 1), "prefill_s": round(self.prefill_s, 1),
                "prefill_share": round(self.prefill_s / busy, 3) if busy else 0.0,
                "mean_running_per_rank": round(self.mean_running(), 2),
                "mean_kv_tokens_per_rank": round(self.mean_kv_tokens()),
                "vote_points": self.vote_points, "votes_passed": self.votes_passed,
                "rank_votes_no_queue": self.rank_votes_no_queue,
                "rank_votes_over_mark": self.rank_votes_over_mark,
                "left_hol": self.left_hol, "left_budget": self.left_budget,
                "left_not_wanted": self.left_not_wanted, "filler_votes": self.filler_votes,
                "max_running": round(self.max_seq_s / self.decode_s if self.decode_s else 0, 2),
                "min_running": round(self.min_seq_s / self.decode_s if self.decode_s else 0, 2),
                "prefill_mean_s": round(self.prefill_mean_s, 1),
                "decode_mean_s": round(self.decode_mean_s, 1),
                "transfer_stall_s": round(self.transfer_stall_s, 1),
                "decode_steps": self.decode_steps, "prefill_steps": self.prefill_steps}


class SimGroup:
    """See the module docstring. ``num_blocks`` etc. are the RankClient attributes."""

    def __init__(self, deployment: Deployment, model: EngineModel, seed: int = 0,
                 vote_filler: bool = False) -> None:
        self.deployment = deployment
        self.model = model
        self.num_ranks = deployment.num_ranks
        self.block_size = deployment.block_tokens
        self.num_blocks = deployment.num_blocks
        self.bytes_per_block = deployment.block_tokens * deployment.kv_bytes_per_token
        self.num_host_slots = deployment.num_host_slots
        self.prefix_cache_supported = True
        self.prefix_cache_reason: str | None = None
        self.epoch = 1
        self.state = GroupState.READY
        self.ranks = [_Rank(r, self.num_blocks) for r in range(self.num_ranks)]
        self.pressure_hook: Callable[[int, int], int] | None = None  # (rank, blocks) -> freed
        # Requests whose prefill costs nothing: each agent's very first turn, so a simulated step
        # starts from a warmed-up deployment instead of a cold start of every session at once.
        self.prewarmed_ids: set[str] = set()
        self.rng = np.random.default_rng(seed)
        self.num_steps = 0
        self.num_prefill_steps = 0
        self.counters = EngineCounters()
        self._listeners: list[Callable[[int], None]] = []
        self._wake = asyncio.Event()
        self._copy_locks = [asyncio.Lock() for _ in range(self.num_ranks)]
        self._decode_step = 0  # DeepInfer's decode_step: steps since the last prompt step
        self.vote_filler = vote_filler
        self._prompt_streak = 0  # prompt steps in a row (the filler's cap)
        self._task: asyncio.Task[None] | None = None
        # EngineModel.imports_at_boundary / exports_at_boundary / imports_wait_decode_step: the
        # steps in progress (start, length of one step, how many, whether a prompt step) and, per
        # step boundary within them, each rank's copy time.
        self._steps_at: tuple[float, float, int, bool] | None = None
        self._stalls: dict[int, list[float]] = {}

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="sim-group")

    async def close(self) -> None:
        self.state = GroupState.STOPPED
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def reset_counters(self) -> None:
        self.counters = EngineCounters()

    # ----------------------------------------------------------------- RankClient
    def submit(self, rank: int, request: EngineRequest) -> RequestStream:
        if not 0 <= rank < self.num_ranks:
            raise EngineMisuse(f"rank {rank} outside 0..{self.num_ranks - 1}")
        r = self.ranks[rank]
        prompt_len = len(request.prompt_ids)
        prefix = list(request.prefix_blocks)
        if request.num_cached_tokens != len(prefix) * self.block_size or (
            prefix and request.num_cached_tokens > prompt_len - 1
        ):
            raise EngineMisuse(f"bad prefix: {len(prefix)} blocks for {request.num_cached_tokens} cached "
                               "tokens")
        if len(set(prefix)) != len(prefix) or any(
            not 0 < b < self.num_blocks or r.seq_refs[b] + r.cache_refs[b] <= 0 for b in prefix
        ):
            raise EngineMisuse("prefix blocks must be distinct, in range and held")
        stream = RequestStream(request.request_id, rank, self.epoch,
                               lambda: self.abort(rank, request.request_id))
        for b in prefix:
            r.seq_refs[b] += 1
        seq = _Seq(
            request=request,
            stream=stream,
            prompt_len=prompt_len,
            num_cached=request.num_cached_tokens,
            max_tokens=max(1, request.sampling.max_tokens),
            blocks=prefix,
            computed=request.num_cached_tokens,
            target=prompt_len,
            tokens_per_step=self.model.accepted_tokens(self.rng),
        )
        r.waiting.append(seq)
        r.num_prompt_tokens_total += prompt_len
        self._wake.set()
        return stream

    def abort(self, rank: int, request_id: str) -> None:
        r = self.ranks[rank]
        for seq in list(r.waiting) + r.running:
            if seq.request.request_id == request_id:
                seq.aborted = True
        self._wake.set()

    async def release(self, rank: int, block_ids: list[int]) -> None:
        r = self.ranks[rank]
        if any(not 0 < b < self.num_blocks or r.cache_refs[b] <= 0 for b in block_ids):
            raise EngineMisuse("release of a block the cache does not hold")
        for b in block_ids:
            r.cache_refs[b] -= 1
            if r.cache_refs[b] == 0 and r.seq_refs[b] == 0:
                r.free.append(b)
        self._wake.set()

    def _copy_s(self, num_blocks: int) -> float:
        return num_blocks * self.block_size / self.deployment.restore_tokens_per_s

    async def _copy(self, rank: int, num_blocks: int, at_boundary: bool, fenced: bool = False) -> None:
        """A transfer's copy: beside the step, or (``at_boundary``: ``EngineModel.imports_at_boundary``
        / ``exports_at_boundary``) at the rank's next step boundary, where it stalls the group:
        lockstep waits for the slowest rank there. ``fenced`` (``imports_wait_decode_step``): beside
        the step, after the decode (or placeholder) step in progress ends; at once in a prompt step."""
        copy_s = self._copy_s(num_blocks)
        nxt = self._next_boundary()
        in_prompt_step = self._steps_at is not None and self._steps_at[3]
        if at_boundary and nxt is not None:
            boundary, wait = nxt
            self._stalls.setdefault(boundary, [0.0] * self.num_ranks)[rank] += copy_s
            await asyncio.sleep(wait)
        elif fenced and nxt is not None and nxt[0] > 0 and not in_prompt_step:
            await asyncio.sleep(nxt[1])  # the GPU's decode step in progress ends there
        async with self._copy_locks[rank]:
            await asyncio.sleep(copy_s)

    def _next_boundary(self) -> tuple[int, float] | None:
        """The steps in progress: the index of the next step boundary within them and the time
        until it; (0, 0.0) while the group stands at a boundary (a stall); None between them."""
        if self._steps_at is None:
            return None
        start, step_s, steps, _ = self._steps_at
        if steps == 0:
            return 0, 0.0
        elapsed = asyncio.get_running_loop().time() - start
        if elapsed >= steps * step_s:
            return None
        boundary = int(elapsed // step_s) + 1  # steps in progress end at boundary * step_s
        return boundary, boundary * step_s - elapsed

    async def _steps(self, step_s: float, steps: int, prompt: bool = False) -> float:
        """Sleep through ``steps`` lockstep steps of ``step_s`` each, plus the stalls of the
        transfers that came to their boundaries (``_copy``); returns the stall time."""
        self._steps_at = (asyncio.get_running_loop().time(), step_s, steps, prompt)
        await asyncio.sleep(step_s * steps)
        stalled = 0.0
        while self._stalls:  # transfers during a stall wait for the boundary after it
            stalls, self._stalls = self._stalls, {}
            self._steps_at = (asyncio.get_running_loop().time(), 0.0, 0, False)
            wait = sum(max(s) for s in stalls.values())
            stalled += wait
            await asyncio.sleep(wait)
        self._steps_at = None
        self.counters.transfer_stall_s += stalled
        return stalled

    async def export_blocks(self, rank: int, block_ids: list[int], host_slot: int) -> None:
        r = self.ranks[rank]
        if host_slot < 0 or host_slot + len(block_ids) > self.num_host_slots:
            raise EngineMisuse("host slots out of range")
        if any(r.cache_refs[b] + r.seq_refs[b] <= 0 for b in block_ids):
            raise EngineMisuse("export of a free block")
        await self._copy(rank, len(block_ids), self.model.exports_at_boundary)

    async def import_blocks(self, rank: int, host_slot: int, num_blocks: int) -> list[int]:
        r = self.ranks[rank]
        if host_slot < 0 or host_slot + num_blocks > self.num_host_slots:
            raise EngineMisuse("host slots out of range")
        if num_blocks > len(r.free):
            raise CapacityExhausted(f"rank {rank}: {num_blocks} blocks wanted, {len(r.free)} free")
        ids = r.take(num_blocks)
        for b in ids:
            r.cache_refs[b] += 1
        m = self.model
        await self._copy(rank, num_blocks, m.imports_at_boundary, m.imports_wait_decode_step)
        return ids

    def stats(self, rank: int) -> EngineStats:
        r = self.ranks[rank]
        return EngineStats(
            num_blocks=self.num_blocks,
            num_free_blocks=len(r.free),
            num_cached_blocks=int(np.count_nonzero(r.cache_refs)),
            num_running=len(r.running),
            num_waiting=len(r.waiting),
            running_tokens=r.kv_tokens(),
            waiting_tokens=sum(s.target - s.computed for s in r.waiting),
            num_cached_tokens_total=r.num_cached_tokens_total,
            num_prompt_tokens_total=r.num_prompt_tokens_total,
        )

    def unpin_waiting(self, rank: int, block_ids: list[int]) -> bool:
        """The seed's L0 wants to drop cache blocks that queued (not yet admitted) sequences start
        from. If no admitted or running sequence uses them, those queued sequences lose their
        prefix (they will prefill it again) and True is returned; the caller then releases."""
        r = self.ranks[rank]
        wanted = set(block_ids)
        for seq in r.running + r.in_step:
            if not wanted.isdisjoint(seq.blocks):
                return False
        for i, seq in enumerate(r.waiting):
            if (seq.admitted or i == 0) and not wanted.isdisjoint(seq.blocks):
                return False  # admitted, or the head being admitted now
        stripped = False
        for seq in r.waiting:
            if seq.blocks and not wanted.isdisjoint(seq.blocks):
                r.drop_seq_refs(seq.blocks)
                seq.blocks = []
                seq.num_cached = 0
                seq.computed = 0
                stripped = True
        return stripped  # False also when the user is between engine and cache (finishing)

    def add_restart_listener(self, fn: Callable[[int], None]) -> None:
        self._listeners.append(fn)

    def check_accounting(self) -> None:
        for r in self.ranks:
            refs = np.zeros(self.num_blocks, dtype=np.int64)
            for seq in list(r.waiting) + r.running:
                for b in seq.blocks:
                    refs[b] += 1
            assert np.array_equal(refs, r.seq_refs), f"rank {r.rank}: sequence refs out of sync"
            assert (r.cache_refs >= 0).all() and r.seq_refs[0] == 0 and r.cache_refs[0] == 0
            held = (r.seq_refs + r.cache_refs) > 0
            free = set(r.free)
            assert len(free) == len(r.free), f"rank {r.rank}: a block is on the free list twice"
            assert free == {b
                            for b in range(1, self.num_blocks)
                            if not held[b]}, f"rank {r.rank}: free list wrong"

    # ----------------------------------------------------------------- stepping
    def _usage(self, r: _Rank) -> float:
        """DeepInfer's KV usage: every non-free block counts (cached and pinned ones too)."""
        return 1.0 - len(r.free) / max(1, self.num_blocks - 1)

    def _head_need(self, r: _Rank, seq: _Seq) -> int:
        return -(-seq.target // self.block_size) - len(seq.blocks)

    def _wants_prefill(self, r: _Rank) -> bool:
        """DeepInfer's vote (scheduler.hpp ``_schedule``): KV usage <= the watermark and a waiting
        head (``_has_prefill_waiting``); whether the head's blocks can be allocated is not part of
        the vote (``_schedule_prefill`` finds out, and a second vote turns a prompt step in which
        no rank scheduled anything into a decode step). The ``pressure_hook`` (the seed's L0) may
        evict idle cache blocks first to get under the watermark and make room for the head."""
        if not r.waiting:
            return False
        head = r.waiting[0]
        need = 0 if head.admitted else self._head_need(r, head)
        if self.pressure_hook is not None:
            floor = math.ceil((1.0 - self.model.kv_watermark) * (self.num_blocks - 1))
            short = max(need - len(r.free), floor - len(r.free))
            if short > 0:
                self.pressure_hook(r.rank, short)
        if head.admitted:
            # A chunked prompt that already holds all its blocks goes on above the watermark
            # (read strictly, the vote would stall it for good once waiting prefixes fill the pool).
            return True
        return self._usage(r) <= self.model.kv_watermark + 1e-12

    def _try_admit(self, r: _Rank, seq: _Seq) -> bool:
        if len(r.running) + sum(1 for s in r.waiting if s.admitted) >= self.model.max_num_seqs:
            return False
        need = self._head_need(r, seq)
        if need > len(r.free) and self.pressure_hook is not None:
            self.pressure_hook(r.rank, need - len(r.free))
        if need > len(r.free):
            return False
        new = r.take(need)
        for b in new:
            r.seq_refs[b] += 1
        seq.blocks.extend(new)
        seq.admitted = True
        return True

    def _reap_aborted(self, r: _Rank) -> None:
        for seq in [s for s in r.waiting if s.aborted]:
            r.waiting.remove(seq)
            self._end(r, seq, FinishReason.ABORT, keep=False)
        for seq in [s for s in r.running if s.aborted]:
            r.running.remove(seq)
            self._end(r, seq, FinishReason.ABORT, keep=False)

    def _prefill_rank(self, r: _Rank, wants: bool) -> tuple[float, list[_Seq]]:
        """One prefill step on one rank: (duration, sequences whose prompt completed). At most
        one sequence needs more than this step (DeepInfer NORMAL: one chunked seq per step)."""
        if not wants:
            return 0.0, []
        budget = self.model.max_num_batched_tokens
        duration = 0.0
        done: list[_Seq] = []
        for seq in list(r.waiting):
            if not seq.admitted and -(-seq.target // self.block_size) > self.num_blocks - 1:
                r.waiting.remove(seq)  # can_allocate NEVER: DeepInfer ignores the prompt
                self._end(r, seq, FinishReason.ERROR, keep=False, error="prompt exceeds the KV pool")
                continue
            if not seq.admitted and not self._try_admit(r, seq):
                break  # FIFO head-of-line blocking
            if seq.request.request_id in self.prewarmed_ids:  # see ``prewarmed_ids``
                self.prewarmed_ids.discard(seq.request.request_id)
                seq.computed = seq.target
                r.waiting.remove(seq)
                done.append(seq)
                continue
            if budget <= 0:
                break
            chunk = min(budget, seq.target - seq.computed)
            duration += self.model.prefill_s(chunk, seq.computed)
            seq.computed += chunk
            budget -= chunk
            if seq.computed >= seq.target:
                r.waiting.remove(seq)
                done.append(seq)
            else:
                break  # a chunked sequence ends the batch
        if duration > 0:
            duration += self.model.prompt_step_overhead_s
        return duration, done

    def _head_can_start(self, r: _Rank) -> bool:
        """Whether the head of a rank that wants a prompt step would be scheduled now (the
        filler's guard: a step of fillers alone would reset ``decode_step`` and loop)."""
        head = r.waiting[0]
        if head.admitted:
            return True
        in_flight = len(r.running) + sum(1 for s in r.waiting if s.admitted)
        return in_flight < self.model.max_num_seqs and self._head_need(r, head) <= len(r.free)

    def _filler_ok(self, wants: list[bool]) -> bool:
        """The vote filler turns this ALL point's vote into yes (module docstring)."""
        if not self.vote_filler or self._prompt_streak >= FILLER_MAX_STREAK:
            return False
        mark = self.model.kv_watermark + 1e-12
        return (any(w and self._head_can_start(r) for w, r in zip(wants, self.ranks))
                and all(w or (not r.waiting and self._usage(r) <= mark) for w, r in zip(wants, self.ranks)))

    def _count_vote(self, wants: list[bool]) -> None:
        c = self.counters
        c.vote_points += 1
        for r, w in zip(self.ranks, wants):
            if not w:
                if r.waiting:
                    c.rank_votes_over_mark += 1
                else:
                    c.rank_votes_no_queue += 1

    def _vote_passes(self, wants: list[bool]) -> bool:
        """DeepInfer's step-type vote at ``decode_step`` (0 right after a prompt step): "ALL"
        points every ``prefill_all_interval_steps`` need every rank to want a prefill, "ANY"
        points every ``prefill_any_interval_steps`` (not 0) need one rank. With the vote filler,
        an ALL point also passes when ``_filler_ok``."""
        d, m = self._decode_step, self.model
        if d % m.prefill_all_interval_steps == 0 and all(wants):
            return True
        if d != 0 and d % m.prefill_any_interval_steps == 0:
            return any(wants)
        if d % m.prefill_all_interval_steps == 0 and self._filler_ok(wants):
            self.counters.filler_votes += 1
            return True
        return False

    def _steps_to_next_vote(self, all_want: bool) -> int:
        """Decode (or placeholder) steps from now to the next vote point that can pass."""
        d, m = self._decode_step, self.model
        any_at = (d // m.prefill_any_interval_steps + 1) * m.prefill_any_interval_steps
        if d != 0 and d % m.prefill_any_interval_steps == 0:
            any_at = d
        best = any_at
        if all_want:
            best = min(best, -(-d // m.prefill_all_interval_steps) * m.prefill_all_interval_steps)
        return best - d

    def _is_vote_point(self) -> bool:
        d, m = self._decode_step, self.model
        return d % m.prefill_all_interval_steps == 0 or d % m.prefill_any_interval_steps == 0

    async def _run(self) -> None:
        while True:
            for r in self.ranks:
                self._reap_aborted(r)
            if any(r.running for r in self.ranks):
                if self._is_vote_point():
                    wants = [self._wants_prefill(r) for r in self.ranks]
                    self._count_vote(wants)
                    if self._vote_passes(wants) and await self._prefill_step(wants):
                        self.counters.votes_passed += 1
                        continue
                await self._decode_segment()
                continue
            wants = [self._wants_prefill(r) for r in self.ranks]
            if not any(wants):
                self._wake.clear()
                await self._wake.wait()
                continue
            # Nothing decodes: the group runs placeholder steps up to the next passing vote.
            k = self._steps_to_next_vote(all(wants) or self._filler_ok(wants))
            if k:
                await self._steps(self.model.placeholder_step_s, k)
                self._prompt_streak = 0
                self._decode_step += k
                self.num_steps += k
                continue
            if not await self._prefill_step(wants):
                self._wake.clear()  # the vote passed but no head fits: wait for blocks to come free
                await self._wake.wait()

    async def _prefill_step(self, wants: list[bool]) -> bool:
        """One prompt step of the group; False (and nothing done) when no rank scheduled a
        prompt: DeepInfer's second vote then makes the step a decode step."""
        results = [self._prefill_rank(r, w) for r, w in zip(self.ranks, wants)]
        if not any(d > 0 or done for d, done in results):
            return False
        for r, w in zip(self.ranks, wants):
            if not w:
                self.counters.left_not_wanted += len(r.waiting)
            elif r.waiting:
                head = r.waiting[0]
                if not head.admitted:
                    self.counters.left_hol += len(r.waiting)
                else:
                    self.counters.left_budget += len(r.waiting)
        for r, (_d, done) in zip(self.ranks, results):
            r.in_step = done  # neither waiting nor running while the step runs
        step_s = max(self.model.placeholder_step_s, max(d for d, _ in results))
        self.counters.prefill_mean_s += max(self.model.placeholder_step_s,
                                            sum(d for d, _ in results) / len(results))
        await self._steps(step_s, 1, prompt=True)
        self.counters.prefill_s += step_s
        self.counters.prefill_steps += 1
        for r in self.ranks:
            r.in_step = []
        self.num_steps += 1
        self.num_prefill_steps += 1
        self._prompt_streak += 1
        self._decode_step = 0
        for r, (_d, done) in zip(self.ranks, results):
            for seq in done:
                if seq.aborted:
                    self._end(r, seq, FinishReason.ABORT, keep=False)
                    continue
                if seq.output_ids is None:
                    seq.output_ids = self.rng.integers(1000, 120_000, seq.max_tokens, dtype=np.int32)
                    r.num_cached_tokens_total += seq.num_cached
                    seq.generated = 1.0
                    seq.emitted = 1
                    seq.stream.push(RequestOutput(seq.request.request_id, [int(seq.output_ids[0])],
                                                  num_prompt_tokens=seq.prompt_len,
                                                  num_cached_tokens=seq.num_cached))
                r.running.append(seq)
                if seq.generated >= seq.max_tokens:
                    r.running.remove(seq)
                    self._end(r, seq, FinishReason.LENGTH, keep=seq.request.keep_blocks)
        return True

    async def _decode_segment(self) -> None:
        """Decode steps up to the next vote point or the first sequence to finish."""
        m = self.model
        d = self._decode_step
        next_vote = min((d // m.prefill_all_interval_steps + 1) * m.prefill_all_interval_steps,
                        (d // m.prefill_any_interval_steps + 1) * m.prefill_any_interval_steps)
        steps: float = next_vote - d
        for r in self.ranks:
            for seq in r.running:
                steps = min(steps, math.ceil((seq.max_tokens - seq.generated) / seq.tokens_per_step))
        steps = max(1, int(steps))
        running = [len(r.running) for r in self.ranks]
        kv_tokens = [r.kv_tokens() for r in self.ranks]
        rank_step_s = [self.model.decode_step_s(n, kv) for n, kv in zip(running, kv_tokens)]
        step_s = max(rank_step_s)  # lockstep: the slowest rank
        c, dt = self.counters, steps * step_s
        c.decode_mean_s += steps * sum(rank_step_s) / self.num_ranks
        c.decode_s += dt
        c.decode_steps += steps
        c.seq_s += dt * sum(running) / self.num_ranks
        c.max_seq_s += dt * max(running)
        c.min_seq_s += dt * min(running)
        c.kv_token_s += dt * sum(kv_tokens) / self.num_ranks
        await self._steps(step_s, steps)
        self.num_steps += steps
        self._prompt_streak = 0
        self._decode_step += steps
        for r in self.ranks:
            finished = []
            for seq in sorted(r.running, key=lambda s: -s.generated):
                if seq not in r.running:
                    continue  # failed by a preemption in this loop
                seq.generated = min(seq.max_tokens, seq.generated + steps * seq.tokens_per_step)
                if not self._grow(r, seq):
                    continue
                n = int(seq.generated)
                if n > seq.emitted and n < seq.max_tokens:
                    assert seq.output_ids is not None
                    seq.stream.push(RequestOutput(seq.request.request_id,
                                                  seq.output_ids[seq.emitted:n].tolist()))
                    seq.emitted = n
                if seq.generated >= seq.max_tokens:
                    finished.append(seq)
            for seq in finished:
                if seq in r.running:
                    r.running.remove(seq)
                    self._end(r, seq, FinishReason.LENGTH, keep=seq.request.keep_blocks)

    def _grow(self, r: _Rank, seq: _Seq) -> bool:
        """Blocks for the tokens generated so far; preempts (longest output first) when out."""
        need = -(-(seq.prompt_len + int(seq.generated)) // self.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        if need > len(r.free) and self.pressure_hook is not None:
            self.pressure_hook(r.rank, need - len(r.free))
        while need > len(r.free):
            victim = max((s for s in r.running if s.blocks), key=lambda s: s.generated, default=None)
            if victim is None:
                break
            self._preempt(r, victim)
            if victim is seq:
                return False
        if need > len(r.free):
            self._preempt(r, seq)
            return False
        new = r.take(need)
        for b in new:
            r.seq_refs[b] += 1
        seq.blocks.extend(new)
        return True

    def _preempt(self, r: _Rank, seq: _Seq) -> None:
        """Out of blocks in decode. DeepInfer's default (``stop_preempted_request``) finishes the
        sequence with "insufficient_system_resource"; otherwise it is recomputed from scratch."""
        r.running.remove(seq)
        seq.num_preemptions += 1
        r.num_preemptions += 1
        if self.model.stop_preempted_request:
            self._end(r, seq, FinishReason.ERROR, keep=False)
            return
        r.drop_seq_refs(seq.blocks)
        seq.blocks = []
        seq.admitted = False
        seq.target = seq.prompt_len + int(seq.generated)
        seq.computed = 0
        r.num_recomputed_tokens += seq.target
        r.waiting.appendleft(seq)

    def _end(self, r: _Rank, seq: _Seq, reason: FinishReason, keep: bool,
             error: str = "insufficient_system_resource") -> None:
        failed = reason in (FinishReason.ABORT, FinishReason.ERROR)
        num_out = seq.emitted if failed else seq.max_tokens
        kept: list[int] = []
        if keep and not failed:
            n_kept = min(len(seq.blocks), (seq.prompt_len + num_out - 1) // self.block_size)
            kept = seq.blocks[:n_kept]
            for b in kept:
                r.seq_refs[b] -= 1
                r.cache_refs[b] += 1
            r.drop_seq_refs(seq.blocks[n_kept:])
        else:
            r.drop_seq_refs(seq.blocks)
        seq.blocks = []
        rest: list[int] = []
        if seq.output_ids is not None and not failed:
            rest = seq.output_ids[seq.emitted : seq.max_tokens].tolist()
        seq.stream.push(
            RequestOutput(seq.request.request_id, rest, finished=True, finish_reason=reason,
                          num_prompt_tokens=seq.prompt_len, num_cached_tokens=seq.num_cached,
                          kept_blocks=kept,
                          error=error if reason == FinishReason.ERROR else None)
        )
        self._wake.set()
