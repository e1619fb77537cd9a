"""Streaming parser on the real V4 tokenizer: the corpus, and split-invariance properties."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.detokenize import IncrementalDetokenizer, TokenTable
from protocol.parser import REASONING, TEXT, TOOL, StreamParser
from protocol.tokenize import PromptTokenizer
from protocol_corpus import CASES, TOOLS


@pytest.fixture(scope="module")
def table(tok: PromptTokenizer) -> TokenTable:
    return TokenTable(tok.full)


def encode_out(tok: PromptTokenizer, parts: list[Any]) -> list[int]:
    ids: list[int] = []
    for p in parts:
        if isinstance(p, tuple):
            ids += tok.encode_plain(p[1]).tolist()
        else:
            ids += tok.encode_text(p).tolist()
    return ids


def normalize(events: list[tuple[int, Any]]) -> list[tuple]:
    out: list[tuple] = []
    for kind, payload in events:
        if kind == TOOL:
            out.append(("call", payload.name, payload.arguments))
        else:
            tag = "r" if kind == REASONING else "t"
            if out and out[-1][0] == tag:
                out[-1] = (tag, out[-1][1] + payload)
            else:
                out.append((tag, payload))
    return out


def run(table: TokenTable, case: dict, ids: list[int], chunks: list[int] | None = None) -> list[tuple]:
    detok = IncrementalDetokenizer(table)
    parser = StreamParser(case["thinking"], TOOLS, case.get("tools_enabled", True))
    events: list[tuple[int, Any]] = []
    pos = 0
    for n in chunks or [len(ids)]:
        events += parser.feed(detok.feed(ids[pos : pos + n]))
        pos += n
    events += parser.feed(detok.feed(ids[pos:]))
    events += parser.feed(detok.flush()) + parser.finish()
    return normalize(events)


def test_corpus_is_large_enough() -> None:
    assert len(CASES) >= 30
    assert len({c["name"] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_corpus_case(tok: PromptTokenizer, table: TokenTable, case: dict) -> None:
    ids = encode_out(tok, case["out"])
    assert run(table, case, ids) == case["events"]
    # token by token gives the same events
    assert run(table, case, ids, [1] * len(ids)) == case["events"]


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_every_char_split_same_events(case: dict, tok: PromptTokenizer, table: TokenTable) -> None:
    """Feed the detokenized text with every single split point and in single characters."""
    ids = encode_out(tok, case["out"])
    text = IncrementalDetokenizer(table).feed(ids)
    expected = case["events"]

    def parse(pieces: list[str]) -> list[tuple]:
        p = StreamParser(case["thinking"], TOOLS, case.get("tools_enabled", True))
        ev: list[tuple[int, Any]] = []
        for piece in pieces:
            ev += p.feed(piece)
        return normalize(ev + p.finish())

    for k in range(len(text) + 1):
        assert parse([text[:k], text[k:]]) == expected, k
    assert parse(list(text)) == expected


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_token_chunking_same_events(data: st.DataObject, tok: PromptTokenizer, table: TokenTable) -> None:
    case = data.draw(st.sampled_from(CASES))
    ids = encode_out(tok, case["out"])
    chunks: list[int] = []
    left = len(ids)
    while left > 0:
        n = data.draw(st.integers(min_value=1, max_value=max(1, min(left, 8))))
        chunks.append(n)
        left -= n
    assert run(table, case, ids, chunks) == case["events"]


def test_multibyte_char_split_across_tokens(tok: PromptTokenizer, table: TokenTable) -> None:
    # byte-level BPE splits rare characters into several tokens; no feed may yield half a char
    text = "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ 🧪🧬"
    ids = tok.encode_text(text).tolist()
    assert len(ids) > 3
    detok = IncrementalDetokenizer(table)
    pieces = [detok.feed([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_model_spelled_noncharacter_cannot_pose_as_tag(tok: PromptTokenizer, table: TokenTable) -> None:
    ids = tok.encode_plain("a\ufdd1b").tolist()  # the sentinel of </think>, spelled as bytes
    parser = StreamParser(True, TOOLS)
    events = parser.feed(IncrementalDetokenizer(table).feed(ids)) + parser.finish()
    assert normalize(events) == [("r", "a\ufffdb")]


def test_long_random_text_round_trips(tok: PromptTokenizer, table: TokenTable) -> None:
    rng = random.Random(7)
    alphabet = "abc <>/｜\n\t{}\"'=é世🎉"
    text = "".join(rng.choice(alphabet) for _ in range(3000))
    ids = tok.encode_plain(text).tolist()
    case = {"thinking": False}
    got = run(table, case, ids, [rng.randint(1, 5) for _ in range(len(ids))])
    assert got == [("t", text)]  # trailing whitespace of real text is kept at the end
