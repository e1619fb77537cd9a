"""Unit tests of the scripted stand-in model (standins/scripted_engine.py): token level and blocks.

The Engine contract runs over it and the other engines in tests/engines/test_engine_contract.py.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rank.engine import EngineMisuse, EngineRequest, FinishReason, RequestOutput, SamplingParams
from rank.host_pool import HostPool
from standins.scripted_engine import (
    ASSISTANT_ID,
    END_THINK_ID,
    EOS_ID,
    THINK_ID,
    USER_ID,
    ScriptedEngine,
    load_tokenizer,
)
from standins.scripted_replies import Script, ScriptError, load_script

DSML_ID = 128825
BS = 16


@functools.lru_cache(maxsize=1)
def _tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


def make_script(**kw) -> Script:
    base = {
        "tokens_per_step": 3,
        "vars": {"cwd": "Primary working directory: (\\S+)",
                 "count": {"regex": "(\\d+) lines", "in": "last_turn", "occurrence": "last"}},
        "replies": [
            {"name": "read", "turn": 1, "match": "README",
             "reasoning": "I should read the file.",
             "tool_calls": [{"name": "Read", "arguments": {"file_path": "{{cwd}}/README.md", "limit": 50}}]},
            {"name": "two", "turn": 1, "match": "both",
             "text": "Running both.",
             "tool_calls": [{"name": "Bash", "arguments": {"command": "ls"}},
                            {"name": "Read", "arguments": {"file_path": "/x", "flags": [1, True, None]}}]},
            {"name": "answer", "turn": 2, "reasoning": "Got it.", "text": "It has {{count}} lines."},
            {"name": "regex", "match_regex": "colou?r", "not_match": "green", "text": "a colour"},
            {"name": "anywhere", "prompt_match": "SECRET", "text": "found the secret"},
        ],
        "default": {"name": "fallback", "text": "no idea"},
    }
    base.update(kw)
    return Script.model_validate(base)


def prompt_ids(tok, turns: list[str], thinking: bool = True,
               system: str = "You are a careful coding agent. " * 6
               + "Primary working directory: /tmp/proj") -> np.ndarray:
    """BOS system <User>t0<Assistant>...: earlier turns get a canned answer + EOS."""
    ids = [0] + tok.encode(system + "\n", add_special_tokens=False).ids
    for i, turn in enumerate(turns):
        ids += [USER_ID] + tok.encode(turn, add_special_tokens=False).ids + [ASSISTANT_ID]
        if i < len(turns) - 1:
            ids += [THINK_ID] if thinking else [END_THINK_ID]
            ids += tok.encode("ok</think>done", add_special_tokens=False).ids + [EOS_ID]
    ids.append(THINK_ID if thinking else END_THINK_ID)
    return np.asarray(ids, dtype=np.int32)


def make_engine(tok, script: Script | None = None, num_blocks: int = 64, **kw) -> ScriptedEngine:
    return ScriptedEngine(script or make_script(), tok, block_size=BS, num_blocks=num_blocks,
                          max_model_len=kw.pop("max_model_len", 4096),
                          max_num_batched_tokens=kw.pop("mnbt", 40), **kw)


def req(rid: str, ids: np.ndarray, max_tokens: int = 1000, **kw) -> EngineRequest:
    return EngineRequest(rid, ids,
                         SamplingParams(max_tokens=max_tokens, ignore_eos=kw.pop("ignore_eos", False)), **kw)


def run(engine: ScriptedEngine) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(10_000):
        if not engine.has_work():
            break
        for out in engine.step():
            assert out.request_id not in outs or not outs[out.request_id][-1].finished
            outs.setdefault(out.request_id, []).append(out)
        engine.check_accounting()
    assert not engine.has_work()
    return outs


def all_ids(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def test_thinking_mode_tool_call_tokens(tok):
    eng = make_engine(tok)
    eng.add(req("a", prompt_ids(tok, ["What is in README.md?"])))
    outs = run(eng)["a"]
    ids = all_ids(outs)
    expected = ('I should read the file.</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="Read">\n'
                '<｜DSML｜ parameter name="file_path" string="true">'
                '/tmp/proj/README.md</｜DSML｜ parameter>\n'
                '<｜DSML｜ parameter name="limit" string="false">50</｜DSML｜ parameter>\n'
                '</｜DSML｜ invoke>\n</｜DSML｜ calls>')
    assert tok.decode(ids, skip_special_tokens=False) == expected + "<｜end▁of▁sentence｜>"
    assert ids[-1] == EOS_ID and ids.count(EOS_ID) == 1
    assert ids.count(END_THINK_ID) == 1 and ids.count(DSML_ID) == 8  # </think> and ｜DSML｜ are single ids
    assert all(len(o.token_ids) <= 3 for o in outs) and len(outs) >= len(ids) // 3  # streamed
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.STOP
    assert sum(o.finished for o in outs) == 1


def test_chat_mode_drops_reasoning_and_parallel_calls(tok):
    eng = make_engine(tok)
    eng.add(req("a", prompt_ids(tok, ["do both"], thinking=False)))
    ids = all_ids(run(eng)["a"])
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("Running both.\n\n<｜DSML｜ calls>\n")
    assert END_THINK_ID not in ids
    assert text.count("<｜DSML｜ invoke name=") == 2
    assert '<｜DSML｜ parameter name="flags" string="false">[1, true, null]</｜DSML｜ parameter>' in text


def test_matching_turn_vars_regex_default(tok):
    eng = make_engine(tok)
    cases = {
        "t2": (["What is in README.md?", "<tool_result>12 lines\n40 lines</tool_result>"],
               "Got it.</think>It has 40 lines."),
        "re": (["which color is it"], "</think>a colour"),
        "notre": (["which color is green"], "</think>no idea"),
        "def": (["hello"], "</think>no idea"),
    }
    for rid, (turns, _) in cases.items():
        eng.add(req(rid, prompt_ids(tok, turns)))
    eng.add(req("sec", prompt_ids(tok, ["x"], system="SECRET here")))
    outs = run(eng)
    for rid, (_, want) in cases.items():
        assert tok.decode(all_ids(outs[rid]), skip_special_tokens=False) == want + "<｜end▁of▁sentence｜>"
    assert tok.decode(all_ids(outs["sec"]), skip_special_tokens=False).startswith("</think>found the secret")


def test_unresolved_var_is_visible(tok):
    eng = make_engine(tok)
    eng.add(req("a", prompt_ids(tok, ["What is in README.md?"], system="no dir here")))
    text = tok.decode(all_ids(run(eng)["a"]), skip_special_tokens=False)
    assert "<unresolved:cwd>/README.md" in text


def test_max_tokens_and_ignore_eos(tok):
    eng = make_engine(tok)
    eng.add(req("cut", prompt_ids(tok, ["What is in README.md?"]), max_tokens=5))
    eng.add(req("pad", prompt_ids(tok, ["hello"]), max_tokens=40, ignore_eos=True))
    outs = run(eng)
    assert len(all_ids(outs["cut"])) == 5 and outs["cut"][-1].finish_reason is FinishReason.LENGTH
    pad = all_ids(outs["pad"])
    assert len(pad) == 40 and EOS_ID not in pad and outs["pad"][-1].finish_reason is FinishReason.LENGTH


def test_prompt_over_max_model_len_is_an_error_output(tok):
    eng = make_engine(tok, max_model_len=256)
    eng.add(req("a", np.arange(2, 300, dtype=np.int32)))
    out = run(eng)["a"]
    assert out[-1].finish_reason is FinishReason.ERROR and "max_model_len" in out[-1].error
    assert eng.stats().num_free_blocks == eng.num_blocks - 1


def test_keep_blocks_prefix_reuse_and_release(tok):
    eng = make_engine(tok)
    p1 = prompt_ids(tok, ["What is in README.md?"])
    eng.add(req("t1", p1))
    first = run(eng)["t1"]
    out_ids = all_ids(first)
    kept = first[-1].kept_blocks
    assert len(kept) == (len(p1) + len(out_ids) - 1) // BS
    assert eng.stats().num_cached_blocks == len(kept)
    # Next turn: history = p1 + output, then a tool result; start from the kept blocks.
    p2 = np.concatenate([p1, np.asarray(out_ids, np.int32),
                         prompt_ids(tok, ["<tool_result>7 lines</tool_result>"])[-12:]])
    n_prefix = len(kept) - 1  # the last matched block is replayed
    eng.add(req("t2", p2, prefix_blocks=kept[:n_prefix], num_cached_tokens=n_prefix * BS))
    second = run(eng)["t2"]
    assert second[-1].finish_reason is FinishReason.STOP and second[-1].num_cached_tokens == n_prefix * BS
    assert second[-1].kept_blocks[:n_prefix] == kept[:n_prefix]
    assert eng.stats().num_cached_tokens_total == n_prefix * BS
    eng.release(kept)
    eng.release(second[-1].kept_blocks)
    eng.check_accounting()
    assert eng.stats().num_free_blocks == eng.num_blocks - 1 and eng.stats().num_cached_blocks == 0


def test_prefix_mismatch_is_reported_not_answered(tok):
    eng = make_engine(tok)
    p1 = prompt_ids(tok, ["What is in README.md?"])
    eng.add(req("t1", p1))
    kept = run(eng)["t1"][-1].kept_blocks
    other = p1.copy()
    other[3] += 1  # differs inside the first block
    eng.add(req("bad", other, prefix_blocks=kept[:2], num_cached_tokens=2 * BS))
    out = run(eng)["bad"]
    assert out[-1].finish_reason is FinishReason.ERROR and "position 3" in out[-1].error
    assert eng.num_prefix_mismatches == 1 and out[-1].kept_blocks == []
    eng.release(kept)
    assert eng.stats().num_free_blocks == eng.num_blocks - 1


def test_no_capacity_alone_is_error_but_waits_behind_running(tok):
    eng = make_engine(tok, num_blocks=6)
    eng.add(req("huge", np.arange(2, 200, dtype=np.int32)))
    out = run(eng)["huge"]
    assert out[-1].finish_reason is FinishReason.ERROR and "no KV capacity" in out[-1].error
    eng2 = make_engine(tok, num_blocks=8)
    eng2.add(req("a", np.arange(2, 60, dtype=np.int32), keep_blocks=False))
    eng2.add(req("b", np.arange(2, 60, dtype=np.int32), keep_blocks=False))
    outs = run(eng2)
    assert (outs["a"][-1].finish_reason is FinishReason.STOP
            and outs["b"][-1].finish_reason is FinishReason.STOP)


def test_export_import_round_trip_keeps_content(tok, tmp_path):
    pool = HostPool(str(tmp_path / "l1"), budget_bytes=32 * BS * 4, pin=False)
    eng = make_engine(tok, host_pool=pool)
    other = make_engine(tok, host_pool=HostPool(str(tmp_path / "l1"), budget_bytes=32 * BS * 4, pin=False))
    p1 = prompt_ids(tok, ["What is in README.md?"])
    eng.add(req("t1", p1))
    kept = run(eng)["t1"][-1].kept_blocks
    eng.export_blocks(kept[:3], host_slot=10)
    eng.release(kept)
    restored = eng.import_blocks(10, 3)
    assert eng.stats().num_cached_blocks == 3
    eng.add(req("t2", p1, prefix_blocks=restored[:2], num_cached_tokens=2 * BS))
    assert run(eng)["t2"][-1].finish_reason is FinishReason.STOP  # content check passed
    eng.release(restored)
    eng.check_accounting()
    # Another rank maps the same file: it restores the blocks too, and a wrong slot is caught.
    moved = other.import_blocks(10, 3)
    other.add(req("t3", p1, prefix_blocks=moved[:2], num_cached_tokens=2 * BS))
    assert run(other)["t3"][-1].finish_reason is FinishReason.STOP
    wrong = other.import_blocks(11, 2)
    other.add(req("t4", p1, prefix_blocks=wrong, num_cached_tokens=2 * BS))
    out = run(other)["t4"][-1]
    assert out.finish_reason is FinishReason.ERROR and "differ from the prompt" in out.error
    with pytest.raises(EngineMisuse):
        other.import_blocks(31, 2)  # past the pool's 32 slots
    with pytest.raises(EngineMisuse):
        make_engine(tok).export_blocks(moved[:1], 0)  # no host pool
    eng.close()
    other.close()


def test_load_script_errors_name_the_field(tmp_path: Path):
    bad = tmp_path / "s.json"
    bad.write_text(json.dumps({"replies": [{"turn": 0, "text": "x"}]}))
    with pytest.raises(ScriptError, match=r"replies\.0\.turn"):
        load_script(bad)
    bad.write_text("{not json")
    with pytest.raises(ScriptError, match="not valid JSON"):
        load_script(bad)
    bad.write_text(json.dumps({"replies": [{"raw": "x", "text": "y"}]}))
    with pytest.raises(ScriptError, match="raw"):
        load_script(bad)
    with pytest.raises(ScriptError, match="cannot read"):
        load_script(tmp_path / "missing.json")


def test_scenario_scripts_are_valid():
    scen = Path(__file__).parent / "scenarios"
    files = sorted(scen.glob("*.json"))
    for f in files:
        assert load_script(f).replies, f


ops = st.lists(st.tuples(st.sampled_from(["add", "prefix", "step", "abort", "release"]), st.integers(0, 50)),
               min_size=1, max_size=60)


@settings(max_examples=40, deadline=None)
@given(ops)
def test_accounting_holds_under_random_operations(program):
    eng = make_engine(_tokenizer(), num_blocks=24)
    cache_held: list[int] = []
    live: list[str] = []
    n = 0
    for op, arg in program:
        if op in ("add", "prefix"):
            n += 1
            prompt = np.arange(2, 2 + 5 + arg * 3, dtype=np.int32)
            usable = cache_held[: max(0, (len(prompt) - 1) // BS)]
            prefix = usable[:1] if op == "prefix" and usable else []
            try:
                eng.add(req(f"r{n}", prompt, max_tokens=1 + arg % 30, prefix_blocks=prefix,
                            num_cached_tokens=BS * len(prefix), keep_blocks=arg % 3 != 0))
                live.append(f"r{n}")
            except EngineMisuse:
                pass  # a prefix block holding other tokens: that request is reported at admission
        elif op == "step":
            for out in eng.step():
                if out.finished:
                    cache_held += out.kept_blocks
        elif op == "abort" and live:
            eng.abort([live[arg % len(live)]])
        elif op == "release" and cache_held:
            eng.release([cache_held.pop(arg % len(cache_held))])
        eng.check_accounting()
    for out in run(eng).values():
        cache_held += out[-1].kept_blocks
    for block in cache_held:  # one at a time: a block kept twice holds two cache refs
        eng.release([block])
    eng.check_accounting()
    assert eng.stats().num_free_blocks == eng.num_blocks - 1


def test_include_scopes_replies_and_merges_vars(tok, tmp_path: Path):
    (tmp_path / "a.json").write_text(json.dumps({
        "scope": "ALPHA", "tokens_per_step": 1, "vars": {"x": "x=(\\d+)"},
        "replies": [{"name": "a1", "turn": 1, "text": "alpha {{x}}"}]}))
    (tmp_path / "b.json").write_text(json.dumps({
        "scope": "BETA", "replies": [{"name": "b1", "turn": 1, "prompt_match": "x=", "text": "beta"}]}))
    (tmp_path / "all.json").write_text(json.dumps({"include": ["a.json", "b.json"],
                                                   "default": {"text": "none"}}))
    script = load_script(tmp_path / "all.json")
    assert [r.name for r in script.replies] == ["a1",
                                                "b1"] and script.replies[1].prompt_match == ["BETA", "x="]
    eng = make_engine(tok, script)
    eng.add(req("a", prompt_ids(tok, ["ALPHA x=7"])))
    eng.add(req("b", prompt_ids(tok, ["BETA x=7"])))
    eng.add(req("c", prompt_ids(tok, ["GAMMA x=7"])))
    outs = run(eng)
    text = {rid: tok.decode(all_ids(o), skip_special_tokens=False) for rid, o in outs.items()}
    assert text == {"a": "</think>alpha 7<｜end▁of▁sentence｜>", "b": "</think>beta<｜end▁of▁sentence｜>",
                    "c": "</think>none<｜end▁of▁sentence｜>"}
    assert max(len(o.token_ids) for o in outs["a"]) == 1  # the included script's pacing is kept


def test_include_cycle_and_var_conflict_are_errors(tmp_path: Path):
    (tmp_path / "self.json").write_text(json.dumps({"include": ["self.json"]}))
    with pytest.raises(ScriptError, match="includes itself"):
        load_script(tmp_path / "self.json")
    (tmp_path / "v1.json").write_text(json.dumps({"vars": {"x": "a(\\d)"}}))
    (tmp_path / "v2.json").write_text(json.dumps({"vars": {"x": "b(\\d)"}, "include": ["v1.json"]}))
    with pytest.raises(ScriptError, match="var 'x' is defined differently"):
        load_script(tmp_path / "v2.json")
