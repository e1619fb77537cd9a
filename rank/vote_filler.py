"""The vote filler: a rank with nothing to prefill no longer vetoes DeepInfer's ALL vote points.

DeepInfer picks each step's type by a vote across the ranks (``scheduler.hpp`` ``_schedule``;
the ``deepinfer==0.1.0`` sdist, ``docs/deepinfer.md``): at an ALL point (``decode_step % 70 ==
0``, 0 included) a prompt step runs only if *every* rank wants one (KV usage <= 0.9 and a waiting
head), at an ANY point (``decode_step % 100 == 0``, not 0) if one does. A prompt step resets
``decode_step`` to 0, so right after it comes an ALL point: prompts that the step's token budget
(``max_num_batched_tokens`` per rank) left waiting go at once only if every rank still has one
waiting. Under agent load that is rarely so: the rank whose queue the step emptied votes no, and
the others' leftovers wait for the next ANY point, 100 decode steps (~4 s at 500K contexts).
In the simulator that wait is most of the TTFT tail at 500K x 200 (docs/loadtest.md, "The vote
filler": engine part p95 7.6-10.2 s -> 3.6-3.8 s, TTFT p95 15.1-17.6 s -> 12.4-13.1 s).

The filler, at an ALL point that is not an ANY point (one rank already suffices there): the
ranks exchange, in one all_reduce MIN on the worker's side group, whether each can vote yes
(it wants a prompt step, or it has nothing waiting and its usage is under the watermark) and
whether one of them wants one with a head that can start now. If every rank can and one does,
each rank with nothing waiting adds a one-token request (``max_tokens`` 1) before ``step``: its
vote is yes, the prompt step runs, the filler's prefill is one token and it ends in that step.
The adapter never reports it (its id is never an active request's); one still unfinished after
the step (the vote went the other way after all) is aborted. The price is the prompt steps
themselves: the decode pauses for them sooner and more often (simulated decode tok/s p50 55 ->
46-50 at 500K x 200), for prompts that would otherwise run ~4 s later.

Guards. A step of fillers alone would pass DeepInfer's second vote (something was scheduled),
reset ``decode_step`` to 0 and come back to the same ALL point: the loop that second vote exists
to stop. So a rank counts as wanting only with a head that can start now (blocks, a state slot,
``max_num_seqs``), and the filler stops after ``MAX_STREAK`` prompt steps in a row.

Lockstep. Every rank must run the collective in the same iterations. ``decode_step`` is equal on
every rank (DeepInfer's own votes keep it so) and the adapter calls ``before_step`` only in
iterations where the group steps, so they do. Only DeepInfer's real Scheduler votes across the
ranks; the CI stand-in's own scheduler decides per rank (its ``decode_step`` differs between
ranks), so it declares ``votes_across_ranks`` False and the filler stays off over it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rank.deepinfer_settings import DeepInferSettings

log = logging.getLogger(__name__)

MAX_STREAK = 8  # prompt steps in a row after which no filler is added (bench/simulator imports it)
WATERMARK = float(np.float32(0.9))  # scheduler.hpp GPU_CACHE_PREFILL_WATERMARK (a C++ float)
FILLER_PREFIX = "vote-filler-"
_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 1, "ignore_eos": True}


def is_all_only_point(decode_step: int, all_interval: int, any_interval: int) -> bool:
    """An ALL vote point that is not an ANY point (where they coincide DeepInfer counts ANY)."""
    if decode_step % all_interval:
        return False
    return decode_step == 0 or decode_step % any_interval != 0


@dataclass(frozen=True, slots=True)
class RankVote:
    """What one rank brings to the filler's collective."""

    can_vote_yes: bool  # wants a prompt step, or could take a filler
    wants_and_can_start: bool  # wants one, and its head would be scheduled now

    def encode(self) -> list[int]:  # for an all_reduce MIN
        return [int(self.can_vote_yes), int(not self.wants_and_can_start)]


def group_passes(reduced: list[int]) -> bool:
    """The MIN over every rank's ``RankVote.encode``: all can vote yes and one wants."""
    return reduced[0] == 1 and reduced[1] == 0


@dataclass(slots=True)
class FillerCounts:
    added: int = 0  # fillers added
    aborted: int = 0  # fillers the step did not finish


class VoteFiller:
    """One rank's filler (module docstring). ``llm`` is DeepInfer's ``LLMEngine`` (with the
    prefix-cache patch: ``Sequence.block_table``, ``BlockManager.num_blocks``); ``before_step``
    takes the worker's all_reduce MIN over the ranks' side group (``Engine.group_min``). Filler
    ids (``vote-filler-<rank>-<n>``) cannot meet a served request's: the server numbers those
    behind a random hex prefix (``server/app.py`` ``RequestIds``)."""

    def __init__(self, llm: Any, rank: int, all_interval: int, any_interval: int, max_num_seqs: int,
                 finished_status: int) -> None:
        self.llm = llm
        self.all_interval = all_interval
        self.any_interval = any_interval
        self.max_num_seqs = max_num_seqs
        self._finished_status = finished_status
        self._ids = (f"{FILLER_PREFIX}{rank}-{n}" for n in itertools.count())
        self._pending: tuple[str, Any] | None = None
        self.streak = 0  # prompt steps in a row, as every rank saw them
        self.counts = FillerCounts()

    @classmethod
    def for_engine(cls, llm: Any, settings: DeepInferSettings, usable: bool,
                   finished_status: int) -> VoteFiller | None:
        """The rank's filler, or None: off in the config, one rank (ALL and ANY are the same
        vote), or not ``usable`` (DeepInfer without the patch's API, ``Sequence.block_table``, or
        a stand-in whose scheduler votes per rank)."""
        if not (settings.vote_filler and settings.ep > 1 and usable):
            return None
        return cls(llm, settings.engine_rank, settings.prefill_attempt_interval,
                   settings.prefill_any_attempt_interval, settings.max_num_seqs, finished_status)

    def local_vote(self) -> RankVote:
        """This rank's side of the collective, read as DeepInfer's ``_schedule`` would."""
        sched, bm = self.llm.scheduler, self.llm.block_manager
        total = int(bm.num_blocks)
        free = int(bm.get_num_free_blocks())
        under = (total - free) / total <= WATERMARK
        num_waiting, _ = sched.get_sum_prompt_len_waiting()
        if not num_waiting:
            return RankVote(can_vote_yes=under, wants_and_can_start=False)
        return RankVote(can_vote_yes=under, wants_and_can_start=under and self._head_can_start(free))

    def _head_can_start(self, free_blocks: int) -> bool:
        """DeepInfer's ``_can_allocate_with_state`` for the head, plus ``max_num_seqs``."""
        sched = self.llm.scheduler
        num_running, _ = sched.get_sum_prompt_len_running()
        if int(num_running) >= self.max_num_seqs:
            return False
        head = sched.waiting[0]
        block_size = int(self.llm.cache_config.block_size)
        need = -(-int(head.get_len()) // block_size) - len(head.block_table)
        if need <= 0:
            return True  # a chunked prompt holds its blocks already
        states = self.llm.state_manager
        return need <= free_blocks and (states is None or int(states.get_num_free_blocks()) > 0)

    def before_step(self, group_min: Callable[[list[int]], list[int]]) -> Any | None:
        """At an ALL-only point: the collective, then a filler if this rank has nothing waiting
        and the group passes. Returns the filler's sequence (the adapter tracks its blocks)."""
        step = int(self.llm.scheduler.decode_step)
        if not is_all_only_point(step, self.all_interval, self.any_interval):
            return None
        vote = self.local_vote()
        passes = group_passes(group_min(vote.encode())) and self.streak < MAX_STREAK
        num_waiting, _ = self.llm.scheduler.get_sum_prompt_len_waiting()
        if not passes or num_waiting:
            return None
        rid = next(self._ids)
        prompt = np.zeros(1, dtype=np.int32)
        seq = self.llm.add_request(user_id="backend", request_id=rid, sampling_params=dict(_SAMPLING),
                                   prompt_token_ids=prompt)
        if seq is None:  # cannot happen for token 0; never leave the vote to chance
            log.warning("DeepInfer refused a vote filler")
            return None
        self.counts.added += 1
        self._pending = (rid, seq)
        return seq

    def after_step(self) -> None:
        """Count the step (the streak) and abort a filler the step did not finish."""
        self.streak = self.streak + 1 if int(self.llm.scheduler.decode_step) == 0 else 0
        if self._pending is None:
            return
        rid, seq = self._pending
        self._pending = None
        if int(seq.status) < self._finished_status:
            self.llm.abort_request([rid])
            self.counts.aborted += 1
