"""Every scripted reply of every scenario parses back, through the real detokenizer and streaming
parser, into exactly the reasoning, text and tool calls the script wrote (thinking and chat mode,
token by token): the stand-in emits real V4.1 output, not something only it understands."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from protocol.detokenize import IncrementalDetokenizer, TokenTable
from protocol.parser import REASONING, TEXT, TOOL, StreamParser
from standins.scripted_engine import EOS_ID, load_tokenizer
from standins.scripted_replies import PromptView, Script, fill_template, fill_value, load_script, render_reply

SCENARIOS = sorted((Path(__file__).parent / "scenarios").glob("*.json"))


@functools.lru_cache(maxsize=1)
def _tok():
    return load_tokenizer()


@functools.lru_cache(maxsize=1)
def _table() -> TokenTable:
    return TokenTable(_tok())


def test_there_are_scenarios():
    assert len(SCENARIOS) >= 7


def _parse(ids: list[int], thinking: bool, chunk: int) -> tuple[str, str, list[tuple[str, dict]]]:
    detok = IncrementalDetokenizer(_table())
    parser = StreamParser(thinking=thinking)
    events = []
    for i in range(0, len(ids), chunk):
        events += parser.feed(detok.feed(ids[i : i + chunk]))
    events += parser.feed(detok.flush()) + parser.finish()
    reasoning = "".join(e[1] for e in events if e[0] == REASONING)
    text = "".join(e[1] for e in events if e[0] == TEXT)
    calls = [(e[1].name, e[1].arguments) for e in events if e[0] == TOOL]
    return reasoning, text, calls


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
@pytest.mark.parametrize("mode", ["thinking", "chat"])
def test_every_reply_parses_back(path: Path, mode: str):
    script: Script = load_script(path)
    values = {name: f"VALUE-OF-{name}" for name in script.vars}
    view = PromptView(prompt="", last_turn="", turn=1, mode=mode)
    for reply in [*script.replies, script.default]:
        assert reply.raw is None  # scenario scripts use the structured form
        unresolved: set[str] = set()
        text = render_reply(reply, view, values, unresolved)
        assert not unresolved, (reply.name, unresolved)  # every template names a declared var
        ids = _tok().encode(text, add_special_tokens=False).ids + [EOS_ID]
        for chunk in (1, 3, 64):
            reasoning, content, calls = _parse(ids, thinking=mode == "thinking", chunk=chunk)
            want_reasoning = fill_template(reply.reasoning, values, set()) if mode == "thinking" else ""
            assert reasoning == want_reasoning, reply.name
            assert content == fill_template(reply.text, values, set()).strip(), reply.name
            assert calls == [(c.name, fill_value(c.arguments, values, set()))
                             for c in reply.tool_calls], reply.name
