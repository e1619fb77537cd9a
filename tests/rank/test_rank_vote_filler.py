"""rank/vote_filler.py: when a rank queues a filler, what its vote carries, when a filler is aborted.

The scheduler here is a small double of the reads the filler makes of DeepInfer's (the same
names as the pybind API); the filler against DeepInfer's real compiled Scheduler, voting across
two rank processes, is ``tests/deepinfer/test_deepinfer_vote_filler.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from rank.vote_filler import MAX_STREAK, RankVote, VoteFiller, group_passes, is_all_only_point

FINISHED = 3  # SequenceStatus.FINISHED_STOPPED


@dataclass
class _Seq:
    length: int
    block_table: list[int] = field(default_factory=list)
    status: int = 0

    def get_len(self) -> int:
        return self.length


@dataclass
class _Blocks:
    num_blocks: int
    free: int

    def get_num_free_blocks(self) -> int:
        return self.free


@dataclass
class _Scheduler:
    waiting: list[_Seq] = field(default_factory=list)
    num_running: int = 0
    decode_step: int = 0

    def get_sum_prompt_len_waiting(self) -> tuple[int, int]:
        return len(self.waiting), sum(s.length for s in self.waiting)

    def get_sum_prompt_len_running(self) -> tuple[int, int]:
        return self.num_running, 0


class _LLM:
    def __init__(self, free: int = 90, num_blocks: int = 100, state_slots: int = 4) -> None:
        self.scheduler = _Scheduler()
        self.block_manager = _Blocks(num_blocks, free)
        self.state_manager = _Blocks(16, state_slots)
        self.cache_config = type("C", (), {"block_size": 128})()
        self.added: list[tuple[str, Any]] = []
        self.aborted: list[str] = []

    def add_request(self, **kw: Any) -> _Seq:
        assert kw["sampling_params"]["max_tokens"] == 1 and kw["prompt_token_ids"].size == 1
        seq = _Seq(1)
        self.added.append((kw["request_id"], seq))
        self.scheduler.waiting.append(seq)
        return seq

    def abort_request(self, ids: list[str]) -> None:
        self.aborted.extend(ids)


def _filler(llm: _LLM, max_num_seqs: int = 8) -> VoteFiller:
    return VoteFiller(llm, rank=1, all_interval=70, any_interval=100, max_num_seqs=max_num_seqs,
                      finished_status=FINISHED)


@pytest.mark.parametrize("step,expected", [(0, True), (70, True), (140, True), (700, False), (1400, False),
                                           (100, False), (35, False), (1, False)])
def test_all_only_points(step: int, expected: bool) -> None:
    # 700 = 10 x 70 = 7 x 100: both kinds of point, which DeepInfer counts as ANY (one rank suffices).
    assert is_all_only_point(step, 70, 100) is expected


def test_group_passes_only_if_every_rank_can_and_one_wants() -> None:
    votes = [RankVote(True, True), RankVote(True, False)]
    assert group_passes([min(v) for v in zip(*(x.encode() for x in votes))])
    assert not group_passes([min(v) for v in zip(*(x.encode() for x in [RankVote(True, False)] * 2))])
    over = [RankVote(True, True), RankVote(False, False)]  # a rank over the watermark vetoes anyway
    assert not group_passes([min(v) for v in zip(*(x.encode() for x in over))])


def test_a_rank_with_nothing_waiting_queues_a_filler_when_a_peer_wants() -> None:
    llm = _LLM()
    filler = _filler(llm)
    sent: list[list[int]] = []

    def peer_wants(mine: list[int]) -> list[int]:  # the other rank: can vote yes, wants, head fits
        sent.append(mine)
        return [min(a, b) for a, b in zip(mine, [1, 0])]

    seq = filler.before_step(peer_wants)
    assert sent == [[1, 1]]  # this rank: can vote yes (under the watermark), wants nothing
    assert seq is not None and [s for _, s in llm.added] == [seq]
    seq.status = FINISHED  # the prompt step ran it
    llm.scheduler.decode_step = 0
    filler.after_step()
    assert llm.aborted == [] and filler.streak == 1 and filler.counts.added == 1


def test_no_filler_off_the_all_points_or_when_the_group_does_not_pass() -> None:
    llm = _LLM()
    filler = _filler(llm)
    calls: list[list[int]] = []

    def record(values: list[int]) -> list[int]:
        calls.append(values)
        return values

    llm.scheduler.decode_step = 35  # not a vote point: no collective at all
    assert filler.before_step(record) is None and calls == []
    llm.scheduler.decode_step = 100  # an ANY point: one rank suffices, no filler needed
    assert filler.before_step(record) is None and calls == []
    llm.scheduler.decode_step = 70  # ALL point, but nobody wants: the collective runs, no filler
    assert filler.before_step(record) is None and calls == [[1, 1]] and llm.added == []


def test_a_rank_with_its_own_prompt_waiting_adds_no_filler_and_says_whether_it_can_start() -> None:
    llm = _LLM(free=50)
    llm.scheduler.waiting.append(_Seq(length=1000))  # needs 8 blocks: fits in 50
    filler = _filler(llm)
    seen: list[list[int]] = []
    assert filler.before_step(lambda v: seen.append(v) or [1, 0]) is None
    assert seen == [[1, 0]] and llm.added == []

    assert filler.local_vote() == RankVote(True, True)
    llm.block_manager.free = 11  # 89% used: still under the watermark, but the head needs 8 > ...
    llm.scheduler.waiting[0] = _Seq(length=1600)  # ... 13 blocks: it cannot start now
    assert filler.local_vote() == RankVote(True, False)
    llm.block_manager.free = 9  # 91% used: over DeepInfer's 0.9 watermark, its vote is no
    assert filler.local_vote() == RankVote(False, False)


def test_a_head_that_cannot_start_does_not_count_as_wanting() -> None:
    llm = _LLM(free=50)
    filler = _filler(llm, max_num_seqs=4)
    llm.scheduler.waiting.append(_Seq(length=300))
    llm.scheduler.num_running = 4  # max_num_seqs running: DeepInfer would schedule nothing
    assert filler.local_vote() == RankVote(True, False)
    llm.scheduler.num_running = 3
    llm.state_manager.free = 0  # no state slot left
    assert filler.local_vote() == RankVote(True, False)
    # A chunked prompt holds all its blocks already: it can go on whatever is free.
    llm.scheduler.waiting[0] = _Seq(length=300, block_table=[5, 6, 7])
    assert filler.local_vote() == RankVote(True, True)


def test_a_filler_the_step_did_not_run_is_aborted() -> None:
    llm = _LLM()
    filler = _filler(llm)
    seq = filler.before_step(lambda v: [1, 0])
    assert seq is not None
    llm.scheduler.decode_step = 1  # the step was a decode step after all
    filler.after_step()
    assert llm.aborted == [llm.added[0][0]] and filler.counts.aborted == 1 and filler.streak == 0


def test_the_streak_of_prompt_steps_stops_the_filler() -> None:
    llm = _LLM()
    filler = _filler(llm)
    for _ in range(MAX_STREAK):
        seq = filler.before_step(lambda v: [1, 0])
        assert seq is not None
        seq.status = FINISHED
        llm.scheduler.waiting.clear()
        filler.after_step()  # decode_step stays 0: a prompt step each time
    assert filler.streak == MAX_STREAK
    calls: list[list[int]] = []
    assert filler.before_step(lambda v: calls.append(v) or [1, 0]) is None
    assert len(calls) == 1  # the collective still runs on every rank (lockstep), the filler does not
    llm.scheduler.decode_step = 1
    filler.after_step()
    assert filler.streak == 0
