"""The adapter's cache bookkeeping against DeepInfer's REAL C++ Scheduler, BlockManager, Sequence.

Needs the DeepInfer venv (DeepInfer 0.1.0 built with our patch, Python 3.12; no GPU: the
scheduler is CPU code), and runs in the build's pytest-venv, which is layered over it:

    bash scripts/build_deepinfer.sh          # prints DEEPINFER_BUILD_DIR=...; cached per machine
    bash scripts/test_deepinfer_build.sh     # tests/deepinfer -m deepinfer_build in that venv

What is real here: DeepInfer's Scheduler (admission, chunked prefill, the prefill vote on a
one-rank gloo group, decode block growth, aborts, ignored sequences, preemption), BlockManager
(ref counts, free list, pin/unpin, allocate), Sequence, SequenceMetadataPool,
``process_MTPInfo``, ``Scheduler.process_outputs``, ``build_request_outputs`` and
``RequestOutputPool`` (the outputs the adapter reads are DeepInfer's own). What is not: the model
forward and sampling (``standins/fake_deepinfer.py``'s toy model writes token ids into the pool rows
through the real block tables and samples from what it reads back), and LLMEngine's Python loop
(``FakeLLMEngine`` re-implements its ZOS ordering; DeepInfer's llm_engine.py needs GPU-side
modules). The classes are imported from the installed package (``deepinfer._C``), exactly as
the rank processes import them on the worker.
"""

from __future__ import annotations

import numpy as np
import pytest

from rank.deepinfer_settings import patch_missing_reason
from rank.engine import EngineMisuse, FinishReason, usable_prefix_blocks
from tests.deepinfer.deepinfer_concurrency import RestoreLoop, fine_switching, spilled_session, tokens_of
from tests.deepinfer.deepinfer_harness import (
    BS,
    cold_tokens,
    drive,
    make_engine,
    prompt,
    random_scenario,
    request,
)
from tests.engines.engine_kits import native_core

pytestmark = pytest.mark.deepinfer_build



@pytest.fixture(scope="module")
def native() -> dict:
    return native_core()  # fails here where DEEPINFER_BUILD_DIR is set (CI), skips elsewhere


def _engine(native: dict, **kw):
    kw.setdefault("num_gpu_blocks", 64)
    return make_engine(core=native["core"], dp_group=native["dp_group"], **kw)


def test_real_classes_have_the_patch_api(native: dict) -> None:
    engine = _engine(native)
    assert patch_missing_reason(engine.api) is None
    assert engine.prefix_cache_supported
    assert engine.llm.block_manager.num_blocks == 64
    assert engine.llm.block_manager.get_num_free_blocks() == 63  # block 0 is scratch


def test_finish_keep_release(native: dict) -> None:
    engine = _engine(native)
    engine.add(request("a", prompt(300, 1), 8))
    t = drive(engine)
    assert len(t.tokens("a")) == 8 and t.terminal("a").finish_reason is FinishReason.LENGTH
    kept = t.terminal("a").kept_blocks
    assert len(kept) == (300 + 8 - 1) // BS and 0 not in kept
    assert engine.stats().num_free_blocks == 63 - len(kept)
    engine.release(kept)
    engine.check_accounting()
    assert engine.stats().num_free_blocks == 63


@pytest.mark.parametrize("n_prompt,extra", [(300, 50), (520, 1), (1000, 129)])
def test_prefix_start_matches_cold_and_counts_cached_tokens(native: dict, n_prompt: int, extra: int) -> None:
    engine = _engine(native)
    ids = prompt(n_prompt, n_prompt)
    engine.add(request("t1", ids, 6))
    t = drive(engine)
    kept = t.terminal("t1").kept_blocks
    turn2 = np.concatenate([ids, np.asarray(t.tokens("t1"), dtype=np.int32), prompt(extra, 7)])
    n = usable_prefix_blocks(len(kept), turn2.size, BS)
    cached_before = engine.llm.num_cached_tokens_gpu_total
    engine.add(request("t2", turn2, 5, prefix=kept[:n]))
    t2 = drive(engine)
    assert t2.tokens("t2") == cold_tokens("cold", turn2, 5, core=native["core"], dp_group=native["dp_group"],
                                          num_gpu_blocks=64)
    # The patch reports the reused tokens to the stats (prefill_caching_rate).
    assert engine.llm.num_cached_tokens_gpu_total - cached_before == BS * n
    out = t2.terminal("t2")
    assert out.num_cached_tokens == BS * n and out.kept_blocks[:n] == kept[:n]
    engine.release(kept)
    engine.release(out.kept_blocks)
    assert engine.stats().num_free_blocks == 63


def test_abort_waiting_running_and_between_chunks(native: dict) -> None:
    engine = _engine(native)
    ids = prompt(600, 3)
    engine.add(request("a", ids, 2))
    kept = drive(engine).terminal("a").kept_blocks
    # waiting, plain and from a prefix (the patch releases the prefix pins of a waiting abort)
    engine.add(request("w", prompt(200, 4), 8))
    engine.add(request("wp", np.concatenate([ids, prompt(30, 5)]), 4, prefix=kept[:3]))
    engine.abort(["w", "wp"])
    t = drive(engine)
    for rid in ("w", "wp"):
        assert len(t.outputs[rid]) == 1 and t.terminal(rid).finish_reason is FinishReason.ABORT
    # running
    engine.add(request("r", prompt(300, 6), 50))
    t = drive(engine, until=lambda tr: "r" in tr.outputs and len(tr.tokens("r")) >= 3)
    engine.abort(["r"])
    t = drive(engine, t)
    assert t.terminal("r").finish_reason is FinishReason.ABORT and t.terminal("r").kept_blocks == []
    # between prefill chunks (upstream leaks the blocks and state slot here)
    engine.add(request("c", prompt(1500, 7), 4))
    seq = engine._active["c"].seq
    drive(engine, until=lambda _t: seq.num_cached_tokens > 0)
    assert 0 < seq.num_cached_tokens < 1500
    engine.abort(["c"])
    t = drive(engine)
    assert t.terminal("c").finish_reason is FinishReason.ABORT
    engine.release(kept)
    engine.check_accounting()
    assert engine.stats().num_free_blocks == 63
    assert engine.llm.state_manager.get_num_free_blocks() == engine.llm.state_manager.num_blocks - 1


def test_real_scheduler_refuses_bad_prefixes_without_side_effects(native: dict) -> None:
    engine = _engine(native)
    llm = engine.llm
    ids = prompt(600, 8)
    engine.add(request("a", ids, 2))
    kept = drive(engine).terminal("a").kept_blocks
    free_block = 63  # far from the ones allocated so far
    long_ids = np.concatenate([ids, prompt(100, 9)])

    def new_seq(n_tokens: int = len(long_ids), rid: str = "x"):
        return llm.add_request("u", rid, {"max_tokens": 2}, long_ids[:n_tokens].copy(), enqueue=False)

    bad_calls = {
        "not a multiple of 128": (new_seq(), [kept[0]], 100, 100),
        "blocks != num_cached/128": (new_seq(), [kept[0]], 256, 256),
        "num_cached > len - 1": (new_seq(256), kept[:2], 256, 256),
        "block 0": (new_seq(), [kept[0], 0], 256, 256),
        "out of range": (new_seq(), [kept[0], 64], 256, 256),
        "free block": (new_seq(), [kept[0], free_block], 256, 256),
        "duplicate": (new_seq(), [kept[0], kept[0]], 256, 256),
        "swa_valid_start > num_cached": (new_seq(), [kept[0]], 128, 200),
        "negative swa_valid_start": (new_seq(), [kept[0]], 128, -1),
    }
    before = (llm.block_manager.get_num_free_blocks(), llm.scheduler.get_num_unfinished_seqs())
    for name, (seq, blocks, num_cached, swa) in bad_calls.items():
        with pytest.raises(RuntimeError):
            llm.scheduler.add_sequence_with_prefix(seq, blocks, num_cached, swa)
        assert (llm.block_manager.get_num_free_blocks(),
                llm.scheduler.get_num_unfinished_seqs()) == before, name
        assert seq.block_table == [] and seq.num_cached_tokens == 0, name
    queued = new_seq(rid="q")
    llm.scheduler.add_sequence_with_prefix(queued, kept[:1], 128, 128)
    with pytest.raises(RuntimeError):  # not a new sequence any more
        llm.scheduler.add_sequence_with_prefix(queued, kept[:1], 128, 128)
    llm.abort_request("q")
    drive(engine)
    # No pins were left behind by the refused calls: releasing the cache's refs frees everything.
    engine.release(kept)
    assert llm.block_manager.get_num_free_blocks() == 63
    # And the adapter refuses the same things itself, before DeepInfer sees them.
    with pytest.raises(EngineMisuse):
        engine.add(request("y", long_ids, 2, prefix=[0, 1]))


def test_export_import_round_trip(native: dict) -> None:
    engine = _engine(native, host_slots=16)
    ids = prompt(700, 10)
    engine.add(request("a", ids, 3))
    t = drive(engine)
    kept = t.terminal("a").kept_blocks
    engine.export_blocks(kept, 0)
    engine.release(kept)
    engine._gpu_blocks()[kept] = 0
    restored = engine.import_blocks(0, len(kept))  # DeepInfer's allocate_nolock under its lock
    turn2 = np.concatenate([ids, np.asarray(t.tokens("a"), dtype=np.int32), prompt(20, 11)])
    n = usable_prefix_blocks(len(restored), turn2.size, BS)
    engine.add(request("b", turn2, 4, prefix=restored[:n]))
    t2 = drive(engine)
    assert t2.tokens("b") == cold_tokens("cold", turn2, 4, core=native["core"], dp_group=native["dp_group"],
                                         num_gpu_blocks=64)
    engine.release(restored)
    engine.release(t2.terminal("b").kept_blocks)
    assert engine.stats().num_free_blocks == 63


def test_too_long_and_preempted_end_with_errors(native: dict) -> None:
    engine = _engine(native, num_gpu_blocks=8, settings_overrides={"max_model_len": 1024})
    engine.add(request("long", prompt(2000, 12), 4))
    for i in range(3):
        engine.add(request(f"g{i}", prompt(250, 13 + i), 300, ignore_eos=True))
    t = drive(engine)
    assert "prompt_length_exceeded" in t.terminal("long").error
    errors = [t.terminal(f"g{i}").error
              for i in range(3) if t.terminal(f"g{i}").finish_reason is FinishReason.ERROR]
    assert errors and all("insufficient_system_resource" in e for e in errors)
    for i in range(3):
        engine.release(t.terminal(f"g{i}").kept_blocks)
    assert engine.stats().num_free_blocks == 7


def test_many_requests_with_aborts_balance(native: dict) -> None:
    random_scenario(_engine(native, num_gpu_blocks=200, settings_overrides={"max_num_seqs": 6}))


@pytest.mark.parametrize("bad", [0, 64, 63])  # scratch, out of range, free
def test_failed_pin_leaves_the_block_mutex_locked(native: dict, bad: int) -> None:
    """Upstream: BlockManager.pin_blocks throws with its mutex held (no RAII). The engine's next
    schedule() then fails, so the adapter must validate every id before pinning (it does)."""
    engine = _engine(native)
    bm = engine.llm.block_manager
    with pytest.raises(RuntimeError):
        bm.pin_blocks([bad])
    with pytest.raises(RuntimeError, match="deadlock"):
        bm.lock()
    with pytest.raises(EngineMisuse):  # the adapter refuses before touching DeepInfer
        engine.release([bad])


def test_restores_beside_the_steps_against_the_real_block_manager(native: dict) -> None:
    """tests/deepinfer/test_deepinfer_concurrent_transfers.py's first scenario on DeepInfer's
    compiled BlockManager and Scheduler: the transfer thread's allocate under ``lock()``, pins and
    unpins (GIL released while they wait) interleave with the real ``schedule``, ``free_seq`` and
    the loop's pins of finished turns' blocks, which the thread writes out and releases; every
    request's tokens equal a run without the thread and the blocks balance."""
    rng = np.random.default_rng(3)
    prompts = {f"r{i}": prompt(int(rng.integers(50, 700)), i) for i in range(24)}
    reference = tokens_of(_engine(native, num_gpu_blocks=160), prompts, 8)
    engine = _engine(native, num_gpu_blocks=160, host_slots=32)
    kept, expected = spilled_session(engine)
    with fine_switching(), RestoreLoop(engine, len(kept), expected) as restores:
        got = tokens_of(engine, prompts, 8, restores, keep=True)
    assert restores.error is None, restores.error
    assert got == reference
    assert restores.during_steps > 0
    assert restores.written == sum(1 for ids in prompts.values() if ids.size + 7 >= BS)
    engine.check_accounting()
    assert engine.stats().num_free_blocks == engine.num_blocks - 1
