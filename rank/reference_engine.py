"""The reference engine: ``Engine`` over ``ReferenceModel`` with a real paged KV pool.

Pool layout follows DeepInfer: one uint8 tensor ``[num_blocks, bytes_per_block]``; a row holds
K and V of every layer for ``block_size`` tokens (the model views it, ``ReferenceModel.kv_view``).
Block 0 is scratch. Scheduling: FIFO admission under ``max_num_seqs``; a prompt's blocks are all
reserved when it is admitted (so a chunked prefill can always continue); prefill steps (chunks
of up to ``max_num_batched_tokens`` uncached tokens) and decode steps are separate, as in
DeepInfer, and alternate while both have work. A decode that finds no free block for a
sequence's next token finishes that sequence with ERROR (DeepInfer's default
``stop_preempted_request``); the cache's admission control is what keeps the pool from filling.

The 'null' model computes nothing: the next id is a hash of (last id, position, seed), never EOS,
and the "KV" written into each row is the token ids, so block export/import carry real data.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from protocol.sampling import SEED_MODULUS, sampling_error
from rank.block_manager import BlockManager
from rank.config import RankConfig
from rank.engine import (
    Engine,
    EngineMisuse,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestOutput,
)
from rank.ids import BlockId
from rank.pool_transfers import PoolTransfers
from rank.reference_model import (
    MODEL_SPECS,
    ReferenceModel,
    SeqBatchItem,
    kv_bytes_per_block,
    load_weights,
    null_forward,
    random_weights,
)
from rank.sampler import make_generator, sample

if TYPE_CHECKING:
    from rank.host_pool import HostPool

log = logging.getLogger(__name__)

EOS_ID = 1


@dataclass(slots=True)
class ReferenceEngineConfig:
    model: str = "tiny"
    block_size: int = 128
    num_blocks: int = 2048
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 16384
    max_model_len: int = 1_064_960
    device: str = "cpu"
    weights: str | None = None
    seed: int = 0
    exact: bool | None = None  # batch-invariant math; default: on for CPU
    eos_every: int = 0  # random weights: a sampled reply ends about once every N tokens (0: never)

    @classmethod
    def from_rank_config(cls, config: RankConfig) -> ReferenceEngineConfig:
        return cls(
            model=config.reference_model,
            block_size=config.block_size,
            num_blocks=config.reference_num_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            device=config.reference_device,
            weights=config.reference_weights,
            eos_every=config.reference_eos_every,
        )


@dataclass(slots=True, eq=False)
class _Seq:
    request_id: str
    prompt_ids: np.ndarray
    request: EngineRequest
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the pool
    generator: torch.Generator | None = None
    null_seed: int = 0  # the null model's per-request hash input (u64; 0 = greedy)
    table_tensor: torch.Tensor | None = None  # cache of block_table on the device

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else int(self.prompt_ids[-1])


class ReferenceEngine(Engine):
    """See the module docstring; the interface invariants are in ``rank/engine.py``. Imports
    and exports may run beside ``step`` (``rank/pool_transfers.py`` says why that is safe)."""

    concurrent_transfers = True

    def __init__(self, config: ReferenceEngineConfig, host_pool: HostPool | None = None) -> None:
        if config.model not in MODEL_SPECS:
            raise ValueError(f"unknown reference model {config.model!r}; use one of {sorted(MODEL_SPECS)}")
        self.config = config
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks
        self.device = torch.device(config.device)
        self.spec = MODEL_SPECS[config.model]
        dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.bytes_per_block = kv_bytes_per_block(self.spec, self.block_size, dtype)
        self.model: ReferenceModel | None = None
        started = time.monotonic()
        if not self.spec.is_null:
            if config.weights:
                weights = load_weights(self.spec, Path(config.weights), self.device, dtype)
                origin = f"weights from {config.weights}"
            else:
                weights = random_weights(self.spec, config.seed, self.device, dtype)
                origin = f"RANDOM weights (seed {config.seed}): its text is meaningless"
            exact = config.exact if config.exact is not None else self.device.type == "cpu"
            self.model = ReferenceModel(self.spec, weights, self.block_size, exact=exact)
        else:
            origin = "no compute: deterministic ids, meaningless text"
        self.pool = torch.zeros(self.num_blocks, self.bytes_per_block, dtype=torch.uint8, device=self.device)
        self.blocks = BlockManager(self.num_blocks)
        self.host_pool = host_pool
        if host_pool is not None:
            host_pool.open(self.bytes_per_block)
        self.transfers = PoolTransfers(self.blocks, host_pool, self.device)
        self._waiting: deque[_Seq] = deque()
        self._running: dict[str, _Seq] = {}
        self._aborts: set[str] = set()
        self._last_was_prefill = False
        self._seed_stream = np.random.default_rng(config.seed)
        self._num_cached_tokens_total = 0
        self._num_prompt_tokens_total = 0
        self.step_collective: Callable[[], None] | None = None  # set by the lockstep worker
        log.info(
            "reference engine: model %s (%.1fM params, %s), device %s, %d blocks x %d tokens, "
            "%d bytes/block, loaded in %.1fs",
            self.spec.name, self.spec.num_params() / 1e6, origin, self.device, self.num_blocks,
            self.block_size, self.bytes_per_block, time.monotonic() - started,
        )

    # ------------------------------------------------------------------ requests

    def add(self, request: EngineRequest) -> None:
        self._validate(request)
        prompt = np.ascontiguousarray(request.prompt_ids, dtype=np.int32)
        seq = _Seq(request.request_id, prompt, request)
        if not request.sampling.is_greedy:
            seed = request.sampling.seed
            if seed is None:
                seed = int(self._seed_stream.integers(0, 2**63))
            seq.generator = make_generator(seed, self.device)
            seq.null_seed = (int(request.sampling.seed or 0) + 1) % SEED_MODULUS
        prefix = [int(b) for b in request.prefix_blocks]
        self.blocks.incref(prefix)  # the first state change: everything above may raise
        seq.block_table = prefix
        seq.num_computed = request.num_cached_tokens
        self._waiting.append(seq)

    def _validate(self, request: EngineRequest) -> None:
        rid = request.request_id
        if not isinstance(rid, str) or not rid:
            raise EngineMisuse(f"request_id must be a non-empty string, got {rid!r}")
        if rid in self._running or any(s.request_id == rid for s in self._waiting):
            raise EngineMisuse(f"request {rid!r} is already queued or running")
        prompt = request.prompt_ids
        if not isinstance(prompt, np.ndarray) or prompt.ndim != 1 or prompt.size == 0:
            raise EngineMisuse(f"request {rid!r}: prompt_ids must be a non-empty 1-D int array")
        if prompt.dtype.kind not in "iu":
            raise EngineMisuse(f"request {rid!r}: prompt_ids dtype {prompt.dtype} is not integer")
        vocab = self.spec.vocab_size
        if int(prompt.min()) < 0 or int(prompt.max()) >= vocab:
            raise EngineMisuse(f"request {rid!r}: token ids must be in [0, {vocab})")
        sp = request.sampling
        # The boundary's limits again (protocol/sampling.py): a value that slipped past it fails
        # this request here, never a sampler inside a step.
        reason = sampling_error(sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed, vocab)
        if reason is not None:
            raise EngineMisuse(f"request {rid!r}: invalid sampling parameters: {reason}")
        prefix = list(request.prefix_blocks)
        num_cached = request.num_cached_tokens
        if num_cached != self.block_size * len(prefix):
            raise EngineMisuse(
                f"request {rid!r}: num_cached_tokens {num_cached} != block_size {self.block_size} "
                f"x {len(prefix)} prefix blocks"
            )
        if prefix and num_cached > prompt.size - 1:
            raise EngineMisuse(
                f"request {rid!r}: num_cached_tokens {num_cached} leaves nothing to compute of a "
                f"{prompt.size}-token prompt (at most {prompt.size - 1})"
            )
        self.blocks.validate_held(prefix, what=f"request {rid!r} prefix", need_cache_ref=True)

    def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            if rid in self._running or any(s.request_id == rid for s in self._waiting):
                self._aborts.add(rid)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    # ------------------------------------------------------------------ stepping

    def placeholder_step(self) -> None:
        if self.step_collective is not None:
            self.step_collective()

    def step(self) -> list[RequestOutput]:
        if self.step_collective is not None:
            self.step_collective()
        outputs: list[RequestOutput] = []
        if self._aborts:
            self._finish_aborted(outputs)
        prefill = self._schedule_prefill(outputs)
        decodable = [s for s in self._running.values() if s.num_computed >= s.num_prompt]
        if prefill and (not decodable or not self._last_was_prefill):
            self._last_was_prefill = True
            self._run_prefill(prefill, outputs)
        elif decodable:
            # Admitted prompts not run this step keep their reserved blocks for the next one.
            self._last_was_prefill = False
            self._run_decode(decodable, outputs)
        return outputs

    def _finish_aborted(self, outputs: list[RequestOutput]) -> None:
        aborted = self._aborts
        self._aborts = set()
        kept_waiting: deque[_Seq] = deque()
        for seq in self._waiting:
            if seq.request_id in aborted:
                self.blocks.decref(seq.block_table)
                seq.block_table = []
                outputs.append(self._terminal(seq, FinishReason.ABORT))
            else:
                kept_waiting.append(seq)
        self._waiting = kept_waiting
        if any(rid in self._running for rid in aborted):
            # Before any of their refs drop: their last prefill chunk may still be writing its
            # blocks or reading its prefix, which a release on the transfer thread may free later.
            self.transfers.fence()  # (pool_transfers.py)
        for rid in aborted:
            running = self._running.get(rid)
            if running is not None:
                outputs.append(self._finish(running, FinishReason.ABORT))

    def _schedule_prefill(self, outputs: list[RequestOutput]) -> list[tuple[_Seq, int]]:
        """Pick (sequence, chunk tokens) pairs; admits waiting requests (reserving blocks)."""
        bs = self.block_size
        budget = self.config.max_num_batched_tokens
        batch: list[tuple[_Seq, int]] = []
        for seq in self._running.values():
            if seq.num_computed < seq.num_prompt and budget > 0:
                chunk = min(seq.num_prompt - seq.num_computed, budget)
                batch.append((seq, chunk))
                budget -= chunk
        while self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            seq = self._waiting[0]
            error = self._unservable(seq)
            if error is not None:
                self._waiting.popleft()
                outputs.append(self._finish_unadmitted(seq, error))
                continue
            need = -(-seq.num_prompt // bs) - len(seq.block_table)
            fresh = self.blocks.try_allocate(need)
            if fresh is None:
                break  # head-of-line: wait for blocks to be freed or released
            self._waiting.popleft()
            seq.block_table = seq.block_table + fresh
            self._running[seq.request_id] = seq
            self._num_prompt_tokens_total += seq.num_prompt
            self._num_cached_tokens_total += seq.num_computed
            chunk = min(seq.num_prompt - seq.num_computed, budget)
            batch.append((seq, chunk))
            budget -= chunk
        return batch

    def _unservable(self, seq: _Seq) -> str | None:
        if seq.num_prompt >= self.config.max_model_len:
            return (f"prompt of {seq.num_prompt} tokens leaves no room under max_model_len "
                    f"{self.config.max_model_len}")
        need = -(-(seq.num_prompt + 1) // self.block_size)
        if need > self.num_blocks - 1:
            return f"prompt needs {need} KV blocks; the pool has {self.num_blocks - 1}"
        return None

    def _table(self, seq: _Seq) -> torch.Tensor:
        if seq.table_tensor is None or seq.table_tensor.shape[0] != len(seq.block_table):
            seq.table_tensor = torch.tensor(seq.block_table, dtype=torch.int64, device=self.device)
        return seq.table_tensor

    def _run_prefill(self, batch: list[tuple[_Seq, int]], outputs: list[RequestOutput]) -> None:
        token_chunks, pos_chunks, items, sample_rows, sampled = [], [], [], [], []
        row = 0
        for seq, chunk in batch:
            start = seq.num_computed
            token_chunks.append(seq.prompt_ids[start : start + chunk])
            pos_chunks.append(np.arange(start, start + chunk, dtype=np.int64))
            table = self._table(seq) if self.model is not None else seq.block_table  # null model: a list
            items.append(SeqBatchItem(row, chunk, start, table))  # type: ignore[arg-type]
            row += chunk
            seq.num_computed += chunk
            if seq.num_computed == seq.num_prompt:
                sample_rows.append(row - 1)
                sampled.append(seq)
        token_ids = np.concatenate(token_chunks).astype(np.int64)
        positions = np.concatenate(pos_chunks)
        self._emit(sampled, self._forward(token_ids, positions, items, sample_rows, sampled), outputs)

    def _run_decode(self, decodable: list[_Seq], outputs: list[RequestOutput]) -> None:
        bs = self.block_size
        batch: list[_Seq] = []
        for seq in decodable:
            pos = seq.num_tokens - 1
            if pos // bs >= len(seq.block_table):
                fresh = self.blocks.try_allocate(1)
                if fresh is None:
                    outputs.append(self._finish(seq, FinishReason.ERROR, "KV pool exhausted during decode"))
                    continue
                seq.block_table.append(fresh[0])
            batch.append(seq)
        if not batch:
            return
        token_ids = np.fromiter((s.last_token for s in batch), dtype=np.int64, count=len(batch))
        positions = np.fromiter((s.num_tokens - 1 for s in batch), dtype=np.int64, count=len(batch))
        if self.model is not None:
            items = [SeqBatchItem(i, 1, int(positions[i]), self._table(s)) for i, s in enumerate(batch)]
        else:  # the null model indexes plain lists; no per-sequence tensors
            items = [SeqBatchItem(i, 1, int(positions[i]), s.block_table)  # type: ignore[arg-type]
                     for i, s in enumerate(batch)]
        for seq in batch:
            seq.num_computed += 1
        self._emit(batch, self._forward(token_ids, positions, items, list(range(len(batch))), batch), outputs)

    def _emit(self, sampled: list[_Seq], result: tuple[list[int], dict[int, str]],
              outputs: list[RequestOutput]) -> None:
        """Append each sampled token, or fail the one request whose row could not be sampled."""
        tokens, errors = result
        for row, (seq, token) in enumerate(zip(sampled, tokens)):
            error = errors.get(row)
            if error is None:
                outputs.append(self._append(seq, token))
            else:
                log.warning("request %s failed alone: %s", seq.request_id, error)
                outputs.append(self._finish(seq, FinishReason.ERROR, error))

    def _forward(
        self, token_ids: np.ndarray, positions: np.ndarray, items: list[SeqBatchItem],
        sample_rows: list[int], sampled: list[_Seq],
    ) -> tuple[list[int], dict[int, str]]:
        """The sampled rows' tokens, and why a row got none (sampling is per request)."""
        if self.model is None:
            seeds = np.fromiter((s.null_seed for s in sampled), dtype=np.uint64, count=len(sampled))
            tokens = null_forward(self.pool, self.block_size, self.spec.vocab_size, token_ids, positions,
                                  items, sample_rows, seeds)
            self.transfers.fence()  # its writes are not waited for before _emit frees blocks
            return tokens, {}
        dev = self.device
        logits = self.model.forward(
            torch.from_numpy(token_ids).to(dev),
            torch.from_numpy(positions).to(dev),
            items,
            self.pool,
            torch.tensor(sample_rows, dtype=torch.int64, device=dev),
        )
        errors: dict[int, str] = {}
        if not sampled:
            return [], errors
        if self.config.eos_every > 1 and self.config.weights is None:
            self._favour_eos(logits, sampled)
        tokens = sample(logits, [s.request.sampling for s in sampled], [s.generator for s in sampled], errors)
        return tokens, errors

    def _favour_eos(self, logits: torch.Tensor, sampled: list[_Seq]) -> None:
        """Random weights never end a reply; clients that stop only on end_turn (Claude Code) need
        one. For sampled rows (temperature > 0) set the EOS logit so that, at temperature 1, EOS
        has probability 1/eos_every: log(sum of the others' exp) - log(eos_every - 1)."""
        rows = [i for i, s in enumerate(sampled) if not s.request.sampling.is_greedy]
        if rows:
            idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
            logits[idx, EOS_ID] = float("-inf")
            logits[idx, EOS_ID] = torch.logsumexp(logits[idx], dim=-1) - math.log(self.config.eos_every - 1)

    def _append(self, seq: _Seq, token: int) -> RequestOutput:
        seq.output_ids.append(token)
        sp = seq.request.sampling
        if token == EOS_ID and not sp.ignore_eos:
            return self._finish(seq, FinishReason.STOP, new_token=token)
        if len(seq.output_ids) >= sp.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return self._finish(seq, FinishReason.LENGTH, new_token=token)
        return RequestOutput(seq.request_id, [token], False, None, seq.num_prompt,
                             seq.request.num_cached_tokens)

    def _finish(self, seq: _Seq, reason: FinishReason, error: str | None = None,
                new_token: int | None = None) -> RequestOutput:
        del self._running[seq.request_id]
        kept: list[int] = []
        table = seq.block_table
        if seq.request.keep_blocks and reason in (FinishReason.STOP, FinishReason.LENGTH):
            num_full = (seq.num_tokens - 1) // self.block_size
            kept = table[:num_full]
            self.blocks.to_cache(kept)
            self.blocks.decref(table[num_full:])
        else:
            self.blocks.decref(table)
        seq.block_table = []
        out = self._terminal(seq, reason, error)
        out.token_ids = [] if new_token is None else [new_token]
        out.kept_blocks = cast("list[BlockId]", kept)
        return out

    def _finish_unadmitted(self, seq: _Seq, error: str) -> RequestOutput:
        self.blocks.decref(seq.block_table)  # the prefix refs taken in add()
        seq.block_table = []
        return self._terminal(seq, FinishReason.ERROR, error)

    @staticmethod
    def _terminal(seq: _Seq, reason: FinishReason, error: str | None = None) -> RequestOutput:
        return RequestOutput(
            seq.request_id, [], True, reason, seq.num_prompt, seq.request.num_cached_tokens, [], error
        )

    # ------------------------------------------------------------------ cache side

    def release(self, block_ids: Sequence[int]) -> None:
        self.transfers.release(block_ids)

    def export_blocks(self, block_ids: Sequence[int], host_slot: int,
                      between: Callable[[], None] | None = None) -> None:
        self.transfers.export(self.pool, block_ids, host_slot, between)

    def import_blocks(self, host_slot: int, num_blocks: int) -> list[BlockId]:
        return cast("list[BlockId]", self.transfers.import_(self.pool, host_slot, num_blocks))

    def transfer_stats(self, last: EngineStats) -> EngineStats:
        return self.transfers.stats(last)

    # ------------------------------------------------------------------ stats

    def stats(self) -> EngineStats:
        running_tokens = 0
        waiting_tokens = 0
        for seq in self._running.values():
            running_tokens += seq.num_tokens
            waiting_tokens += seq.num_prompt - min(seq.num_computed, seq.num_prompt)
        for seq in self._waiting:
            waiting_tokens += seq.num_prompt - seq.num_computed
        return EngineStats(
            num_blocks=self.num_blocks,
            num_free_blocks=self.blocks.num_free_blocks,
            num_cached_blocks=self.blocks.num_cached_blocks,
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            running_tokens=running_tokens,
            waiting_tokens=waiting_tokens,
            num_cached_tokens_total=self._num_cached_tokens_total,
            num_prompt_tokens_total=self._num_prompt_tokens_total,
        )

    def check_accounting(self) -> None:
        seq_refs: dict[int, int] = {}
        for seq in list(self._running.values()) + list(self._waiting):
            assert len(seq.block_table) == len(set(seq.block_table)), f"{seq.request_id}: duplicate block"
            for block_id in seq.block_table:
                seq_refs[block_id] = seq_refs.get(block_id, 0) + 1
        self.blocks.check(seq_refs)

    def close(self) -> None:
        # The host pool belongs to whoever made it (the worker or the local group).
        self.pool = torch.empty(0, dtype=torch.uint8)
        self.model = None
