"""Request bodies look like Claude Code's and grow as its conversations do; text hits its size."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from bench.loadgen.client import _StreamState
from bench.loadgen.distributions import TurnSpec, WorkloadParams
from bench.loadgen.report import Criteria, verdict
from bench.loadgen.session import AgentSession, build_tools
from bench.loadgen.textgen import TextSynth


@pytest.fixture(scope="module")
def synth() -> TextSynth:
    return TextSynth(corpus_tokens=8_192)


def test_text_tokenizes_to_the_wanted_count(synth: TextSynth) -> None:
    rng = np.random.default_rng(0)
    for n in (1, 17, 500, 4_000, 20_000):  # 20K > corpus: concatenated slices
        assert abs(synth.count(synth.text(n, rng)) - n) <= max(2, n // 200)


def test_body_shape_and_growth(synth: TextSynth) -> None:
    params = WorkloadParams(context_target_tokens=16_000)
    tools = build_tools(params, synth)
    rng = np.random.default_rng(1)
    s = AgentSession(params, synth, tools, rng, 8_000, "deepseek-v4.1-flash")
    body = s.body(64)
    assert list(body)[:10] == ["model", "messages", "system", "tools", "metadata", "max_tokens", "thinking",
                               "context_management", "output_config", "stream"]
    assert len(body["tools"]) == 24 and body["thinking"] == {"type": "adaptive"}
    assert body["system"][0]["text"].startswith("x-anthropic-billing-header:")
    assert body["messages"][1]["role"] == "system"
    markers = orjson.dumps(body).count(b'"cache_control"')
    assert markers == 3
    assert s.headers()["X-Claude-Code-Session-Id"] == s.session_id
    # the rendered size is close to the requested initial context
    text = orjson.dumps([body["system"], body["tools"], body["messages"]]).decode()
    assert synth.count(text) == pytest.approx(8_000, rel=0.35)
    before = orjson.dumps(s.body(64)["messages"][:-1])
    blocks = [{"type": "thinking", "thinking": "x", "signature": "sig"}, {"type": "text", "text": "hi"},
              {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
              {"type": "tool_use", "id": "toolu_2", "name": "Read", "input": {"file_path": "/a"}}]
    s.append_response(blocks, TurnSpec("tool", 400, 50, 2, True, 3.0))
    after = s.body(64)["messages"]
    assert after[-2] == {"role": "assistant", "content": blocks}
    assert [b["tool_use_id"] for b in after[-1]["content"]] == ["toolu_1", "toolu_2"]
    assert after[-1]["content"][-1]["cache_control"] == {"type": "ephemeral"}
    # earlier messages are unchanged apart from the moving marker
    marker = b',"cache_control":{"type":"ephemeral"}'
    earlier = orjson.dumps(after[: len(orjson.loads(before))])
    assert earlier.replace(marker, b"") == before.replace(marker, b"")


def test_sse_assembly_of_blocks() -> None:
    st = _StreamState()
    events = [
        ("message_start",
         {"type": "message_start",
          "message": {"usage": {"input_tokens": 10, "cache_read_input_tokens": 90}}}),
        ("content_block_start",
         {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}}),
        ("content_block_delta",
         {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "ab"}}),
        ("content_block_delta",
         {"type": "content_block_delta", "index": 0,
          "delta": {"type": "signature_delta", "signature": "s1"}}),
        ("content_block_start",
         {"type": "content_block_start", "index": 1,
          "content_block": {"type": "tool_use", "id": "t", "name": "Bash", "input": {}}}),
        ("content_block_delta",
         {"type": "content_block_delta", "index": 1,
          "delta": {"type": "input_json_delta", "partial_json": '{"a":'}}),
        ("content_block_delta",
         {"type": "content_block_delta", "index": 1,
          "delta": {"type": "input_json_delta", "partial_json": "1}"}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        ("message_delta",
         {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 7}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    for name, data in events:
        st.handle(name, data)
    assert st.ordered_blocks() == [{"type": "thinking", "thinking": "ab", "signature": "s1"},
                                   {"type": "tool_use", "id": "t", "name": "Bash", "input": {"a": 1}}]
    assert st.usage == {"input_tokens": 10, "cache_read_input_tokens": 90, "output_tokens": 7}
    assert st.stop_reason == "tool_use" and st.done


def test_verdict_uses_the_seed_criteria() -> None:
    good = {"ttft_p95_s": 14.8, "tok_s_p50": 35, "tok_s_p10": 16, "cache_hit": 0.98, "error_rate": 0.0}
    assert verdict(good, Criteria()) == ("pass", [])
    word, failed = verdict({**good, "ttft_p95_s": 37.0, "error_rate": 0.01}, Criteria())
    assert word == "fail" and len(failed) == 2
