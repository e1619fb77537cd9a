"""Streaming parser on the real V4 tokenizer: the corpus, and split-invariance properties."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from protocol.detokenize import IncrementalDetokenizer, TokenTable
from protocol.parser import REASONING, TOOL, TOOL_ARGS, TOOL_START, StreamParser
from protocol.tokenize import PromptTokenizer
from tests.protocol.protocol_corpus import CASES, TOOLS


def encode_out(tok: PromptTokenizer, parts: list[Any]) -> list[int]:
    ids: list[int] = []
    for p in parts:
        if isinstance(p, tuple):
            ids += tok.encode_plain(p[1]).tolist()
        else:
            ids += tok.encode_text(p).tolist()
    return ids


def normalize(events: list[tuple[int, Any]]) -> list[tuple]:
    """Merged events; a call's streamed start and argument deltas are checked against its
    complete event (same index and name, joined deltas == arguments_json) and folded into it;
    a call started but never completed (cut) becomes ("cut", name)."""
    out: list[tuple] = []
    open_call: list[Any] | None = None  # [index, name, joined argument text]
    for kind, payload in events:
        if kind == TOOL_START:
            assert open_call is None, "a call started before the previous one completed"
            open_call = [payload[0], payload[1], ""]
        elif kind == TOOL_ARGS:
            assert open_call is not None, "argument delta outside a call"
            open_call[2] += payload
        elif kind == TOOL:
            assert open_call is not None and open_call[:2] == [payload.index, payload.name]
            assert open_call[2] == payload.arguments_json, (open_call[2], payload.arguments_json)
            assert json.loads(payload.arguments_json) == payload.arguments
            open_call = None
            out.append(("call", payload.name, payload.arguments))
        else:
            assert open_call is None, "text inside a call"
            tag = "r" if kind == REASONING else "t"
            if out and out[-1][0] == tag:
                out[-1] = (tag, out[-1][1] + payload)
            else:
                out.append((tag, payload))
    if open_call is not None:
        out.append(("cut", open_call[1]))
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
def test_random_token_chunking_same_events(data: st.DataObject, tok: PromptTokenizer,
                                           table: TokenTable) -> None:
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


# --- streamed tool arguments -----------------------------------------------------------
def _feed_text(parser: StreamParser, pieces: list[str]) -> list[tuple[int, Any]]:
    events: list[tuple[int, Any]] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def test_argument_deltas_arrive_before_the_invoke_closes(tok: PromptTokenizer, table: TokenTable) -> None:
    from tests.protocol.protocol_corpus import block, inv, par

    value = "line one\nline two with \"quotes\" and <angle> brackets\n" * 4
    ids = encode_out(tok, [block(inv("Bash", par("command", value), par("timeout", "9", "false")))])
    close_at = len(IncrementalDetokenizer(table).feed(ids).rsplit("</", 2)[0])  # start of </invoke>
    detok = IncrementalDetokenizer(table)
    parser = StreamParser(False, TOOLS)
    seen = ""
    streamed_before_close = ""
    for i in ids:
        text = detok.feed([i])
        for kind, payload in parser.feed(text):
            if kind == TOOL_ARGS and len(seen) < close_at:
                streamed_before_close += payload
        seen += text
    # the whole string value went out (escaped, in pieces) before the invoke closed
    assert streamed_before_close.startswith('{"command":"line one\\nline two with \\"quotes\\"')
    assert len(streamed_before_close) > len(value)
    assert parser.num_arg_mismatches == 0


_VALUE_ALPHABET = ["a", "b", " ", "\n", "<", ">", "/", '"', "\\", "{", "}", "1", "世", "\ufdd2", "</\ufdd2 x",
                   "<\ufdd2 y"]


@settings(max_examples=150, deadline=None)
@given(
    params=st.lists(
        st.tuples(
            st.sampled_from(["command", "timeout", "arguments", "input", "x"]),
            st.lists(st.sampled_from(_VALUE_ALPHABET), max_size=12).map("".join),
            st.sampled_from(["true", "false", None]),
            st.booleans(),
        ),
        max_size=4,
    ),
    name=st.sampled_from(["Bash", "Read", "Wrap", "Other"]),
    cuts=st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=40),
)
def test_random_invokes_stream_to_the_final_json(params: list, name: str, cuts: list[int]) -> None:
    """Random parameters (sentinels, fake tags, missing closes, wrappers, duplicates): for any
    chunking, the argument deltas join to the call's final arguments JSON."""
    d = "\ufdd2"
    body = "".join(
        f'<{d} parameter name="{k}"' + (f' string="{s}"' if s else "") + ">" + v
        + (f"</{d} parameter>" if close else "")
        for k, v, s, close in params
    )
    text = f'\n\n<{d} calls>\n<{d} invoke name="{name}">\n{body}\n</{d} invoke>\n</{d} calls>\ufdd3'
    pieces, pos, k = [], 0, 0
    while pos < len(text):
        n = cuts[k % len(cuts)]
        pieces.append(text[pos : pos + n])
        pos, k = pos + n, k + 1
    whole = StreamParser(False, TOOLS)
    expected = normalize(_feed_text(whole, [text]))
    split = StreamParser(False, TOOLS)
    assert normalize(_feed_text(split, pieces)) == expected  # normalize checks joined == final
    assert whole.num_arg_mismatches == split.num_arg_mismatches == 0
