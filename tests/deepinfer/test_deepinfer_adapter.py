"""What only the DeepInfer adapter does, over the stand-in (standins/fake_deepinfer.py): the
prefix-cache patch (and life without it), DeepInfer's output recycling and loop, bad prefix data.

The Engine contract runs over this adapter and the other engines in
tests/engines/test_engine_contract.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from rank.engine import EngineMisuse, FinishReason
from tests.deepinfer.deepinfer_harness import BS, Transcript, cold_tokens, drive, make_engine, prompt, request


def _finish_and_keep(engine, rid: str, n_prompt: int, max_tokens: int, seed: int):
    ids = prompt(n_prompt, seed)
    engine.add(request(rid, ids, max_tokens))
    t = drive(engine)
    out = t.terminal(rid)
    return ids, t.tokens(rid), out.kept_blocks


def test_wrong_prefix_block_changes_tokens() -> None:
    """The stand-in's model reads the KV back from the pool: bad prefix data is visible."""
    engine = make_engine(num_gpu_blocks=64)
    ids_a, toks_a, kept_a = _finish_and_keep(engine, "a", 600, 2, seed=11)
    _, _, kept_b = _finish_and_keep(engine, "b", 600, 2, seed=12)
    turn2 = np.concatenate([ids_a, np.asarray(toks_a, dtype=np.int32), prompt(40, 13)])
    engine.add(request("mixed", turn2, 4, prefix=[kept_a[0], kept_b[1]]))
    t = drive(engine)
    assert t.tokens("mixed") != cold_tokens("cold", turn2, 4, num_gpu_blocks=64)


def test_abort_between_chunks_frees_with_patch_and_leaks_without() -> None:
    """Upstream 0.1.0 leaks a chunked prefill aborted between chunks; the patch frees it."""
    for patched in (True, False):
        engine = make_engine(patched=patched, prefix_cache=patched)
        engine.add(request("c", prompt(1500, 6), 4))  # 3 chunks of 512
        seq = engine._active["c"].seq
        drive(engine, until=lambda _t, s=seq: s.num_cached_tokens > 0)
        engine.abort(["c"])
        t = Transcript()
        if patched:
            drive(engine, t)
            assert engine.stats().num_free_blocks == engine.num_blocks - 1
        else:
            with pytest.raises(AssertionError):  # check_accounting sees the leaked blocks
                drive(engine, t)
            assert engine.stats().num_free_blocks < engine.num_blocks - 1
        assert t.terminal("c").finish_reason is FinishReason.ABORT


def test_without_the_patch_the_prefix_cache_is_off() -> None:
    engine = make_engine(patched=False)
    assert engine.prefix_cache_supported is False
    assert "add_sequence_with_prefix" in engine.prefix_cache_reason
    engine.add(request("a", prompt(400, 50), 3))
    t = drive(engine)
    assert t.terminal("a").kept_blocks == []
    assert engine.stats().num_free_blocks == engine.num_blocks - 1
    with pytest.raises(EngineMisuse, match="prefix"):
        engine.add(request("b", prompt(400, 50), 3, prefix=[1]))


def test_prefix_cache_off_by_config() -> None:
    engine = make_engine(prefix_cache=False)
    assert engine.prefix_cache_supported is False and "workload config" in engine.prefix_cache_reason
    engine.add(request("a", prompt(400, 51), 3))
    assert drive(engine).terminal("a").kept_blocks == []


def test_outputs_are_read_before_they_are_recycled() -> None:
    """The stand-in raises on a read after the next step; the adapter must never trigger it."""
    engine = make_engine()
    engine.add(request("a", prompt(100, 60), 3))
    ptrs = engine.llm.step()
    engine.llm.step()
    with pytest.raises(RuntimeError, match="recycled"):
        engine.api.RequestOutput.get_token_id(ptrs[0])


def test_generic_loop_with_placeholder_steps() -> None:
    """Without DeepInfer's own vote: placeholder_step() runs the engine and stashes its outputs."""
    engine = make_engine()
    engine.add(request("a", prompt(150, 70), 5))
    t = Transcript()
    for i in range(200):
        if i % 3 == 2:
            engine.placeholder_step()
        else:
            t.record(engine.step())
        engine.check_accounting()
        if not engine.has_work():
            break
    assert t.terminal("a").finish_reason is FinishReason.LENGTH
    assert len(t.tokens("a")) == 5


def test_stop_on_eos_keeps_blocks() -> None:
    engine = make_engine(eos_modulus=3)
    engine.add(request("a", prompt(300, 80), 200))
    t = drive(engine)
    term = t.terminal("a")
    assert term.finish_reason is FinishReason.STOP and t.tokens("a")[-1] == 1
    assert len(term.kept_blocks) == (300 + len(t.tokens("a")) - 1) // BS
