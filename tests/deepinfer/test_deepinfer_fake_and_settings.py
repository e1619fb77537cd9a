"""The stand-in fails on misuse the way DeepInfer does; settings map onto EngineArgs and env."""

from __future__ import annotations

import numpy as np
import pytest

from rank.deepinfer_settings import DeepInferSettings, patch_missing_reason
from standins import fake_deepinfer as fake
from tests.deepinfer.deepinfer_harness import drive, make_engine, prompt, request


def _engine_with_kept(n_prompt: int = 600):
    engine = make_engine()
    engine.add(request("a", prompt(n_prompt, 1), 2))
    kept = drive(engine).terminal("a").kept_blocks
    return engine, kept


def _snapshot(llm):
    return (llm.block_manager.get_num_free_blocks(), llm.state_manager.get_num_free_blocks(),
            llm.scheduler.get_num_unfinished_seqs())


def _new_seq(llm, n: int, rid: str = "x"):
    return llm.add_request("u", rid, {"max_tokens": 2}, prompt(n, 9), enqueue=False)


@pytest.mark.parametrize("case", ["not_multiple", "too_long", "block_zero", "free_block", "duplicate",
                                  "count_mismatch", "swa_past_cached", "out_of_range"])
def test_add_sequence_with_prefix_validates_before_mutating(case: str) -> None:
    engine, kept = _engine_with_kept()
    llm = engine.llm
    refs_before = [llm.block_manager.ref_count(b) for b in range(engine.num_blocks)]
    free_block = next(b for b in range(1, engine.num_blocks) if llm.block_manager.ref_count(b) == 0)
    seq = _new_seq(llm, 600)
    args = {
        "not_multiple": ([kept[0]], 100, 100),
        "too_long": (kept, 128 * len(kept), 0),  # with the short sequence made below
        "block_zero": ([kept[0], 0], 256, 256),
        "free_block": ([kept[0], free_block], 256, 256),
        "duplicate": ([kept[0], kept[0]], 256, 256),
        "count_mismatch": ([kept[0]], 256, 256),
        "swa_past_cached": ([kept[0]], 128, 200),
        "out_of_range": ([kept[0], engine.num_blocks], 256, 256),
    }[case]
    if case == "too_long":
        seq = _new_seq(llm, 128 * len(kept))  # num_cached == len: nothing left to compute
    before = _snapshot(llm)
    with pytest.raises(RuntimeError):
        llm.scheduler.add_sequence_with_prefix(seq, *args)
    assert _snapshot(llm) == before
    assert [llm.block_manager.ref_count(b) for b in range(engine.num_blocks)] == refs_before
    assert seq.block_table == [] and seq.num_cached_tokens == 0


@pytest.mark.parametrize("bad", [0, 8, 5])  # scratch, out of range, free
def test_block_manager_bad_pin_raises_and_keeps_its_mutex_like_deepinfer(bad: int) -> None:
    bm = fake.PatchedBlockManager(8)
    assert bm.num_blocks == 8 and bm.get_num_free_blocks() == 7
    bm.lock()
    ids = bm.allocate_nolock(3)
    bm.unlock()
    assert 0 not in ids
    with pytest.raises(RuntimeError):
        bm.pin_blocks([bad])
    with pytest.raises(RuntimeError, match="deadlock"):  # no RAII in the C++: still locked
        bm.lock()


def test_block_manager_unpin_of_a_free_block_corrupts_like_deepinfer() -> None:
    bm = fake.BlockManager(4)
    bm.lock()
    ids = bm.allocate_nolock(2)
    bm.unlock()
    bm.unpin_blocks(ids)
    with pytest.raises(RuntimeError, match="corrupted"):
        bm.unpin_blocks([ids[0]])
    assert bm.corrupted
    bm2 = fake.BlockManager(4)
    bm2.lock()
    with pytest.raises(RuntimeError, match="empty"):
        bm2.allocate_nolock(4)


def test_unpatched_stand_in_lacks_the_patch_api() -> None:
    api = fake.make_api(patched=False)
    reason = patch_missing_reason(api)
    assert reason is not None
    for name in ("Scheduler.add_sequence_with_prefix", "Sequence.block_table", "BlockManager.num_blocks",
                 "LLMEngine.enqueue_with_prefix"):
        assert name in reason
    assert patch_missing_reason(fake.make_api(patched=True)) is None


def test_invalid_token_ids_are_dropped_like_deepinfer() -> None:
    engine = make_engine()
    assert engine.llm.add_request("u", "x", {}, np.array([1, 5000], dtype=np.int32)) is None


def test_settings_from_workload_config_and_environment() -> None:
    from server.config import load_config  # (pydantic: not in the DeepInfer build venv)

    cfg = load_config({
        "engine": "deepinfer", "deepinfer_venv": "/venv", "model_dir": "/models/v41", "ep": 4,
        "max_num_seqs": 64, "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.8, "eplb": True,
        "extra_experts": 8, "prefill_attempt_interval": 5, "prefill_any_attempt_interval": 9,
        "deepinfer_env": {"DEEPINFER_USE_NEXTN_DECODE": "0", "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL": "11"},
    })
    s = DeepInferSettings.from_rank_config(cfg.rank_config(), engine_rank=2)
    env = s.environment(current={})
    assert env["CUDA_VISIBLE_DEVICES"] == "2,0,1,3"
    assert env["DEEPINFER_PREFILL_ATTEMPT_INTERVAL"] == "5"
    assert env["DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL"] == "11"  # the workload's deepinfer_env wins
    assert env["DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS"] == "8"
    assert int(env["DEEPINFER_EXPERT_REARRANGEMENT_STEP_INTERVAL"]) > 0
    assert env["DEEPINFER_USE_NEXTN_DECODE"] == "0"
    assert "CUDA_VISIBLE_DEVICES" not in s.environment(current={"CUDA_VISIBLE_DEVICES": "5"})
    args = s.engine_args(fake.make_api())
    assert (args.engine_rank, args.data_parallel_size, args.expert_parallel_size) == (2, 4, 4)
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.gpu_memory_utilization) == (64, 8192, 0.8)
    assert args.chunked_prefill and args.model == "/models/v41"
    with pytest.raises(ValueError):
        DeepInferSettings.from_rank_config(cfg.rank_config(), engine_rank=4)


def test_fake_engine_zos_outputs_arrive_one_step_late() -> None:
    api = fake.make_api(num_gpu_blocks=16)
    llm = api.LLMEngine.from_engine_args(api.EngineArgs(model="m", max_num_seqs=4, max_num_batched_tokens=512,
                                                        chunked_prefill=True))
    llm.add_request("u", "r", {"max_tokens": 3}, prompt(50, 3))
    per_step = []
    for _ in range(6):
        ptrs = llm.step() if llm.has_unfinished_requests() else llm.flush_inflight_reqs()
        per_step.append([api.RequestOutput.get_token_id(p) for p in ptrs])
    # prefill: first token in the same call; decode step 1 has nothing yet (in flight)
    assert len(per_step[0]) == 1 and per_step[1] == [] and sum(map(len, per_step)) == 3


def test_make_deepinfer_engine_sets_the_environment_before_importing(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from rank import deepinfer_settings, engines
    from server.config import load_config

    env: dict[str, str] = {}
    seen_at_import: dict[str, str] = {}
    monkeypatch.setattr(os, "environ", env)

    def fake_import():
        seen_at_import.update(env)
        return fake.make_api()

    monkeypatch.setattr(deepinfer_settings, "import_deepinfer", fake_import)
    cfg = load_config({"engine": "deepinfer", "deepinfer_venv": "/venv", "model_dir": "/m", "ep": 2,
                       "max_model_len": 4096, "max_num_seqs": 8, "max_num_batched_tokens": 512,
                       "prefill_attempt_interval": 3})
    engine = engines.make_deepinfer_engine(cfg.rank_config(), 1)
    assert seen_at_import["CUDA_VISIBLE_DEVICES"] == "1,0"
    assert seen_at_import["DEEPINFER_PREFILL_ATTEMPT_INTERVAL"] == "3"
    assert engine.owns_lockstep and engine.prefix_cache_supported
    assert engine.bytes_per_block == engine._gpu_blocks().shape[1]
    assert engine.llm.args.engine_rank == 1 and engine.llm.args.data_parallel_size == 2
