"""A session's next turn tokenizes only its new part (protocol/prompt_chunks.py), and what the
chunk cache holds never changes a prompt's ids or lets one caller's ledger turns into another's
prompt. The first test was red before the chunk cache: every turn walked the whole history."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

from protocol.api import Protocol
from protocol.detokenize import TokenTable
from protocol.errors import PromptTooLong
from protocol.prompt_chunks import ChunkCache
from protocol.render import CLIENT, OURS, Segment
from protocol.tokenize import PromptTokenizer
from tests.protocol.stream_helpers import EOS, MODEL, D, echo_assistant, run_stream


def _session(rounds: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Refactor the tokenizer module."}]
    for k in range(rounds):
        messages.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": f"Step {k}: read the next file.", "signature": "foreign"},
            {"type": "text", "text": f"Reading part {k}."},
            {"type": "tool_use", "id": f"toolu_{k:04d}", "name": "Read",
             "input": {"file_path": f"/src/m{k}.py"}},
        ]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{k:04d}",
             "content": f"def f{k}(x):\n    return x + {k}\n" * 20}]})
    return {"model": MODEL, "max_tokens": 256, "thinking": {"type": "adaptive"},
            "system": "You are an agent.",
            "tools": [{"name": "Read", "input_schema": {"type": "object",
                                                        "properties": {"file_path": {"type": "string"}}}}],
            "messages": messages}


def _uncached(proto: Protocol, table: TokenTable) -> Protocol:
    """A protocol with the same tokenizer and ledger whose chunk cache keeps nothing."""
    other = Protocol(proto.tokenizer, proto.ledger, [MODEL], proto.max_model_len, table=table)
    other.chunks = ChunkCache(max_bytes=0)
    return other


def test_next_turn_tokenizes_only_its_new_part(proto: Protocol, table: TokenTable,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    body = _session(40)
    prev = dict(body, messages=body["messages"][:-2])
    proto.prepare_anthropic(prev, {})
    walked: list[int] = []
    encode = proto.tokenizer.encode_segments

    def counting(segments: Any, *args: Any, **kwargs: Any) -> np.ndarray:
        segments = list(segments)
        walked.append(len(segments))
        return encode(segments, *args, **kwargs)

    monkeypatch.setattr(proto.tokenizer, "encode_segments", counting)
    ids = proto.prepare_anthropic(body, {}).prompt_ids
    monkeypatch.undo()
    # the new assistant turn and tool result render to ~20 segments; the prompt has ~800
    assert 0 < sum(walked) <= 40, f"walked {walked} segments for a two-message turn"
    assert np.array_equal(ids, _uncached(proto, table).prepare_anthropic(body, {}).prompt_ids)


def test_one_callers_prompts_are_not_reused_for_another(proto: Protocol) -> None:
    """The chunk cache is found per caller: caller B sending caller A's exact history reuses
    nothing of A's (how fast B's turn is tokenized says nothing about what A sent); A's own next
    turn reuses its history."""
    body = _session(12)
    prev = dict(body, messages=body["messages"][:-2])
    proto.prepare_anthropic(prev, {}, scope=b"caller-a")
    hits = proto.chunks.stats.num_hits
    b = proto.prepare_anthropic(body, {}, scope=b"caller-b")
    assert proto.chunks.stats.num_hits == hits
    a = proto.prepare_anthropic(body, {}, scope=b"caller-a")
    assert proto.chunks.stats.num_hits > hits
    assert np.array_equal(a.prompt_ids, b.prompt_ids)


def test_a_changed_history_is_tokenized_again(proto: Protocol, table: TokenTable) -> None:
    body = _session(12)
    proto.prepare_anthropic(body, {})
    for k, edit in ((3, "Reading part 3!"), (10, "")):  # an edit deep in the history; an emptied block
        changed = copy.deepcopy(body)
        changed["messages"][2 * k + 1]["content"][1]["text"] = edit
        ids = proto.prepare_anthropic(changed, {}).prompt_ids
        assert np.array_equal(ids, _uncached(proto, table).prepare_anthropic(changed, {}).prompt_ids)
    changed = copy.deepcopy(body)
    changed["messages"][5]["content"][2]["input"]["file_path"] = "/src/other.py"
    ids = proto.prepare_anthropic(changed, {}).prompt_ids
    assert np.array_equal(ids, _uncached(proto, table).prepare_anthropic(changed, {}).prompt_ids)


def test_ledger_turns_stay_with_their_caller(proto: Protocol, tok: PromptTokenizer,
                                             table: TokenTable) -> None:
    """Caller A's session has a generated turn in the ledger, its reasoning hidden from the client
    (display "omitted"); caller B sends A's exact history after A's prompts filled the chunk
    cache: B's prompt holds the client's rendering (no reasoning), A's the ledger ids, each
    exactly what a protocol without the chunk cache gives."""
    body = dict(_session(3), stream=True, thinking={"type": "adaptive", "display": "omitted"})
    p1 = proto.prepare_anthropic(body, {}, scope=b"caller-a")
    out = (f"Secret plan.</think>Reading.\n\n<{D} calls>\n<{D} invoke name=\"Read\">\n"
           f"<{D} parameter name=\"file_path\" string=\"true\">/p/a</{D} parameter>\n</{D} invoke>\n</{D} "
           f"calls>{EOS}")
    _, data, out_ids = run_stream(proto, p1, out, tok)
    assistant = echo_assistant(data)
    body2 = copy.deepcopy(body)
    body2["messages"] += [assistant, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": assistant["content"][-1]["id"], "content": "ok"}]}]
    uncached = _uncached(proto, table)
    for _ in range(2):  # the second round reads chunks the first one stored
        a = proto.prepare_anthropic(body2, {}, scope=b"caller-a")
        b = proto.prepare_anthropic(body2, {}, scope=b"caller-b")
        assert a.num_ledger_hits == 1 and b.num_ledger_hits == 0
        full = p1.prompt_ids.tolist() + out_ids
        assert a.prompt_ids[: len(full)].tolist() == full
        assert b.prompt_ids[: len(full)].tolist() != full
        secret = tok.encode_text("Secret plan.").tolist()
        assert _holds(a.prompt_ids.tolist(), secret) and not _holds(b.prompt_ids.tolist(), secret)
        for got, scope in ((a, b"caller-a"), (b, b"caller-b")):
            assert np.array_equal(got.prompt_ids,
                                  uncached.prepare_anthropic(body2, {}, scope=scope).prompt_ids)
        assert a.ledger_binding != b.ledger_binding


def test_reused_history_over_the_limit_is_refused(proto: Protocol) -> None:
    """Chunks reused from the cache still count against the context limit: the turn is refused
    with an estimate above the limit, as when it is tokenized."""
    body = _session(20)
    num_ids = len(proto.prepare_anthropic(body, {}).prompt_ids)
    proto.max_model_len = num_ids // 2
    with pytest.raises(PromptTooLong) as refused:
        proto.prepare_anthropic(body, {})
    assert refused.value.max_prompt_tokens == num_ids // 2 - 1
    assert refused.value.num_prompt_tokens > num_ids // 2 - 1
    assert proto.chunks.stats.num_hits > 0


def _holds(ids: list[int], part: list[int]) -> bool:
    return any(ids[k : k + len(part)] == part for k in range(len(ids) - len(part) + 1))


def _prompt(n: int, tag: str) -> list[Segment]:
    turns: list[Segment] = [(OURS, "<｜begin▁of▁sentence｜><｜User｜>"), (CLIENT, f"head {tag}"),
                            (OURS, "<｜Assistant｜></think>")]
    for k in range(n):
        turns += [(CLIENT, f"reply {k} " * 50), (OURS, "<｜end▁of▁sentence｜><｜User｜>"),
                  (CLIENT, f"result {k}"), (OURS, "<｜Assistant｜></think>")]
    return turns


def test_chunk_cache_bounds() -> None:
    cache = ChunkCache(max_bytes=1 << 20, per_head=2)
    for tag in ("a", "a", "a", "b"):
        segments = _prompt(3, tag)
        view = cache.view(segments, 3)
        view.put(segments, 0, len(segments), np.arange(len(segments), dtype=np.int32), 10)
        view.finish(keep=True)
    assert cache.stats.num_prompts == 3 and cache.stats.num_evictions == 1  # two per head
    small = ChunkCache(max_bytes=4_000)
    for tag in "abcdef":
        segments = _prompt(2, tag)
        view = small.view(segments, 3)
        view.put(segments, 0, len(segments), np.arange(600, dtype=np.int32), 10)
        view.finish(keep=True)
    assert 0 < small.stats.num_bytes <= 4_000 and small.stats.num_evictions >= 4
    segments = _prompt(2, "f")
    assert small.view(segments, 3).get(segments, 0, len(segments)) is not None  # the newest is kept
