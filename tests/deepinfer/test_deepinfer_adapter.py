"""The DeepInfer adapter over the stand-in (standins/fake_deepinfer.py): the Engine invariants."""

from __future__ import annotations

import numpy as np
import pytest
from deepinfer_harness import BS, Transcript, cold_tokens, drive, make_engine, prompt, random_scenario, request

from rank.engine import CapacityExhausted, EngineMisuse, FinishReason, usable_prefix_blocks


def _finish_and_keep(engine, rid: str, n_prompt: int, max_tokens: int, seed: int):
    ids = prompt(n_prompt, seed)
    engine.add(request(rid, ids, max_tokens))
    t = drive(engine)
    out = t.terminal(rid)
    return ids, t.tokens(rid), out.kept_blocks


def test_finish_keeps_full_blocks_and_release_frees_them() -> None:
    engine = make_engine()
    ids, toks, kept = _finish_and_keep(engine, "a", 300, 8, seed=1)
    assert len(toks) == 8
    assert len(kept) == (300 + 8 - 1) // BS == 2
    assert engine.stats().num_cached_blocks == 2
    assert engine.stats().num_free_blocks == engine.num_blocks - 1 - 2
    engine.release(kept)
    engine.check_accounting()
    assert engine.stats().num_free_blocks == engine.num_blocks - 1


def test_keep_blocks_false_keeps_nothing() -> None:
    engine = make_engine()
    engine.add(request("a", prompt(400, 3), 4, keep=False))
    t = drive(engine)
    assert t.terminal("a").kept_blocks == []
    assert engine.stats().num_free_blocks == engine.num_blocks - 1


@pytest.mark.parametrize("n_prompt,extra", [(300, 50), (520, 1), (1000, 129), (257, 300)])
def test_start_from_prefix_gives_cold_tokens(n_prompt: int, extra: int) -> None:
    engine = make_engine(num_gpu_blocks=64)
    ids, toks, kept = _finish_and_keep(engine, "turn1", n_prompt, 6, seed=n_prompt)
    turn2 = np.concatenate([ids, np.asarray(toks, dtype=np.int32), prompt(extra, 7)])
    n = usable_prefix_blocks(len(kept), turn2.size, BS)
    assert n >= 1
    engine.add(request("turn2", turn2, 5, prefix=kept[:n]))
    t = drive(engine)
    out = t.terminal("turn2")
    assert out.num_cached_tokens == BS * n
    assert t.tokens("turn2") == cold_tokens("cold", turn2, 5, num_gpu_blocks=64)
    assert engine.stats().num_cached_tokens_total == BS * n
    # The prefix blocks are shared, never rewritten: turn1's kept blocks are still referenced once
    # by the cache, and turn2's kept blocks start with the same ids.
    assert out.kept_blocks[:n] == kept[:n]
    engine.release(kept)
    engine.release(out.kept_blocks)
    assert engine.stats().num_free_blocks == engine.num_blocks - 1


def test_wrong_prefix_block_changes_tokens() -> None:
    """The stand-in's model reads the KV back from the pool: bad prefix data is visible."""
    engine = make_engine(num_gpu_blocks=64)
    ids_a, toks_a, kept_a = _finish_and_keep(engine, "a", 600, 2, seed=11)
    _, _, kept_b = _finish_and_keep(engine, "b", 600, 2, seed=12)
    turn2 = np.concatenate([ids_a, np.asarray(toks_a, dtype=np.int32), prompt(40, 13)])
    engine.add(request("mixed", turn2, 4, prefix=[kept_a[0], kept_b[1]]))
    t = drive(engine)
    assert t.tokens("mixed") != cold_tokens("cold", turn2, 4, num_gpu_blocks=64)


def test_abort_waiting_emits_one_abort_without_tokens() -> None:
    engine = make_engine()
    engine.add(request("w", prompt(200, 4), 8))
    engine.abort(["w"])
    t = drive(engine)
    assert len(t.outputs["w"]) == 1  # the "ignored" output with its bogus token was dropped
    term = t.terminal("w")
    assert term.finish_reason is FinishReason.ABORT and term.token_ids == [] and term.kept_blocks == []
    assert engine.stats().num_free_blocks == engine.num_blocks - 1


def test_abort_running_synthesizes_the_terminal_output() -> None:
    engine = make_engine()
    engine.add(request("r", prompt(300, 5), 50))
    t = drive(engine, until=lambda tr: len(tr.tokens("r")) >= 3 if "r" in tr.outputs else False)
    engine.abort(["r", "r", "unknown"])
    t = drive(engine, t)
    term = t.terminal("r")
    assert term.finish_reason is FinishReason.ABORT and term.kept_blocks == []
    assert 3 <= len(t.tokens("r")) < 50
    assert engine.stats().num_free_blocks == engine.num_blocks - 1


def test_abort_waiting_prefix_request_releases_its_pins() -> None:
    engine = make_engine()
    ids, toks, kept = _finish_and_keep(engine, "a", 600, 2, seed=21)
    turn2 = np.concatenate([ids, np.asarray(toks, dtype=np.int32), prompt(30, 22)])
    engine.add(request("p", turn2, 4, prefix=kept[:3]))
    engine.abort(["p"])
    t = drive(engine)
    assert t.terminal("p").finish_reason is FinishReason.ABORT
    engine.release(kept)
    assert engine.stats().num_free_blocks == engine.num_blocks - 1


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


def test_too_long_prompt_ends_with_error() -> None:
    engine = make_engine(settings_overrides={"max_model_len": 1024})
    engine.add(request("long", prompt(2000, 8), 4))
    t = drive(engine)
    term = t.terminal("long")
    assert term.finish_reason is FinishReason.ERROR and "prompt_length_exceeded" in term.error
    assert t.tokens("long") == []


def test_export_import_round_trip_restores_the_kv() -> None:
    engine = make_engine(num_gpu_blocks=64, host_slots=16)
    ids, toks, kept = _finish_and_keep(engine, "a", 700, 3, seed=31)
    engine.export_blocks(kept, host_slot=2)
    engine.release(kept)
    # Scribble over the freed blocks so only the host copy holds the KV.
    engine._gpu_blocks()[kept] = 0
    restored = engine.import_blocks(2, len(kept))
    assert len(restored) == len(kept) and 0 not in restored
    turn2 = np.concatenate([ids, np.asarray(toks, dtype=np.int32), prompt(20, 32)])
    n = usable_prefix_blocks(len(restored), turn2.size, BS)
    engine.add(request("b", turn2, 4, prefix=restored[:n]))
    t = drive(engine)
    assert t.tokens("b") == cold_tokens("cold", turn2, 4, num_gpu_blocks=64)
    engine.release(restored)
    engine.release(t.terminal("b").kept_blocks)
    assert engine.stats().num_free_blocks == engine.num_blocks - 1


def test_import_beyond_capacity_changes_nothing() -> None:
    engine = make_engine(num_gpu_blocks=16, host_slots=32)
    before = engine.stats()
    with pytest.raises(CapacityExhausted):
        engine.import_blocks(0, 16)
    assert engine.stats() == before
    engine.check_accounting()


def _misuse_cases(kept: list[int], ids: np.ndarray, engine_num_blocks: int):
    long = np.concatenate([ids, prompt(200, 41)])
    return {
        "cached_not_multiple": request("m1", long, 2, prefix=kept[:1]).__class__(
            "m1", long, request("x", long).sampling, kept[:1], 100),
        "cached_too_long": request("m2", ids[: BS * 2], 2, prefix=kept[:2]),
        "block_zero": request("m3", long, 2, prefix=[0]),
        "out_of_range": request("m4", long, 2, prefix=[engine_num_blocks]),
        "duplicate": request("m5", long, 2, prefix=[kept[0], kept[0]]),
        "not_cached": request("m6", long, 2, prefix=[kept[0], engine_num_blocks - 1]),
        "empty_prompt": request("m7", np.zeros(0, dtype=np.int32), 2),
        "bad_token": request("m8", np.array([5, 100000], dtype=np.int32), 2),
        "bad_sampling": request("m9", long, 0),
    }


def test_misuse_raises_and_changes_nothing() -> None:
    engine = make_engine(host_slots=4)
    ids, _, kept = _finish_and_keep(engine, "a", 520, 2, seed=40)
    for name, req in _misuse_cases(kept, ids, engine.num_blocks).items():
        before = engine.stats()
        with pytest.raises(EngineMisuse):
            engine.add(req)
        assert engine.stats() == before, name
        assert not engine.has_work(), name
        engine.check_accounting()
    engine.add(request("dup", prompt(10, 1), 2))
    with pytest.raises(EngineMisuse):
        engine.add(request("dup", prompt(10, 2), 2))
    drive(engine)
    before = engine.stats()
    for bad in ([0], [engine.num_blocks], [kept[0], kept[0]], [engine.num_blocks - 2]):
        with pytest.raises(EngineMisuse):
            engine.release(bad)
        with pytest.raises(EngineMisuse):
            engine.export_blocks(bad, 0)
        assert engine.stats() == before
    with pytest.raises(EngineMisuse):
        engine.export_blocks(kept, 3)  # runs past the host pool
    engine.release(kept)
    with pytest.raises(EngineMisuse):
        engine.release(kept)  # double release
    engine.check_accounting()
    assert engine.stats().num_free_blocks == engine.num_blocks - 1


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


def test_many_requests_random_aborts_balance() -> None:
    random_scenario(make_engine(num_gpu_blocks=200, settings_overrides={"max_num_seqs": 6}))


def test_out_of_blocks_in_decode_ends_with_error() -> None:
    """stop_preempted_request: the engine ends a sequence it cannot grow; the adapter says why."""
    engine = make_engine(num_gpu_blocks=8)
    for i in range(3):
        engine.add(request(f"g{i}", prompt(250, 90 + i), 300, ignore_eos=True))
    t = drive(engine)
    reasons = {t.terminal(f"g{i}").finish_reason for i in range(3)}
    assert FinishReason.ERROR in reasons
    errors = [t.terminal(f"g{i}").error for i in range(3) if t.terminal(f"g{i}").error]
    assert all("insufficient_system_resource" in e for e in errors)
    for i in range(3):
        engine.release(t.terminal(f"g{i}").kept_blocks)
    assert engine.stats().num_free_blocks == engine.num_blocks - 1
