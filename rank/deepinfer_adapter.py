"""``Engine`` over DeepInfer 0.1.0's ``LLMEngine`` (one rank process per GPU, EP = DP = ``ep``).

Facts this relies on are in the ``deepinfer==0.1.0`` sdist, ``docs/deepinfer.md`` (DeepInfer's own source
is cited there by file and line); the prefix-cache hooks come from
``patches/deepinfer-prefix-cache.patch`` (see ``docs/deepinfer.md``).

Lockstep
--------
DeepInfer creates its own torch.distributed default group (gloo, ``init_process_group`` at
``tcp://$MASTER_ADDR:$MASTER_PORT-50+engine_group_rank``) while ``LLMEngine`` is built, so a worker
must not initialise its own default group for this engine (nor pick a ``MASTER_PORT`` below 50).
DeepInfer's own loop is ``step() if has_unfinished_requests() else flush_inflight_reqs()`` on
every rank: ``has_unfinished_requests()`` is itself the collective (all_reduce MAX over the DP
group), ``step()`` on a rank with nothing to run is DeepInfer's placeholder forward (block table
``[0]``, state slot 0; it keeps the expert collectives matched), and ``flush_inflight_reqs()`` is
rank-local (the step still in flight under zero-overhead scheduling). Hence ``owns_lockstep``:
the rank loop (``rank/rank_loop.py``) calls ``lockstep_has_work()`` then ``step()`` every iteration, and
``group_had_work`` (the vote, equal on every rank) marks the iterations idle group-wide.
``placeholder_step()`` runs ``llm.step()`` and keeps its outputs for the next ``step()``. Before
``llm.step()`` at an ALL vote point, ``rank/vote_filler.py`` may queue a one-token request.

Tests (only) run this adapter in real rank processes over the stand-in: the worker's factory
(``rank.engines.make_deepinfer_engine``) takes ``api_module``, a module whose ``deepinfer_api()``
returns what ``import_deepinfer`` would (``standins.fake_deepinfer_lockstep``); the rank's setup
passes it from ``DIB_DEEPINFER_MODULE`` (``rank/rank_setup.py``).

Semantics the adapter papers over
---------------------------------
* Outputs are pointers into DeepInfer's ``RequestOutputPool`` and are recycled by the next
  ``step()``: they are read here, immediately, into ``RequestOutput`` records.
* One DeepInfer output per token (several per step with speculative decoding); the adapter
  merges them into one ``RequestOutput`` per request per step.
* ``abort_request`` only marks ``FINISHED_ABORTED``: an aborted *running* request emits no
  terminal output, so the adapter emits one (``FinishReason.ABORT``) on the next step; an aborted
  *waiting* request emits an "ignored" output with a bogus token (its last prompt token), which
  is filtered out. Ignored outputs for other reasons (too long, preempted) become ERROR outputs
  without a token.
* Kept blocks: when a request finishes (stop/length) with ``keep_blocks``, its full blocks
  (``(len-1) // 128`` of them) are pinned through ``BlockManager.pin_blocks`` right after the
  terminal output is read. Under ZOS DeepInfer frees the sequence one step later
  (``finalize_seq`` in ``pre_sampler_sync``); the pin turns the sequence's ref into the cache's.
  ``release`` is ``unpin_blocks``. Block 0 and state slot 0 are DeepInfer's scratch.
* L1 copies and releases run on the worker's transfer thread, beside ``llm.step()``
  (``concurrent_transfers``): the cache refs, the locking and the CUDA fence that make that safe
  are in ``rank/deepinfer_transfers.py``; ``step`` records the fence after every DeepInfer call.
* Prefix start: ``LLMEngine.enqueue_with_prefix(seq, blocks, num_cached, swa_valid_start)``
  with ``num_cached = 128 * len(blocks) <= len(prompt) - 1`` and ``swa_valid_start =
  num_cached`` (the last matched block is replayed: ``usable_prefix_blocks`` in rank/engine.py).
* Fault isolation: ``llm.step()`` runs the whole batch (scheduler, model, sampler) with no
  per-request hook, so a value its sampler cannot run would fail every request of the step and
  the rank. ``add`` therefore checks the shared limits (``protocol/sampling.py``) and refuses
  with ``EngineMisuse`` before submit; an exception from ``step()`` itself is fatal to the rank
  (its collectives are in an unknown state) and the supervisor restarts the group.
* KV room: DeepInfer grows a sequence's blocks one at a time in decode and, when none is free,
  preempts the longest output (``stop_preempted_request``: it ends as
  ``insufficient_system_resource``, an ERROR output here). The cache grows each reply's
  reservation ahead of its decode (``cache/output_room.py``) and keeps cached + reserved blocks
  under the 0.9 prefill watermark, so this happens only when running sequences hold the pool.
* Without the patch (``patch_missing_reason`` names what is missing) the engine runs with the
  prefix cache off: ``prefix_cache_supported`` is False, ``prefix_cache_reason`` says why, and
  requests with prefix blocks are refused with ``EngineMisuse``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from protocol.sampling import sampling_error
from rank.deepinfer_settings import (
    DEEPINFER_BLOCK_SIZE,
    DeepInferSettings,
    apply_environment,
    import_deepinfer,
    patch_missing_reason,
)
from rank.deepinfer_transfers import DeepInferTransfers
from rank.engine import (
    Engine,
    EngineMisuse,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestOutput,
)
from rank.ids import BlockId
from rank.vote_filler import VoteFiller

if TYPE_CHECKING:
    import torch

    from rank.host_pool import HostPool

log = logging.getLogger(__name__)

_TOKEN_REASONS = {"": None, "stop": FinishReason.STOP, "length": FinishReason.LENGTH}


@dataclass(slots=True)
class _Req:
    request_id: str
    seq: Any
    num_prompt_tokens: int
    num_cached_tokens: int
    keep_blocks: bool
    num_output_tokens: int = 0


@dataclass(slots=True)
class _StepOutputs:
    """One step's outputs, one record per request, in first-seen order."""

    by_id: dict[str, RequestOutput] = field(default_factory=dict)

    def get(self, req: _Req) -> RequestOutput:
        out = self.by_id.get(req.request_id)
        if out is None:
            out = RequestOutput(req.request_id, [], num_prompt_tokens=req.num_prompt_tokens,
                                num_cached_tokens=req.num_cached_tokens)
            self.by_id[req.request_id] = out
        return out


class DeepInferEngine(Engine):
    """One rank's DeepInfer ``LLMEngine`` behind the ``Engine`` interface (module docstring).

    Invariants (``check_accounting``, between transfers): every block with a cache ref is in
    ``transfers.refs`` with the number of pins the adapter holds on it; every sequence DeepInfer
    may still hold blocks for is in ``_live_seqs()`` (an active request's, or one in
    ``_releasing``); free blocks =
    ``num_blocks - 1`` - |cache blocks U live tables|, and free state slots = slots - 1 - |live
    sequences holding a slot|. A request is in ``_active`` from ``add`` until the step that
    returns its terminal output, never after.
    """

    owns_lockstep = True
    concurrent_transfers = True  # rank/deepinfer_transfers.py

    def __init__(self, settings: DeepInferSettings, host_pool: HostPool | None = None,
                 api: Any = None) -> None:
        if api is None:
            apply_environment(settings.environment())
            api = import_deepinfer()
        self.api = api
        self.settings = settings
        missing = patch_missing_reason(api)
        self.patch_present = missing is None
        if not settings.prefix_cache:
            self.prefix_cache_supported = False
            self.prefix_cache_reason = "prefix_cache is off in the workload config"
        elif missing is not None:
            self.prefix_cache_supported = False
            self.prefix_cache_reason = (
                f"DeepInfer lacks the prefix-cache patch ({missing}); serving with the prefix cache OFF "
                "(apply patches/deepinfer-prefix-cache.patch, see docs/deepinfer.md)")
        else:
            self.prefix_cache_supported, self.prefix_cache_reason = True, "prefix-cache patch present"
        log_fn = log.info if self.prefix_cache_supported else log.warning
        log_fn("deepinfer rank %d: %s", settings.engine_rank, self.prefix_cache_reason)

        self.llm = api.LLMEngine.from_engine_args(settings.engine_args(api))
        self.block_size = int(self.llm.cache_config.block_size)
        if self.block_size != DEEPINFER_BLOCK_SIZE:
            raise RuntimeError(f"DeepInfer block size {self.block_size}, expected {DEEPINFER_BLOCK_SIZE}")
        self._bm = self.llm.block_manager
        self._sm = self.llm.state_manager
        self.num_blocks = int(self._bm.num_blocks
                              if self.patch_present else self.llm.cache_config.num_gpu_blocks)
        self._num_states = int(self._sm.num_blocks) if (self._sm is not None and self.patch_present) else 0
        self._vocab_size = int(self.llm.model_config.get_vocab_size())
        self._finished_status = int(api.SequenceStatus.FINISHED_STOPPED)
        self.bytes_per_block = int(self._gpu_blocks().shape[1])
        self.host_pool = host_pool
        if host_pool is not None:
            host_pool.open(self.bytes_per_block)
        self.transfers = DeepInferTransfers(self._bm, self._gpu_blocks, self.num_blocks, host_pool)
        self._active: dict[str, _Req] = {}
        self._aborting: list[str] = []
        self._owed: list[RequestOutput] = []  # terminal outputs the adapter emits next step
        self._stash: list[RequestOutput] = []  # outputs of placeholder_step(), returned next step
        self._releasing: list[Any] = []  # sequences of ended requests that DeepInfer may still hold
        self._vote: bool | None = None
        self.group_had_work = False  # the last collective vote (the same on every rank)
        self._inflight = False
        usable = self.patch_present and bool(api.votes_across_ranks)  # rank/vote_filler.py
        self._filler = VoteFiller.for_engine(self.llm, settings, usable, self._finished_status)
        self._num_cached_tokens_total = 0
        self._num_prompt_tokens_total = 0
        log.info("deepinfer rank %d: %d KV blocks x %d tokens, %d state slots", settings.engine_rank,
                 self.num_blocks, self.block_size, self._num_states)

    # ------------------------------------------------------------------ requests

    def add(self, request: EngineRequest) -> None:
        prompt = self._validate(request)
        prefix = [int(b) for b in request.prefix_blocks]
        sp = request.sampling
        sampling = {"temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k,
                    "max_tokens": sp.max_tokens, "ignore_eos": sp.ignore_eos, "seq_seed": sp.seed}
        seq = self.llm.add_request(user_id="backend", request_id=request.request_id, sampling_params=sampling,
                                   prompt_token_ids=prompt, enqueue=not prefix)
        req = _Req(request.request_id, seq, int(prompt.size), request.num_cached_tokens, request.keep_blocks)
        self._active[request.request_id] = req
        self._num_prompt_tokens_total += int(prompt.size)
        if seq is None:  # DeepInfer drops a request silently (e.g. ids outside its vocabulary)
            self._owe_terminal(req, FinishReason.ERROR,
                               "DeepInfer refused the request (invalid prompt token ids)")
            return
        if prefix:
            try:
                self.llm.enqueue_with_prefix(seq, prefix, request.num_cached_tokens,
                                             request.num_cached_tokens)
            except RuntimeError as exc:  # validated before any change on DeepInfer's side too
                del self._active[request.request_id]
                self._num_prompt_tokens_total -= int(prompt.size)
                raise EngineMisuse(
                    f"request {request.request_id!r}: DeepInfer refused the prefix: {exc}") from None
            self._num_cached_tokens_total += request.num_cached_tokens

    def _validate(self, request: EngineRequest) -> np.ndarray:
        rid = request.request_id
        if not isinstance(rid, str) or not rid:
            raise EngineMisuse(f"request_id must be a non-empty string, got {rid!r}")
        if rid in self._active:
            raise EngineMisuse(f"request {rid!r} is already queued or running")
        prompt = request.prompt_ids
        if (not isinstance(prompt, np.ndarray) or prompt.ndim != 1 or prompt.size == 0
                or prompt.dtype.kind not in "iu"):
            raise EngineMisuse(f"request {rid!r}: prompt_ids must be a non-empty 1-D integer array")
        if int(prompt.min()) < 0 or int(prompt.max()) >= self._vocab_size:
            raise EngineMisuse(f"request {rid!r}: token ids must be in [0, {self._vocab_size})")
        sp = request.sampling
        # llm.step() is batch-level: a value its sampler cannot run would fail every request of
        # the step (and the rank), so the shared limits are checked here, before submit.
        reason = sampling_error(sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed, self._vocab_size)
        if reason is not None:
            raise EngineMisuse(f"request {rid!r}: invalid sampling parameters: {reason}")
        prefix = list(request.prefix_blocks)
        num_cached = request.num_cached_tokens
        if num_cached != self.block_size * len(prefix):
            raise EngineMisuse(f"request {rid!r}: num_cached_tokens {num_cached} != {self.block_size} x "
                               f"{len(prefix)} prefix blocks")
        if prefix:
            if not self.prefix_cache_supported:
                raise EngineMisuse(f"request {rid!r}: prefix blocks given but {self.prefix_cache_reason}")
            if num_cached > prompt.size - 1:
                raise EngineMisuse(f"request {rid!r}: num_cached_tokens {num_cached} leaves nothing "
                                   f"to compute of a {prompt.size}-token prompt")
            # (a release of these blocks on the transfer thread waits for this add: rank/transfers.py)
            self.transfers.check_held(prefix, f"request {rid!r} prefix")
        return np.ascontiguousarray(prompt, dtype=np.int32)

    def abort(self, request_ids: Sequence[str]) -> None:
        to_abort = [rid
                    for rid in dict.fromkeys(request_ids)
                    if rid in self._active and rid not in self._aborting]
        if to_abort:
            self.llm.abort_request(to_abort)
            self._aborting.extend(to_abort)

    def has_work(self) -> bool:
        return bool(self._active or self._owed or self._stash or self.llm.scheduler.has_unfinished_seqs())

    # ------------------------------------------------------------------ stepping

    def lockstep_has_work(self) -> bool:
        """DeepInfer's collective vote (every rank, once per loop iteration, before ``step``)."""
        self._vote = self.group_had_work = bool(self.llm.has_unfinished_requests())
        return self._vote or bool(self._owed or self._stash or self._aborting)

    def step(self) -> list[RequestOutput]:
        vote, self._vote = self._vote, None
        if vote is False:
            ptrs = self.llm.flush_inflight_reqs() if self._inflight else np.empty(0, dtype=np.uint64)
            self._inflight = False
            self.transfers.fence()
        else:
            filler, group_min = self._filler, self.group_min
            if filler is not None and group_min is not None:
                seq = filler.before_step(group_min)
                if seq is not None:  # never active: its outputs are dropped, its blocks tracked
                    self._releasing.append(seq)
            ptrs = self.llm.step()
            self.transfers.fence()
            if filler is not None and group_min is not None:
                filler.after_step()
            self._inflight = True
        return self._finish_step(ptrs)

    def placeholder_step(self) -> None:
        self._vote = None
        outputs = self.step()  # (step() replaces self._stash: evaluate it first)
        self._stash.extend(outputs)

    def _finish_step(self, ptrs: np.ndarray) -> list[RequestOutput]:
        step = _StepOutputs()
        for out in self._stash:
            step.by_id[out.request_id] = out
        self._stash = []
        self._read_outputs(ptrs, step)  # now: the next llm.step() recycles them
        for rid in self._aborting:
            req = self._active.get(rid)
            if req is not None:
                self._owe_terminal(req, FinishReason.ABORT)
        self._aborting = []
        for out in self._owed:
            step.by_id.setdefault(out.request_id, out)
            prev = step.by_id[out.request_id]
            if prev is not out:  # tokens already merged this step are superseded by the terminal
                prev.finished, prev.finish_reason, prev.error = True, out.finish_reason, out.error
                prev.token_ids = []
        self._owed = []
        if self._releasing:  # only ended requests' sequences can have been freed since
            self._releasing = [s for s in self._releasing if not self._seq_released(s)]
        return list(step.by_id.values())

    def _read_outputs(self, ptrs: np.ndarray, step: _StepOutputs) -> None:
        """The hot path (one output per running sequence per step): three native reads per output.

        DeepInfer's ``build_request_outputs`` gives an output with ``finished`` false only for a
        token of a running request, and then its ``finish_reason`` is "" (an MTP step's earlier
        tokens included); ignored outputs (aborted, too long, preempted) are all ``finished``. So
        the reason is read only for finished outputs (``_read_terminal``).
        """
        ro = self.api.RequestOutput
        get_rid, get_token, get_finished = ro.get_request_id, ro.get_token_id, ro.get_finished
        active, by_id = self._active, step.by_id
        aborting = set(self._aborting)
        for ptr in ptrs.tolist():
            rid = get_rid(ptr)
            req = active.get(rid)
            if req is None or (aborting and rid in aborting):
                continue  # late or "ignored" output of a request already ended (or being aborted)
            if get_finished(ptr):
                self._read_terminal(ro, ptr, req, step)
                continue
            out = by_id.get(rid)
            if out is None:
                by_id[rid] = RequestOutput(rid, [get_token(ptr)], False, None, req.num_prompt_tokens,
                                           req.num_cached_tokens)
            else:  # several tokens of one request in a step (MTP)
                out.token_ids.append(get_token(ptr))
            req.num_output_tokens += 1

    def _read_terminal(self, ro: Any, ptr: int, req: _Req, step: _StepOutputs) -> None:
        reason = ro.get_finish_reason(ptr)
        if reason not in _TOKEN_REASONS:  # ignored: too long, preempted, ...; its token is bogus
            self._owe_terminal(req, FinishReason.ERROR, f"DeepInfer ended the request: {reason}")
            return
        out = step.get(req)
        out.token_ids.append(int(ro.get_token_id(ptr)))
        req.num_output_tokens += 1
        out.finished, out.finish_reason = True, _TOKEN_REASONS[reason] or FinishReason.STOP
        out.kept_blocks = self._harvest(req)
        self._end(req)

    def _harvest(self, req: _Req) -> list[BlockId]:
        """Pin a finished sequence's full blocks before DeepInfer frees the sequence."""
        if not (req.keep_blocks and self.prefix_cache_supported):
            return []
        seq_len = int(req.seq.get_len())
        assert seq_len == req.num_prompt_tokens + req.num_output_tokens, (seq_len, req)
        num_full = (seq_len - 1) // self.block_size
        table = list(req.seq.block_table)
        assert len(table) >= num_full and 0 not in table[:num_full], (req.request_id, table, num_full)
        kept = [int(b) for b in table[:num_full]]
        self.transfers.pin_kept(kept)
        return cast("list[BlockId]", kept)

    def _owe_terminal(self, req: _Req, reason: FinishReason, error: str | None = None) -> None:
        self._owed.append(RequestOutput(req.request_id, [], True, reason, req.num_prompt_tokens,
                                        req.num_cached_tokens, [], error))
        self._end(req)

    def _end(self, req: _Req) -> None:
        del self._active[req.request_id]
        if req.seq is not None:
            self._releasing.append(req.seq)

    def _live_seqs(self) -> list[Any]:
        """Every sequence DeepInfer may still hold blocks or a state slot for."""
        return [r.seq for r in self._active.values() if r.seq is not None] + self._releasing

    def _seq_released(self, seq: Any) -> bool:
        if int(seq.status) < self._finished_status:
            return False
        if not self.patch_present:
            return not self.llm.scheduler.has_unfinished_seqs()
        return not seq.block_table

    # ------------------------------------------------------------------ cache side

    def release(self, block_ids: Sequence[int]) -> None:
        self.transfers.release(block_ids)

    def _gpu_blocks(self) -> torch.Tensor:
        return cast("torch.Tensor", self.llm.driver_worker.cache_engine.gpu_blocks)  # [blocks, bpb] uint8

    def export_blocks(self, block_ids: Sequence[int], host_slot: int,
                      between: Callable[[], None] | None = None) -> None:
        self.transfers.export(block_ids, host_slot, between)

    def import_blocks(self, host_slot: int, num_blocks: int) -> list[BlockId]:
        return self.transfers.import_(host_slot, num_blocks)

    # ------------------------------------------------------------------ stats

    def stats(self) -> EngineStats:
        sched = self.llm.scheduler
        num_running, _ = sched.get_sum_prompt_len_running()
        num_waiting, _ = sched.get_sum_prompt_len_waiting()
        running_tokens = waiting_tokens = 0
        for req in self._active.values():
            if req.num_output_tokens:
                running_tokens += req.num_prompt_tokens + req.num_output_tokens
            else:
                waiting_tokens += req.num_prompt_tokens - req.num_cached_tokens
        return EngineStats(
            num_blocks=self.num_blocks, num_free_blocks=int(self._bm.get_num_free_blocks()),
            num_cached_blocks=len(self.transfers.refs), num_running=int(num_running),
            num_waiting=int(num_waiting),
            running_tokens=running_tokens, waiting_tokens=waiting_tokens,
            num_cached_tokens_total=self._num_cached_tokens_total,
            num_prompt_tokens_total=self._num_prompt_tokens_total,
            num_vote_fillers_total=self._filler.counts.added if self._filler is not None else 0)

    def transfer_stats(self, last: EngineStats) -> EngineStats:
        return dataclasses.replace(last, num_free_blocks=int(self._bm.get_num_free_blocks()),
                                   num_cached_blocks=len(self.transfers.refs))

    def _live_blocks(self) -> set[int]:
        held: set[int] = set()
        if self.patch_present:
            for seq in self._live_seqs():
                held.update(int(b) for b in seq.block_table)
        return held

    def check_accounting(self) -> None:
        free = int(self._bm.get_num_free_blocks())
        refs = dict(self.transfers.refs)
        assert all(n > 0 for n in refs.values()), refs
        if self.patch_present:
            held = self._live_blocks() | set(refs)
            assert 0 not in held, "block 0 handed out"
            assert free == self.num_blocks - 1 - len(held), (free, self.num_blocks, sorted(held))
            if self._sm is not None:
                slots = [int(s.state_id) for s in self._live_seqs() if s.block_table and int(s.state_id) > 0]
                assert len(slots) == len(set(slots)), f"state slot shared: {slots}"
                sm_free = int(self._sm.get_num_free_blocks())
                assert sm_free == self._num_states - 1 - len(slots), (sm_free, self._num_states, slots)
        elif not self.llm.scheduler.has_unfinished_seqs():
            assert free == self.num_blocks - 1 - len(refs), (free, self.num_blocks)

    def close(self) -> None:
        try:
            self.llm.close()
        finally:
            if self.host_pool is not None:
                self.host_pool.close()
