"""Protocol state under l2_dir: the segment log, and history that repeats the generated ids
after a backend restart (the output ledger and the piece cache replayed from disk)."""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import pytest

from protocol.api import Protocol
from protocol.ledger import LedgerEntry, OutputLedger
from protocol.tokenize import PromptTokenizer
from server.persist import SegmentLog, load_or_create_key, open_protocol_state

LOG_KEY = b"L" * 32
MODEL = "deepseek-v4.1-flash"
D = "｜DSML｜"
EOS = "<｜end▁of▁sentence｜>"


# ------------------------------------------------------------------------------------ segment log

def test_segment_log_replays_in_order_and_cuts_a_torn_tail(tmp_path) -> None:
    d = str(tmp_path / "log")
    log = SegmentLog(d, 1 << 20, "stamp-a", key=LOG_KEY)
    log.put(b"k1", b"v1")
    log.put(b"k2", b"v2" * 100)
    log.put(b"k1", b"v1-new")
    log.close()
    (seg,) = os.listdir(d)
    with open(os.path.join(d, seg), "ab") as f:
        f.write(b"\x05\x00\x00\x00\x09\x00")  # a record cut by a kill mid-write
    log2 = SegmentLog(d, 1 << 20, "stamp-a", key=LOG_KEY)
    assert list(log2.replay()) == [(b"k1", b"v1"), (b"k2", b"v2" * 100), (b"k1", b"v1-new")]
    log2.put(b"k3", b"v3")  # goes to a fresh segment after the cut one
    log2.close()
    replayed = [k for k, _ in SegmentLog(d, 1 << 20, "stamp-a", key=LOG_KEY).replay()]
    assert replayed == [b"k1", b"k2", b"k1", b"k3"]


def test_segment_log_of_another_stamp_starts_empty(tmp_path, caplog) -> None:
    d = str(tmp_path / "log")
    log = SegmentLog(d, 1 << 20, "model:tokenizer-A", key=LOG_KEY)
    log.put(b"k", b"ids of tokenizer A")
    log.close()
    with caplog.at_level(logging.WARNING):
        other = SegmentLog(d, 1 << 20, "model:tokenizer-B", key=LOG_KEY)
    assert list(other.replay()) == [] and os.listdir(d) == []
    assert "another tokenizer" in caplog.text


def test_segment_log_is_bounded_and_refresh_keeps_used_keys(tmp_path) -> None:
    d = str(tmp_path / "log")
    log = SegmentLog(d, 64 << 10, "s", key=LOG_KEY, segment_bytes=8 << 10)
    value = bytes(1000)
    log.put(b"hot", b"hot value")
    for i in range(300):  # ~300 KB through a 64 KiB log
        log.put(f"k{i}".encode(), value)
        log.refresh(b"hot", lambda: b"hot value")
        assert log.num_bytes <= 64 << 10
    log.close()
    assert sum(os.path.getsize(os.path.join(d, n)) for n in os.listdir(d)) <= 64 << 10
    replayed = dict(SegmentLog(d, 64 << 10, "s", key=LOG_KEY).replay())
    assert replayed[b"hot"] == b"hot value" and b"k0" not in replayed and b"k299" in replayed


def test_segment_log_write_errors_cost_persistence_only(tmp_path, caplog) -> None:
    d = tmp_path / "log"
    log = SegmentLog(str(d), 1 << 20, "s", key=LOG_KEY)
    log.put(b"a", b"1")
    log.close()
    for name in os.listdir(d):
        os.unlink(d / name)
    os.rmdir(d)
    d.write_text("a file where the directory was")  # makedirs and writes now fail
    with caplog.at_level(logging.WARNING):
        log.put(b"b", b"2")
        log.put(b"c", b"3")
    assert caplog.text.count("write failed") == 1  # rate limited, no exception


def test_ledger_key_persists_with_owner_only_mode(tmp_path) -> None:
    path = str(tmp_path / "p" / "ledger.key")
    key = load_or_create_key(path)
    assert len(key) == 32 and load_or_create_key(path) == key
    assert os.stat(path).st_mode & 0o777 == 0o600


# ---------------------------------------------------------------------------- history after restart

def _turn(proto: Protocol, prepared: Any, out_ids: list[int]) -> dict[str, Any]:
    stream = proto.new_stream(prepared, "req1")
    stream.start(0)
    for i in out_ids:
        stream.feed([i])
    stream.finish("stop", prepared.num_prompt_tokens, 0, len(stream.output_ids))
    return stream.response_body()


def _next_body(body: dict[str, Any], message: dict[str, Any]) -> dict[str, Any]:
    hist = {"role": "assistant", "content": message["content"], "tool_calls": message["tool_calls"]}
    call_id = message["tool_calls"][0]["id"]
    result = {"role": "tool", "tool_call_id": call_id, "content": "42"}
    return {**body, "messages": body["messages"] + [hist, result]}


def test_history_repeats_generated_ids_after_a_restart(tmp_path) -> None:
    l2_dir = str(tmp_path / "l2")
    tools = [{"type": "function", "function": {"name": "Read", "parameters": {
        "type": "object", "properties": {"file_path": {"type": "string"}, "limit": {"type": "integer"}}}}}]
    body = {"model": MODEL, "tools": tools, "messages": [
        {"role": "system", "content": "You are a coding agent. " * 200},
        {"role": "user", "content": "Read /p/a please."}]}

    tok = PromptTokenizer.load(cache_bytes=64 << 20)
    ledger, logs = open_protocol_state(l2_dir, MODEL, tok)
    proto = Protocol(tok, ledger, [MODEL], 1_064_960)
    p1 = proto.prepare_openai(body, {})
    # Ids the model could generate but a re-render would not reproduce: "Reading" split into
    # single characters, and compact JSON in a string="false" parameter.
    text = "Plan.</think>"
    out_ids = tok.encode_text(text).tolist() + [int(t) for ch in "Reading" for t in tok.encode_text(ch)]
    out_ids += tok.encode_text(f"\n\n<{D} calls>\n<{D} invoke name=\"Read\">\n"
                               f"<{D} parameter name=\"file_path\" string=\"true\">/p/a</{D} parameter>\n"
                               f"<{D} parameter name=\"limit\" string=\"false\">10</{D} parameter>\n"
                               f"</{D} invoke>\n</{D} calls>{EOS}").tolist()
    message = _turn(proto, p1, out_ids)["choices"][0]["message"]
    assert message["tool_calls"], message
    body2 = _next_body(body, message)
    full = p1.prompt_ids.tolist() + out_ids
    for log in logs:
        log.close()

    # Control: a backend without the persisted ledger re-renders the turn, and the ids differ.
    fresh = Protocol(tok, OutputLedger(), [MODEL], 1_064_960)
    assert fresh.prepare_openai(body2, {}).prompt_ids[: len(full)].tolist() != full

    # The restarted backend: a new tokenizer and ledger, replayed from l2_dir.
    tok2 = PromptTokenizer.load(cache_bytes=64 << 20)
    ledger2, logs2 = open_protocol_state(l2_dir, MODEL, tok2)
    assert ledger2.stats.num_restored == 1 and tok2.cache.stats.num_entries > 0
    proto2 = Protocol(tok2, ledger2, [MODEL], 1_064_960)
    p2 = proto2.prepare_openai(body2, {})
    assert p2.num_ledger_hits == 1 and p2.num_ledger_divergences == 0
    assert p2.prompt_ids[: len(full)].tolist() == full
    assert tok2.cache.stats.num_hits > 0  # the long system prompt came from the persisted pieces
    for log in logs2:
        log.close()


def test_ledger_entry_encoding_round_trips() -> None:
    from protocol.ledger import decode_entry, encode_entry

    calls = (("Read", {"file_path": "/p", "n": [1, 2.5, None]}), ("Bash", "not json"))
    ids = np.asarray([1, 2, 2**31 - 1], dtype=np.int32)
    entry = LedgerEntry(b"x" * 16, ids, True, 1, "why", ("a", "b"), calls, b"p" * 16)
    back = decode_entry(entry.entry_id, encode_entry(entry))
    assert back.binding == b"p" * 16
    assert back.output_ids.tolist() == entry.output_ids.tolist() and back.output_ids.dtype == np.int32
    assert (back.thinking, back.think_end, back.reasoning, back.text_parts) == (True, 1, "why", ("a", "b"))
    assert back.calls == entry.calls
    with pytest.raises(ValueError):
        decode_entry(b"y" * 16, b"\x05\x00\x00\x00{bad")


def test_unusable_l2_dir_gives_an_in_memory_ledger(tmp_path, caplog) -> None:
    blocker = tmp_path / "l2"
    blocker.write_text("a file, not a directory")
    tok = PromptTokenizer.load(cache_bytes=1 << 20)
    with caplog.at_level(logging.WARNING):
        ledger, logs = open_protocol_state(str(blocker), MODEL, tok)
    assert logs == [] and isinstance(ledger, OutputLedger) and "in memory only" in caplog.text


def test_an_entry_that_cannot_be_encoded_stays_in_memory(tmp_path) -> None:
    log = SegmentLog(str(tmp_path / "ledger"), 1 << 20, "s", key=LOG_KEY)
    ledger = OutputLedger(key=b"k" * 32, log=log)
    entry = LedgerEntry(b"z" * 16, np.asarray([5], dtype=np.int32), False, -1, "", ("x",),
                        (("Calc", {"n": 2**70}),), b"b" * 16)  # wider than JSON numbers orjson writes
    ledger.record(entry)  # no exception reaches the request
    assert ledger.match(b"b" * 16, None, None, ["x"], [("Calc", {"n": 2**70})], strict_parts=False) is entry
    log.close()
    assert list(SegmentLog(str(tmp_path / "ledger"), 1 << 20, "s", key=LOG_KEY).replay()) == []
