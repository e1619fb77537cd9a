"""The budget's cheap refusal bound (``min_tokens``) counts only the text from the first piece the
caches miss: a turn whose history is cached does not rescan it (request -> ids of a long session
stays proportional to its new part). Red before: every call counted all the client text."""

from __future__ import annotations

import random

import numpy as np
import pytest

import protocol.tokenize as T
from protocol.render import CLIENT, OURS
from protocol.tokenize import PromptTokenizer


def _text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    words = ["def", "return", "value", "self", "(", ")", ":", "\n", "    ", "x", "42"]
    return " ".join(rng.choice(words) for _ in range(n))


def test_cached_history_is_not_rescanned(tok: PromptTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = PromptTokenizer(tok.path)
    history, reply, new = _text(1, 40_000), "Reading the next file.", _text(2, 2_000)
    turn1 = [(OURS, "<｜begin▁of▁sentence｜><｜User｜>"), (CLIENT, history), (OURS, "<｜Assistant｜>")]
    turn2 = turn1 + [(CLIENT, reply), (OURS, "<｜end▁of▁sentence｜><｜User｜>"), (CLIENT, new),
                     (OURS, "<｜Assistant｜>")]
    budget = len(history) // 2  # fewer than the characters: the bound is worth counting
    fresh.encode_segments(turn1, max_tokens=budget)
    counted: list[int] = []
    real = T.min_tokens

    def counting(text: str) -> int:
        counted.append(len(text))
        return real(text)

    monkeypatch.setattr(T, "min_tokens", counting)
    ids = fresh.encode_segments(turn2, max_tokens=budget)
    assert sum(counted) <= len(reply) + len(new) + 64, "the cached history was counted again"
    assert np.array_equal(ids, PromptTokenizer(tok.path).encode_segments(turn2))
