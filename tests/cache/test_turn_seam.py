"""``Turn``'s seam: a caller drives the turn through its methods and reads a frozen view of its
admission; nothing it holds is the manager's to change. Over a recording stand-in of the three
manager calls a turn makes (``make_room``, ``finish``, ``abort``), so each call is counted."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from cache.sessions import SessionId, StopKind
from cache.turns import Admission, AdmissionView, Tier, TierTokens, Turn
from rank.engine import FinishReason, RequestOutput
from rank.ids import BlockHash, BlockId, Epoch, Rank


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def make_room(self, adm: Admission, num_output_tokens: int) -> None:
        self.calls.append(("make_room", num_output_tokens))

    def finish(self, adm: Admission, prompt: np.ndarray, output: np.ndarray, last: RequestOutput,
               stop_kind: StopKind) -> None:
        self.calls.append(("finish", output.tolist(), stop_kind))

    def abort(self, adm: Admission) -> None:
        self.calls.append(("abort",))


def _admission() -> Admission:
    return Admission(
        rank=Rank(1), prefix_blocks=[BlockId(3)], num_cached_tokens=16,
        cached_tokens_by_tier=TierTokens(l0=16), queue_time_s=0.5, restore_s=0.0,
        session_id=SessionId("hint:a"), epoch=Epoch(1), keep_blocks=True, num_prompt_tokens=40,
        hashes=[BlockHash(7)], num_used_blocks=1, reserved_blocks=2, max_output_tokens=64,
    )


def _turn() -> tuple[Turn, _Recorder, Admission]:
    rec, adm = _Recorder(), _admission()
    turn = Turn(rec, adm, np.arange(40, dtype=np.int32))  # type: ignore[arg-type]
    return turn, rec, adm


def _out(*ids: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", list(ids), finished=finished,
                         finish_reason=FinishReason.STOP if finished else None,
                         kept_blocks=[BlockId(4)] if finished else [])


def test_the_caller_reads_a_frozen_copy_of_the_admission() -> None:
    turn, _, adm = _turn()
    view = turn.admission
    assert isinstance(view, AdmissionView) and not isinstance(view, Admission)
    assert (view.rank, view.num_cached_tokens, view.max_output_tokens) == (1, 16, 64)
    assert view.session_id == "hint:a" and view.num_prompt_tokens == 40
    assert not hasattr(view, "reserved_blocks") and not hasattr(view, "hashes")  # the manager's receipt
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.num_cached_tokens = 0  # type: ignore[misc]
    view.cached_tokens_by_tier[Tier.L0] = 0
    assert adm.cached_tokens_by_tier[Tier.L0] == 16  # a copy: the manager's count is untouched


@pytest.mark.parametrize("field", ["admission", "output_ids", "last_output", "prompt_ids", "rank"])
def test_the_turns_state_is_not_writable(field: str) -> None:
    turn, _, _ = _turn()
    with pytest.raises(AttributeError):
        setattr(turn, field, None)


def test_output_ids_is_a_copy() -> None:
    turn, _, _ = _turn()
    turn.feed(_out(5, 6))
    ids = turn.output_ids
    assert ids == (5, 6) and turn.num_output_tokens == 2
    with pytest.raises(AttributeError):
        ids.append(7)  # type: ignore[attr-defined]
    assert turn.output_ids == (5, 6)


def test_feed_grows_the_room_per_output_and_feed_batch_once() -> None:
    turn, rec, _ = _turn()
    turn.feed(_out(5))
    turn.feed(_out())  # no new token: no room to grow
    assert turn.feed_batch([_out(6, 7), _out(), _out(8)]) == [6, 7, 8]
    assert rec.calls == [("make_room", 1), ("make_room", 4)]
    assert turn.last_output is not None and turn.last_output.token_ids == [8]


def test_kept_outputs_grow_no_room_and_are_filed() -> None:
    """After the caller stopped listening, ``keep`` records the rest; the terminal output that
    handed blocks over is filed by ``settle`` with every id (fed and kept)."""
    turn, rec, _ = _turn()
    turn.feed(_out(5))
    turn.keep(_out(6))
    turn.keep(_out(7, finished=True))
    turn.stop_kind = StopKind.TOOL_USE
    turn.settle()
    assert rec.calls == [("make_room", 1), ("finish", [5, 6, 7], StopKind.TOOL_USE)]
    assert turn.settled
    turn.abort()  # a second settle is a no-op
    assert len(rec.calls) == 2


def test_stop_kind_takes_a_stop_kind_only() -> None:
    turn, _, _ = _turn()
    turn.stop_kind = StopKind.END_TURN
    assert turn.stop_kind is StopKind.END_TURN
    with pytest.raises(ValueError):
        turn.stop_kind = "tool-ish"  # type: ignore[assignment]


def test_settle_without_a_terminal_output_aborts() -> None:
    turn, rec, _ = _turn()
    turn.feed(_out(5))
    turn.settle()
    assert rec.calls == [("make_room", 1), ("abort",)]
