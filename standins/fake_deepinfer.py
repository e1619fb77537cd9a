"""A stand-in for the part of DeepInfer 0.1.0's Python API that ``rank/deepinfer_adapter.py`` uses.

CI cannot run DeepInfer (its kernels need B200 GPUs), so the adapter is tested against this
module. It follows the engine's documented semantics (the ``deepinfer==0.1.0`` sdist, ``docs/deepinfer.md``
sections 2, 4 and 6; the C++ in ``csrc/engine/{scheduler,block_manager,sequence}.hpp``) and it
FAILS ON MISUSE where the engine would (with ``RuntimeError``, which is what pybind turns a
failed ``TORCH_CHECK`` into), so a careless adapter is caught here rather than on a GPU node:

* ``BlockManager``: ref-counted blocks, a FIFO free list, block 0 never handed out; pinning a
  free or out-of-range block raises (and, like the C++ loop, leaves the blocks before it pinned);
  unpinning a free block raises and marks the manager corrupted (the C++ goes to ref -1).
* State slots come from a second ``BlockManager``; slot 0 is reserved the same way.
* ``Scheduler``: FIFO admission with head-of-line blocking, whole-prompt allocation plus one
  state slot, chunked prefill (one chunked sequence per step), prefill only at vote points
  (``decode_step % prefill_attempt_interval == 0``), prefill and decode never share a step,
  decode appends one block at a time, ``abort_sequence`` only marks ``FINISHED_ABORTED``.
  A waiting sequence that was aborted becomes an *ignored* output (``finish_reason="abort"``,
  ``token_id`` = its last prompt token); an aborted running one emits nothing.
* ``FakeLLMEngine``: zero-overhead scheduling (ZOS) as in ``worker.py``: decode outputs come back
  one ``step()`` late, a finished sequence runs one extra discarded decode step, it is freed in
  the step after its terminal output (``finalize_seq`` from ``pre_sampler_sync``), and the
  outputs of a ``step()`` are recycled by the next one: reading them afterwards raises.
* The prefix-cache patch (``patched=True``): ``Scheduler.add_sequence_with_prefix`` validating
  everything before touching state, ``Sequence.block_table`` (read-only), ``BlockManager.num_blocks``,
  cached tokens counted per step, and aborted waiting sequences releasing their blocks and state.
  With ``patched=False`` those attributes do not exist and aborted waiting sequences leak what
  they held, as upstream 0.1.0 does.

The "model" writes each computed position's token id into the KV pool rows through the block
table and derives the next token from what it reads back from the pool, so a wrong prefix
block or a bad host-tier restore changes the generated tokens, as it would on the GPU.

``FakeLLMEngine`` can also drive DeepInfer's *real* ``deepinfer._C`` classes (``core=`` the
extension's ``engine`` module): see ``tests/deepinfer/test_deepinfer_native.py``.
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence as Seq
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import torch

BLOCK_SIZE = 128
PLACEHOLDER_REQUEST_ID = "placeholder"


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6
    FINISHED_PREEMPTED = 7
    FINISHED_SO_FAILED = 8
    FINISHED_VE_FAILED = 9


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "prompt_length_exceeded",
    SequenceStatus.FINISHED_PREEMPTED: "insufficient_system_resource",
}


def _check(cond: bool, *msg: object) -> None:
    """TORCH_CHECK: pybind surfaces a failed check as RuntimeError."""
    if not cond:
        raise RuntimeError(" ".join(str(m) for m in msg) or "check failed")


# ---------------------------------------------------------------------------- blocks


class BlockManager:
    """Ref-counted ids ``1..n-1`` and a FIFO free list (allocate pops the head, free appends)."""

    def __init__(self, num_blocks: int) -> None:
        _check(num_blocks > 1, "GPU blocks too few:", num_blocks)
        self._num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._free_list: deque[int] = deque(range(1, num_blocks))
        self._mutex = threading.Lock()
        self._owner: int | None = None
        self.corrupted = False

    # Like the C++ error-checking mutex (csrc/utils/lockable.hpp): taking it twice on one thread
    # raises; another thread (the rank's transfer thread) waits for it, up to 20 s, then raises;
    # unlocking a mutex this thread does not hold raises.
    LOCK_TIMEOUT_S = 20.0

    def lock(self) -> None:
        _check(self._owner != threading.get_ident(), "failed to lock mutex: Resource deadlock avoided")
        _check(self._mutex.acquire(timeout=self.LOCK_TIMEOUT_S), "failed to lock mutex: Connection timed out")
        self._owner = threading.get_ident()

    def unlock(self) -> None:
        _check(self._owner == threading.get_ident(), "failed to unlock mutex: Operation not permitted")
        self._owner = None
        self._mutex.release()

    def get_num_free_blocks(self) -> int:
        return len(self._free_list)

    def can_allocate_nolock(self, num_blocks: int) -> str:
        if num_blocks >= self._num_blocks:
            return "NEVER"
        return "OK" if len(self._free_list) >= num_blocks else "LATER"

    def allocate_nolock(self, num_blocks: int) -> list[int]:
        out = []
        for _ in range(num_blocks):  # like the C++: throws part-way when the list runs dry
            _check(bool(self._free_list), "list is empty, but pop_front is called")
            block_id = self._free_list.popleft()
            self._refs[block_id] = 1
            out.append(block_id)
        return out

    def _pin(self, block_id: int) -> None:
        _check(0 < block_id < self._num_blocks, "block id out of range:", block_id)
        _check(self._refs[block_id] > 0, "try to pin free block", block_id)
        self._refs[block_id] += 1

    def _free(self, block_id: int) -> None:
        _check(0 < block_id < self._num_blocks, "block id out of range:", block_id)
        self._refs[block_id] -= 1
        if self._refs[block_id] < 0:
            self.corrupted = True
            raise RuntimeError(f"ref_count corrupted: ref_count < 0 (block {block_id})")
        if self._refs[block_id] == 0:
            self._free_list.append(block_id)

    def pin_blocks_nolock(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            self._pin(int(block_id))

    def free_blocks_nolock(self, block_ids: Iterable[int]) -> None:
        for block_id in reversed([int(b) for b in block_ids]):
            self._free(block_id)

    # The locking variants take the mutex without RAII, like the C++: when the loop throws, the
    # mutex stays locked and the engine's next schedule() fails ("Resource deadlock avoided").
    def pin_blocks(self, block_ids: Iterable[int]) -> None:
        self.lock()
        self.pin_blocks_nolock(block_ids)
        self.unlock()

    def pin_block(self, block_id: int) -> None:
        self.pin_blocks([block_id])

    def unpin_blocks(self, block_ids: Iterable[int]) -> None:
        self.lock()
        self.free_blocks_nolock(block_ids)
        self.unlock()

    free_blocks = unpin_blocks

    def reset(self) -> None:
        _check(len(self._free_list) == self._num_blocks - 1, "still some blocks in use when reset")

    def ref_count(self, block_id: int) -> int:
        """Fake-only: lets tests check per-block counts (the C++ exposes no such call)."""
        return self._refs[block_id]


class PatchedBlockManager(BlockManager):
    @property
    def num_blocks(self) -> int:
        return self._num_blocks


# ---------------------------------------------------------------------------- sequences


class Sequence:
    """One request inside the engine (``sequence.hpp``); ``block_table`` only with the patch."""

    def __init__(self, seq_id: int, prompt_token_ids: np.ndarray, request_id: str, sampling_params: Any,
                 block_size: int = BLOCK_SIZE) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.block_size = block_size
        self._tokens = [int(t) for t in prompt_token_ids]
        self._prompt_len = len(self._tokens)
        self.status = SequenceStatus.WAITING
        self.num_cached_tokens = 0
        self.cached_hit_tokens = 0
        self.swa_valid_start = 0
        self.state_id = -1
        self._table: list[int] = []
        self.chunked_rest_len = 0
        self.prefix_pending = False  # admitted from a prefix but tail/state not yet allocated
        self.inflight_steps = 0  # scheduled steps whose outputs are not processed yet (ZOS)
        self.arrival_time = 0.0
        self.data = SimpleNamespace(get_token_ids=lambda: list(self._tokens))

    def get_len(self) -> int:
        return len(self._tokens)

    def get_prompt_len(self) -> int:
        return self._prompt_len

    def get_output_len(self) -> int:
        return len(self._tokens) - self._prompt_len

    def token_ids(self) -> list[int]:
        return self._tokens

    def is_finished(self) -> bool:
        return self.status >= SequenceStatus.FINISHED_STOPPED

    def num_blocks_needed(self) -> int:
        return (self.get_len() + self.block_size - 1) // self.block_size


class PatchedSequence(Sequence):
    @property
    def block_table(self) -> list[int]:
        return list(self._table)


# ---------------------------------------------------------------------------- scheduler


@dataclass(slots=True)
class SchedulerOutputs:
    scheduled_seqs: list[Sequence]
    prompt_run: bool
    num_batched_tokens: int
    finished_seqs: list[Sequence]
    ignored_seqs: list[Sequence]
    seqlens_q: list[int]
    num_cached_tokens_gpu: int
    zero_states: list[int]

    def is_empty(self) -> bool:
        return not self.scheduled_seqs


@dataclass(slots=True)
class SequenceMetadata:
    request_id: str
    is_prompt: bool
    seqlen_q: int
    seqlen_k: int
    full_len: int

    @property
    def is_last_prompt_chunk(self) -> bool:
        return self.is_prompt and self.seqlen_k >= self.full_len


class SequenceMetadataPool:
    def release(self, unused: list[SequenceMetadata]) -> None:
        del unused


class Scheduler:
    """The C++ scheduler's behaviour at one data-parallel rank (votes are local here)."""

    def __init__(self, block_size: int, block_manager: BlockManager, state_manager: BlockManager | None,
                 eos_token_id: int, dp_group: Any, scheduler_config: Any, *_: Any) -> None:
        self.block_size = block_size
        self.block_manager = block_manager
        self.state_manager = state_manager
        self.eos_token_id = eos_token_id
        cfg = scheduler_config
        self.max_model_len = cfg.max_model_len
        self.max_num_batched_tokens = cfg.max_num_batched_tokens
        self.max_num_seqs = cfg.max_num_seqs
        self.chunked_prefill = cfg.chunked_prefill
        self.prefill_attempt_interval = cfg.prefill_attempt_interval
        self.prompt_limit = self.max_model_len if self.chunked_prefill else min(
            self.max_model_len, self.max_num_batched_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.decode_step = 0
        self.num_aborted = 0

    # -- queue
    def add_sequence(self, seq: Sequence) -> None:
        seq.arrival_time = time.monotonic()
        self.waiting.append(seq)

    def abort_sequence(self, request_ids: list[str]) -> list[Sequence]:
        out = []
        for rid in request_ids:
            for seq in itertools.chain(self.running, self.waiting):
                if seq.request_id == rid and not seq.is_finished():
                    seq.status = SequenceStatus.FINISHED_ABORTED
                    self.num_aborted += 1
                    out.append(seq)
        return out

    def has_unfinished_seqs(self) -> bool:
        return self.get_num_unfinished_seqs() > 0

    def get_num_unfinished_seqs(self) -> int:
        return len(self.waiting) + len(self.running)

    def get_num_free_gpu_blocks(self) -> int:
        return self.block_manager.get_num_free_blocks()

    def get_sum_prompt_len_running(self) -> tuple[int, int]:
        return len(self.running), sum(s.get_prompt_len() for s in self.running)

    def get_sum_prompt_len_waiting(self) -> tuple[int, int]:
        return len(self.waiting), sum(s.get_prompt_len() for s in self.waiting)

    def get_num_aborted_seqs(self) -> int:
        return self.num_aborted

    # -- resources
    def _release_ignored(self, seq: Sequence) -> None:
        """Upstream leaves an ignored sequence's blocks and state allocated (a leak)."""
        del seq

    def free_seq(self, seq: Sequence) -> None:
        self.block_manager.lock()
        try:
            self._free_seq_nolock(seq)
        finally:
            self.block_manager.unlock()

    def _free_seq_nolock(self, seq: Sequence) -> None:
        if seq.state_id != -1 and self.state_manager is not None:
            self.state_manager.free_blocks_nolock([seq.state_id])
        self.block_manager.free_blocks_nolock(seq._table)
        seq._table = []

    def _can_allocate_with_state(self, num_blocks: int) -> str:
        status = self.block_manager.can_allocate_nolock(num_blocks)
        if status == "OK" and self.state_manager is not None and \
                self.state_manager.can_allocate_nolock(1) == "LATER":
            status = "LATER"
        return status

    # -- scheduling
    def schedule(self, pool: SequenceMetadataPool) -> tuple[list[SequenceMetadata], SchedulerOutputs]:
        # The C++ holds the block manager's mutex through the whole schedule
        # (BlockManagerMutexAcquire): allocations, frees and the free counts it reads.
        self.block_manager.lock()
        try:
            out = None
            if self.decode_step % self.prefill_attempt_interval == 0 and self.waiting:
                out = self._schedule_prefill()
            if out is None:
                out = self._schedule_decode()
        finally:
            self.block_manager.unlock()
        if out.prompt_run:
            self.decode_step = 0
        else:
            self.running = list(out.scheduled_seqs)
            self.decode_step += 1
        metas = []
        for seq, q in zip(out.scheduled_seqs, out.seqlens_q):
            k = seq.num_cached_tokens + seq.inflight_steps + q
            metas.append(SequenceMetadata(seq.request_id, out.prompt_run, q, k, seq.get_len()))
            seq.inflight_steps += 1
        return metas, out

    def _admit_prefix(self, seq: Sequence, zero_states: list[int]) -> None:
        """Hook for the prefix-cache patch (allocates the tail and a zeroed state slot)."""
        raise AssertionError("unpatched scheduler has no prefix sequences")

    def _schedule_prefill(self) -> SchedulerOutputs | None:
        scheduled: list[Sequence] = []
        seqlens: list[int] = []
        ignored: list[Sequence] = []
        zero_states: list[int] = []
        num_batched = 0
        num_cached_gpu = 0
        num_seqs = len(self.running)
        while self.waiting:
            seq = self.waiting[0]
            if seq.is_finished():
                self._release_ignored(seq)
                ignored.append(self.waiting.popleft())
                continue
            if seq.prefix_pending or not seq._table:
                if seq.get_len() > self.prompt_limit:
                    seq.status = SequenceStatus.FINISHED_IGNORED
                    self._release_ignored(seq)
                    ignored.append(self.waiting.popleft())
                    continue
                status = self._can_allocate_with_state(seq.num_blocks_needed() - len(seq._table))
                if status == "LATER":
                    break
                if status == "NEVER":
                    seq.status = SequenceStatus.FINISHED_IGNORED
                    self._release_ignored(seq)
                    ignored.append(self.waiting.popleft())
                    continue
            if num_seqs + 1 > self.max_num_seqs:
                break
            workload = seq.get_len() - seq.num_cached_tokens
            q = min(workload, self.max_num_batched_tokens - num_batched)
            if q <= 0:
                break
            chunked = q < workload
            if chunked and not self.chunked_prefill:
                break
            # Committed: the side effects start here.
            num_batched += q
            if seq.prefix_pending:
                num_cached_gpu += seq.num_cached_tokens
                self._admit_prefix(seq, zero_states)
            elif not seq._table:
                seq._table = self.block_manager.allocate_nolock(seq.num_blocks_needed())
                if self.state_manager is not None:
                    seq.state_id = self.state_manager.allocate_nolock(1)[0]
            if not chunked:
                num_seqs += 1
                seq.status = SequenceStatus.RUNNING
            seq.chunked_rest_len = workload - q
            scheduled.append(seq)
            seqlens.append(q)
            self.waiting.popleft()
            if chunked:
                break
        if not scheduled and not ignored:
            return None
        return SchedulerOutputs(scheduled, True, num_batched, [], ignored, seqlens, num_cached_gpu,
                                zero_states)

    def _schedule_decode(self) -> SchedulerOutputs:
        finished = [s for s in self.running if s.is_finished()]
        self.running = [s for s in self.running if not s.is_finished()]
        ignored = []
        for seq in list(self.waiting):
            if seq.is_finished():
                self._release_ignored(seq)
                self.waiting.remove(seq)
                ignored.append(seq)
        scheduled = []
        for seq in sorted(self.running, key=lambda s: -s.get_output_len()):
            # Room for one position past the appended tokens: under ZOS the token sampled by the
            # step still in flight is written by this one (_append_slot counts it as in flight).
            need = (seq.get_len() + seq.inflight_steps + self.block_size - 1) // self.block_size
            if len(seq._table) < need:
                if self.block_manager.get_num_free_blocks() < 1:
                    seq.status = SequenceStatus.FINISHED_PREEMPTED  # stop_preempted_request=True
                    self._free_seq_nolock(seq)
                    ignored.append(seq)
                    continue
                seq._table += self.block_manager.allocate_nolock(1)
            scheduled.append(seq)
        self.running = [s for s in self.running if s.status != SequenceStatus.FINISHED_PREEMPTED]
        return SchedulerOutputs(scheduled, False, len(scheduled), finished, ignored,
                                [1] * len(scheduled), 0, [])

    def process_outputs(self, so: SchedulerOutputs, accepted_token_ids: Any, output_token_ids: torch.Tensor,
                        so_status: Any) -> tuple[np.ndarray, np.ndarray]:
        del accepted_token_ids, so_status
        pushed = np.zeros(len(so.scheduled_seqs), dtype=np.int32)
        tokens = output_token_ids.tolist()
        for i, seq in enumerate(so.scheduled_seqs):
            seq.inflight_steps -= 1
            if seq.is_finished():
                if so.prompt_run:
                    self.running.append(seq)
                continue
            seq.num_cached_tokens += so.seqlens_q[i]
            if seq.num_cached_tokens < seq.get_len():  # a chunk of a longer prompt
                self.waiting.appendleft(seq)
                continue
            if so.prompt_run:
                self.running.append(seq)
            seq._tokens.append(int(tokens[i]))
            pushed[i] = 1
            self._check_stop(seq)
        return np.zeros(0), pushed

    def _check_stop(self, seq: Sequence) -> None:
        sp = seq.sampling_params
        if not sp.ignore_eos and seq._tokens[-1] == self.eos_token_id:
            seq.status = SequenceStatus.FINISHED_STOPPED
        elif seq.get_len() > self.max_model_len or seq.get_output_len() == sp.max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED


class PatchedScheduler(Scheduler):
    """The prefix-cache patch's scheduler API (``patches/deepinfer-prefix-cache.patch``)."""

    def add_sequence_with_prefix(self, seq: Sequence, blocks: Seq[int], num_cached: int,
                                 swa_valid_start: int) -> None:
        # Validate everything first: a bad call raises and changes nothing.
        bs = self.block_size
        blocks = [int(b) for b in blocks]
        _check(seq.status == SequenceStatus.WAITING and not seq._table and seq.state_id == -1
               and not seq.prefix_pending, "add_sequence_with_prefix: sequence is not new")
        _check(num_cached > 0 and num_cached % bs == 0, "num_cached", num_cached,
               "is not a positive multiple of", bs)
        _check(len(blocks) * bs == num_cached, "num_cached", num_cached, "!= block_size x", len(blocks),
               "blocks")
        _check(num_cached <= seq.get_len() - 1, "num_cached", num_cached, "leaves nothing to compute of",
               seq.get_len())
        _check(0 <= swa_valid_start <= num_cached, "swa_valid_start", swa_valid_start,
               "outside [0, num_cached]")
        _check(len(set(blocks)) == len(blocks), "duplicate block ids in prefix")
        self.block_manager.lock()
        try:
            for b in blocks:
                _check(0 < b < self.block_manager._num_blocks, "prefix block", b, "out of range")
                _check(self.block_manager._refs[b] > 0, "prefix block", b, "is free")
            self.block_manager.pin_blocks_nolock(blocks)
        finally:
            self.block_manager.unlock()
        seq._table = blocks
        seq.num_cached_tokens = num_cached
        seq.cached_hit_tokens = num_cached
        seq.swa_valid_start = swa_valid_start
        seq.prefix_pending = True
        self.add_sequence(seq)

    def _admit_prefix(self, seq: Sequence, zero_states: list[int]) -> None:
        seq._table = seq._table + self.block_manager.allocate_nolock(  # (schedule holds the lock)
            seq.num_blocks_needed() - len(seq._table))
        if self.state_manager is not None:
            seq.state_id = self.state_manager.allocate_nolock(1)[0]
            zero_states.append(seq.state_id)
        seq.prefix_pending = False

    def _release_ignored(self, seq: Sequence) -> None:
        if seq._table or seq.state_id != -1:
            self._free_seq_nolock(seq)
            seq.state_id = -1


# ---------------------------------------------------------------------------- outputs


class RequestOutput:
    """Outputs live in a pool and are read through ``get_<field>(ptr)`` (pybind_output.cpp)."""

    _live: ClassVar[dict[int, dict[str, Any]]] = {}
    _released: ClassVar[set[int]] = set()
    _next = itertools.count(1)

    def __init__(self, fields: dict[str, Any]) -> None:
        self.__dict__.update(fields)

    @classmethod
    def _alloc(cls, **fields: Any) -> int:
        ptr = next(cls._next)
        cls._live[ptr] = fields
        return ptr

    @classmethod
    def _get(cls, ptr: int, name: str) -> Any:
        ptr = int(ptr)
        if ptr not in cls._live:
            raise RuntimeError(f"RequestOutput {ptr:#x} read after it was recycled by the next step")
        return cls._live[ptr][name]

    @classmethod
    def clone(cls, ptr: int) -> RequestOutput:
        return cls({k: cls._get(ptr, k) for k in cls._live.get(int(ptr), {"request_id": None})})


for _field in ("request_id", "prompt_len", "token_id", "finish_reason", "finished", "num_output_tokens"):
    setattr(RequestOutput, f"get_{_field}", classmethod(lambda cls, ptr, _f=_field: cls._get(ptr, _f)))


class RequestOutputPool:
    def release(self, ptrs: np.ndarray) -> None:
        for ptr in ptrs.tolist():
            RequestOutput._live.pop(int(ptr), None)


def build_request_outputs(*, scheduler_outputs: SchedulerOutputs, token_logprobs: torch.Tensor,
                          pushed_tokens_before_finish: np.ndarray, **unused: Any) -> np.ndarray:
    """One output per pushed token, then one 'ignored' output per ignored sequence."""
    so, pushed = scheduler_outputs, pushed_tokens_before_finish
    ptrs = []
    for i, seq in enumerate(so.scheduled_seqs[: len(token_logprobs)]):
        if pushed[i] == 0:
            continue
        ptrs.append(RequestOutput._alloc(
            request_id=seq.request_id, prompt_len=seq.get_prompt_len(), token_id=seq.token_ids()[-1],
            finish_reason=_FINISH_REASONS.get(seq.status, ""), finished=seq.is_finished(),
            num_output_tokens=seq.get_output_len()))
    for seq in so.ignored_seqs:
        ptrs.append(RequestOutput._alloc(
            request_id=seq.request_id, prompt_len=seq.get_prompt_len(), token_id=seq.token_ids()[-1],
            finish_reason=_FINISH_REASONS.get(seq.status, ""), finished=seq.is_finished(),
            num_output_tokens=seq.get_output_len() + 1))
    return np.asarray(ptrs, dtype=np.uint64)


def process_MTPInfo(*args: Any) -> None:  # DeepInfer's name
    del args


# ---------------------------------------------------------------------------- engine


def fake_core(patched: bool = True) -> SimpleNamespace:
    """This module's stand-in for ``deepinfer._C.engine`` (with or without the patch's API)."""
    return SimpleNamespace(
        BlockManager=PatchedBlockManager if patched else BlockManager,
        Scheduler=PatchedScheduler if patched else Scheduler,
        Sequence=PatchedSequence if patched else Sequence,
        SequenceStatus=SequenceStatus, SequenceMetadataPool=SequenceMetadataPool,
        RequestOutput=RequestOutput, RequestOutputPool=RequestOutputPool,
        build_request_outputs=build_request_outputs, process_MTPInfo=process_MTPInfo,
    )


@dataclass(slots=True)
class EngineArgs:
    """The fields of ``deepinfer.engine.arg_utils.EngineArgs`` the adapter sets."""

    model: str
    max_model_len: int | None = None
    data_parallel_size: int = 0
    context_parallel_size: int = 1
    expert_parallel_size: int = 1
    engine_rank: int = 0
    engine_group_rank: int = 0
    gpu_memory_utilization: float = 0.90
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    chunked_prefill: bool = False
    stop_preempted_request: bool = True
    disable_log_stats: bool = False


@dataclass(slots=True)
class FakeOptions:
    """What the fake cannot derive from GPU memory: pool sizes, the toy model, the step loop."""

    num_gpu_blocks: int = 64
    num_state_slots: int | None = None  # default int(max_num_seqs * 1.2) + 1, as cache_engine.py
    vocab_size: int = 1000
    eos_id: int = 1
    eos_modulus: int = 0  # the toy model emits EOS when its hash % eos_modulus == 0 (0: never)
    zos: bool = True
    prefill_attempt_interval: int = 1
    prefill_any_attempt_interval: int = 0  # DeepInfer's ANY points (the real Scheduler); 0: the same
    dp_group: Any = None  # a torch.distributed group; needed by the real Scheduler
    # No model compute: token ids come from a hash of (step, row) without reading or writing the
    # KV pool, for benchmarks of everything around the forward (bench/decode_bench.py).
    null_forward: bool = False


class FakeLLMEngine:
    """``LLMEngine``'s step loop over a core (this module's, or the real ``deepinfer._C.engine``).

    Each rank here is its own group of one: ``has_unfinished_requests`` votes locally.
    """

    options = FakeOptions()
    core: Any = fake_core(True)

    def __init__(self, args: EngineArgs) -> None:
        opts, core = self.options, self.core
        if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < BLOCK_SIZE:
            raise ValueError("max_num_batched_tokens must be >= block size")
        self.args = args
        self.block_size = BLOCK_SIZE
        self.eos_id = opts.eos_id
        self.model_config = SimpleNamespace(get_vocab_size=lambda: opts.vocab_size)
        self.cache_config = SimpleNamespace(block_size=BLOCK_SIZE, num_gpu_blocks=opts.num_gpu_blocks,
                                            bytes_per_block=BLOCK_SIZE * 4)
        num_states = opts.num_state_slots or int(args.max_num_seqs * 1.2) + 1
        self.block_manager = core.BlockManager(opts.num_gpu_blocks)
        self.state_manager = core.BlockManager(num_states)
        max_model_len = args.max_model_len or 4096
        max_batched = args.max_num_batched_tokens or max(max_model_len, 4096)
        self.scheduler_config = SimpleNamespace(
            max_model_len=max_model_len, runtime_max_model_len=max_model_len + 64,
            max_num_batched_tokens=max_batched, max_num_seqs=args.max_num_seqs,
            stop_preempted_request=True, chunked_prefill=args.chunked_prefill, engine_type=0,
            prefill_attempt_interval=opts.prefill_attempt_interval,
            prefill_any_attempt_interval=opts.prefill_any_attempt_interval or opts.prefill_attempt_interval)
        self.scheduler = core.Scheduler(
            BLOCK_SIZE, self.block_manager, self.state_manager, opts.eos_id, opts.dp_group,
            self.scheduler_config, 0, 0, max(max_model_len, max_batched), None, [], 1,
            opts.vocab_size, False)
        gpu_blocks = torch.zeros(opts.num_gpu_blocks, BLOCK_SIZE * 4, dtype=torch.uint8)
        self.driver_worker = SimpleNamespace(cache_engine=SimpleNamespace(gpu_blocks=gpu_blocks))
        self._kv = gpu_blocks.view(torch.int32)  # [blocks, 128]: token id + 1 per position, 0 = unwritten
        self.has_block_table = hasattr(core.Sequence, "block_table")
        self._metadata_pool = core.SequenceMetadataPool()
        self._output_pool = core.RequestOutputPool()
        self._seq_ids = itertools.count(1)
        self._device_tokens: dict[int, list[int]] = {}  # what the "GPU" has sampled, per seq_id
        self._prev: tuple[Any, list[Any], torch.Tensor] | None = None
        self._to_release: list[np.ndarray] = []
        self.closed = False
        self.num_steps = 0
        self.num_cached_tokens_gpu_total = 0  # what the stats logger's prefill_caching_rate sums

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> FakeLLMEngine:
        return cls(args)

    # -- requests
    def add_request(self, user_id: str, request_id: str, sampling_params: dict | None,
                    prompt_token_ids: np.ndarray, multi_modal_data: Any = None,
                    arrival_time: float | None = None,
                    extra: dict | None = None, enqueue: bool = True) -> Any:
        del user_id, multi_modal_data, extra
        sp = dict(temperature=1.0, top_p=1.0, top_k=-1, ignore_eos=False, max_tokens=16,
                  prompt_logprobs=False,
                  top_logprobs=0, first_n_token_no_eos=0, so_args=None, golden_token_ids=None, seq_seed=0)
        sp.update({k: v for k, v in (sampling_params or {}).items() if v is not None})
        sp["eos_id"] = self.eos_id
        sp["seq_seed"] = int(sp["seq_seed"] or 0) & 0xFFFF_FFFF_FFFF_FFFF
        if prompt_token_ids.size == 0:
            raise ValueError("prompt must not be empty")
        if prompt_token_ids.min() < 0 or prompt_token_ids.max() >= self.model_config.get_vocab_size():
            return None  # DeepInfer drops such requests silently
        seq = self._make_sequence(request_id, np.ascontiguousarray(prompt_token_ids, dtype=np.int32),
                                  SimpleNamespace(**sp), arrival_time)
        if enqueue:
            self.scheduler.add_sequence(seq)
        return seq

    def _make_sequence(self, request_id: str, prompt: np.ndarray, sp: Any, arrival_time: float | None) -> Any:
        if self.core.Sequence in (Sequence, PatchedSequence):
            return self.core.Sequence(next(self._seq_ids), prompt, request_id, sp)
        return self.core.Sequence(
            seq_id=next(self._seq_ids), prompt_token_ids=prompt, compressed_prompt_token_ids=prompt.copy(),
            multi_modal_data=None, block_size=BLOCK_SIZE, request_id=request_id, user_id="0",
            sampling_params=sp,
            arrival_time=arrival_time or time.perf_counter(), golden_token_ids=None)

    def abort_request(self, request_id: str | Iterable[str]) -> tuple[int, int]:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        seqs = self.scheduler.abort_sequence(ids)
        return len(seqs), sum(s.get_len() for s in seqs)

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.has_unfinished_seqs())

    def get_num_unfinished_requests(self) -> int:
        return int(self.scheduler.get_num_unfinished_seqs())

    # -- the step loop (worker.execute_model_step under ZOS)
    def step(self) -> np.ndarray:
        self._check_open()
        metas, so = self.scheduler.schedule(self._metadata_pool)
        self.num_cached_tokens_gpu_total += int(so.num_cached_tokens_gpu)
        tokens = self._forward(metas, so)
        outputs = self._post_process(self._prev)
        self._prev = None
        self._pre_sampler_sync(so)
        state = (so, metas, tokens)
        if so.prompt_run or not self.options.zos:
            outputs = np.concatenate([outputs, self._post_process(state)])
        else:
            self._prev = state
        self._to_release.append(outputs)
        self.num_steps += 1
        return outputs

    def flush_inflight_reqs(self) -> np.ndarray:
        self._check_open()
        outputs = self._post_process(self._prev)
        self._prev = None
        self._to_release.append(outputs)
        return outputs

    def _pre_sampler_sync(self, so: Any) -> None:
        for ptrs in self._to_release:  # the outputs handed out by earlier step() calls
            self._output_pool.release(ptrs)
        self._to_release = []
        for seq in so.finished_seqs:
            self.finalize_seq(seq)

    def finalize_seq(self, seq: Any) -> None:
        self._device_tokens.pop(seq.seq_id, None)
        self.scheduler.free_seq(seq)

    def _post_process(self, state: tuple[Any, list[Any], torch.Tensor] | None) -> np.ndarray:
        if state is None:
            return np.empty(0, dtype=np.uint64)
        so, metas, tokens = state
        n = len(metas)
        self.core.process_MTPInfo(so, False, torch.zeros((n, 0), dtype=torch.int32), None)
        _, pushed = self.scheduler.process_outputs(so, torch.empty(0, dtype=torch.int32), tokens, None)
        self._metadata_pool.release(metas)
        return self.core.build_request_outputs(
            scheduler_outputs=so, max_num_batched_tokens=self.scheduler_config.max_num_batched_tokens,
            token_ids=tokens, token_logprobs=torch.zeros(n, dtype=torch.float32), top_logprobs_=None,
            top_token_ids_=None, sum_smaller_probs_=None, accepted_token_ids_=None,
            accepted_token_logprobs_=None, accepted_top_logprobs_=None, accepted_top_token_ids_=None,
            accepted_sum_smaller_probs_=None, accepted_token_last_logprobs_=None,
            pushed_tokens_before_finish=np.ascontiguousarray(pushed, dtype=np.int32), prompt_logprobs=None,
            request_output_pool=self._output_pool)

    # -- the toy model: KV = token ids in the pool rows, next token = hash of what is read back
    def _forward(self, metas: list[Any], so: Any) -> torch.Tensor:
        if self.options.null_forward:
            return self._null_forward(len(metas))
        out = torch.zeros(len(metas), dtype=torch.int32)
        for i, (meta, seq) in enumerate(zip(metas, so.scheduled_seqs)):
            if meta.is_prompt:
                dev = self._device_tokens.setdefault(seq.seq_id, list(seq.data.get_token_ids()))
                start, end = meta.seqlen_k - meta.seqlen_q, meta.seqlen_k
                if not meta.is_last_prompt_chunk:
                    self._write_kv(seq, dev, start, end)
                    continue
            else:
                dev = self._device_tokens[seq.seq_id]
                start, end = meta.seqlen_k - 1, meta.seqlen_k
            self._write_kv(seq, dev, start, end)
            token = self._next_token(seq, dev, end, seq.sampling_params)
            dev.append(token)
            out[i] = token
        return out

    def _null_forward(self, n: int) -> torch.Tensor:
        """Ids in ``3..vocab-1`` (never EOS) from a hash of (step, row): no per-sequence work."""
        x = (np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B1)
             + np.uint64(self.num_steps * 0x85EBCA77 & 0xFFFFFFFF)) & np.uint64(0xFFFFFFFF)
        x ^= x >> np.uint64(15)
        x = (x * np.uint64(0x2C1B3C6D)) & np.uint64(0xFFFFFFFF)
        x ^= x >> np.uint64(12)
        return torch.from_numpy((x % np.uint64(self.options.vocab_size - 3) + np.uint64(3)).astype(np.int32))

    def _write_kv(self, seq: Any, dev: list[int], start: int, end: int) -> None:
        if not self.has_block_table:
            return
        table = seq.block_table
        for pos in range(start, end):
            block = table[pos // BLOCK_SIZE]
            _check(block != 0, "KV write into scratch block 0")
            self._kv[block, pos % BLOCK_SIZE] = dev[pos] + 1

    def _next_token(self, seq: Any, dev: list[int], num_positions: int, sp: Any) -> int:
        if self.has_block_table:
            table = seq.block_table
            kv = torch.cat([self._kv[table[j]]
                            for j in range((num_positions + BLOCK_SIZE - 1) // BLOCK_SIZE)])
            ctx = kv[:num_positions].to(torch.int64)
            _check(bool((ctx > 0).all()), f"{seq.request_id}: read KV that was never written")
            ctx = ctx - 1
        else:
            ctx = torch.tensor(dev[:num_positions], dtype=torch.int64)
        weights = torch.arange(1, num_positions + 1, dtype=torch.int64) % 1009 + 1
        h = int((ctx * weights).sum()) * 2654435761 + int(sp.seq_seed) * 97 + num_positions
        h &= 0xFFFF_FFFF_FFFF
        vocab = self.options.vocab_size
        if self.options.eos_modulus and h % self.options.eos_modulus == 0:
            return self.eos_id
        return 3 + h % (vocab - 3)

    # -- lifecycle
    def _check_open(self) -> None:
        _check(not self.closed, "engine is closed")

    def close(self) -> None:
        self.closed = True


class _PrefixEnqueue:
    """``LLMEngine.enqueue_with_prefix`` as the patch adds it (only when the core has the API)."""

    scheduler: Any

    def enqueue_with_prefix(self, seq: Any, blocks: Seq[int], num_cached: int,
                            swa_valid_start: int | None = None) -> None:
        start = num_cached if swa_valid_start is None else swa_valid_start
        self.scheduler.add_sequence_with_prefix(seq, np.asarray(blocks, dtype=np.int32).tolist(), num_cached,
                                                start)


def make_api(patched: bool = True, core: Any = None, **options: Any) -> SimpleNamespace:
    """A namespace shaped like what the adapter imports from ``deepinfer`` (see ``import_deepinfer``)."""
    core = core if core is not None else fake_core(patched)
    bases: tuple[type, ...] = (FakeLLMEngine,)
    if hasattr(core.Scheduler, "add_sequence_with_prefix"):
        bases = (_PrefixEnqueue, FakeLLMEngine)
    engine_cls = type("FakeLLMEngine", bases, {"options": FakeOptions(**options), "core": core})
    return SimpleNamespace(
        LLMEngine=engine_cls, EngineArgs=EngineArgs, RequestOutput=core.RequestOutput,
        Scheduler=core.Scheduler, BlockManager=core.BlockManager, Sequence=core.Sequence,
        SequenceStatus=core.SequenceStatus, is_fake=True,
        # DeepInfer's real Scheduler votes the step type across the ranks of its dp_group; this
        # module's votes per rank (rank/vote_filler.py needs the former).
        votes_across_ranks=options.get("dp_group") is not None,
    )

