"""The Engine contract (rank/engine.py), one suite over every engine: the torch reference engine
(``tiny`` and the compute-free ``null`` model), the DeepInfer adapter over the fake forward (its
own scheduler in the default suite; DeepInfer's compiled one in ``-m deepinfer_build``, run by
``scripts/test_deepinfer_build.sh`` in the DeepInfer venv, skipped where DeepInfer does not
import) and the scripted stand-in model.

Sizes are in blocks of the engine's own ``block_size`` (16 for reference and scripted, 128 for
DeepInfer). What only one engine does (the reference engine's sampling and byte layout, the
prefix-cache patch, the scripted replies) is tested next to it: tests/rank, tests/deepinfer,
tests/e2e/test_scripted_engine.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from rank.engine import (
    CapacityExhausted,
    Engine,
    EngineMisuse,
    EngineRequest,
    FinishReason,
    SamplingParams,
    usable_prefix_blocks,
)
from tests.engines.engine_kits import KITS, Kit, drive

Make = Callable[..., Engine]


INSTALLED = pytest.param("deepinfer-installed", marks=pytest.mark.deepinfer_build)
# Block accounting, admission and aborts are the engine's code whatever the model computes: the
# reference engine runs them with its compute-free model; what reads the KV back (prefix start,
# host tier round trip) runs with the tiny model too.
ACCOUNTING_KITS = ["reference-null", "deepinfer-fake", INSTALLED, "scripted"]
KV_KITS = ["reference-tiny", *ACCOUNTING_KITS]
kv_kits = pytest.mark.parametrize("kit", KV_KITS, indirect=True)


@pytest.fixture(params=ACCOUNTING_KITS)
def kit(request: pytest.FixtureRequest) -> Kit:
    return KITS[request.param]


@pytest.fixture()
def make(kit: Kit, tmp_path: Path) -> Iterator[Make]:
    """Builds engines of ``kit``; after the test each must be idle with its accounting intact."""
    built: list[Engine] = []

    def build(num_blocks: int = 32, **kw: int) -> Engine:
        tmp = tmp_path / str(len(built))
        tmp.mkdir()
        engine = kit.build(tmp, num_blocks=num_blocks, **kw)
        built.append(engine)
        return engine

    yield build
    for engine in built:
        engine.check_accounting()
        engine.close()


def free_count(engine: Engine) -> int:
    return engine.stats().num_free_blocks


def finish_and_keep(kit: Kit, engine: Engine, rid: str, n_prompt: int, max_tokens: int,
                    seed: int) -> tuple[np.ndarray, list[int], list[int]]:
    ids = kit.prompt(n_prompt, seed)
    engine.add(kit.request(rid, ids, max_tokens))
    t = drive(engine)
    return ids, t.tokens(rid), t.terminal(rid).kept_blocks


def cold_tokens(kit: Kit, make: Make, ids: np.ndarray, max_tokens: int, num_blocks: int) -> list[int]:
    engine = make(num_blocks)
    engine.add(kit.request("cold", ids, max_tokens, keep=False))
    return drive(engine).tokens("cold")


def test_finish_keeps_full_blocks_and_release_frees_them(kit: Kit, make: Make) -> None:
    engine = make()
    bs = kit.block_size
    _, toks, kept = finish_and_keep(kit, engine, "a", int(2.34 * bs), 8, seed=1)
    assert len(toks) == 8
    assert len(kept) == (int(2.34 * bs) + 8 - 1) // bs == 2 and 0 not in kept
    stats = engine.stats()
    assert stats.num_cached_blocks == 2 and stats.num_free_blocks == 31 - 2
    engine.release(kept)
    assert free_count(engine) == 31 and engine.stats().num_cached_blocks == 0
    with pytest.raises(EngineMisuse):  # double release
        engine.release(kept)
    assert free_count(engine) == 31


def test_keep_blocks_false_keeps_nothing(kit: Kit, make: Make) -> None:
    engine = make()
    engine.add(kit.request("a", kit.prompt(3 * kit.block_size + 5, 3), 4, keep=False))
    assert drive(engine).terminal("a").kept_blocks == []
    assert free_count(engine) == 31


@kv_kits
@pytest.mark.parametrize("n_prompt,extra", [(2.34, 50), (4.06, 1), (7.81, 129), (2.01, 300)])
def test_prefix_start_shares_blocks_counts_cached_tokens_and_matches_cold(
    kit: Kit, make: Make, n_prompt: float, extra: int
) -> None:
    """``n_prompt`` in blocks, ``extra`` new tokens: turn 2 starts from turn 1's kept blocks."""
    bs = kit.block_size
    engine = make(64)
    ids, toks, kept = finish_and_keep(kit, engine, "turn1", int(n_prompt * bs), 6, seed=int(n_prompt * 100))
    turn2 = np.concatenate([ids, np.asarray(toks, dtype=np.int32), kit.prompt(extra * bs // 128 + 1, 7)])
    n = usable_prefix_blocks(len(kept), turn2.size, bs)
    assert n >= 1
    engine.add(kit.request("turn2", turn2, 5, prefix=kept[:n]))
    t = drive(engine)
    out = t.terminal("turn2")
    assert out.num_cached_tokens == bs * n and engine.stats().num_cached_tokens_total == bs * n
    assert out.kept_blocks[:n] == kept[:n]  # shared, never rewritten
    assert t.tokens("turn2") == cold_tokens(kit, make, turn2, 5, 64)
    engine.release(kept)
    engine.release(out.kept_blocks)
    assert free_count(engine) == 63


def _misuse(kit: Kit, engine: Engine, kept: list[int], ids: np.ndarray,
            free_block: int) -> dict[str, EngineRequest]:
    bs, num_blocks = kit.block_size, engine.num_blocks  # type: ignore[attr-defined]
    long = np.concatenate([ids, kit.prompt(bs + 7, 41)])
    sp = SamplingParams(max_tokens=2)
    return {
        "cached_not_block_aligned": EngineRequest("m", long, sp, kept[:1], bs + 1),
        "nothing_left_to_compute": kit.request("m", ids[: 2 * bs], 2, prefix=kept[:2]),
        "scratch_block": kit.request("m", long, 2, prefix=[0]),
        "out_of_range": kit.request("m", long, 2, prefix=[num_blocks]),
        "duplicate_block": kit.request("m", long, 2, prefix=[kept[0], kept[0]]),
        "free_block": kit.request("m", long, 2, prefix=[kept[0], free_block]),
        "empty_prompt": kit.request("m", np.zeros(0, dtype=np.int32), 2),
        "token_outside_vocab": kit.request("m", np.array([5, kit.vocab_size], dtype=np.int32), 2),
        "max_tokens_0": kit.request("m", long, 0),
        "top_p_0": kit.request("m", long, 2, temperature=1.0, top_p=0.0),
    }


def test_misuse_raises_and_changes_nothing(kit: Kit, make: Make) -> None:
    bs = kit.block_size
    engine = make(host_slots=4)
    ids, _, kept = finish_and_keep(kit, engine, "a", int(4.06 * bs), 2, seed=40)
    assert len(kept) == 4
    free_block = next(b for b in range(1, 32) if b not in kept)
    before = engine.stats()
    for name, request in _misuse(kit, engine, kept, ids, free_block).items():
        with pytest.raises(EngineMisuse):
            engine.add(request)
        assert engine.stats() == before and not engine.has_work(), name
        engine.check_accounting()
    host_slots = 4  # each kit sizes its pool to exactly host_slots blocks
    calls: dict[str, Callable[[], object]] = {
        "release_scratch": lambda: engine.release([0]),
        "release_free": lambda: engine.release([free_block]),
        "release_out_of_range": lambda: engine.release([32]),
        "release_twice_in_one_call": lambda: engine.release([kept[0], kept[0]]),
        "export_free": lambda: engine.export_blocks([free_block], 0),
        "export_negative_slot": lambda: engine.export_blocks(kept, -1),
        "export_past_the_pool": lambda: engine.export_blocks(kept, host_slots - len(kept) + 1),
        "import_past_the_pool": lambda: engine.import_blocks(host_slots - 1, 2),
    }
    for name, call in calls.items():
        with pytest.raises(EngineMisuse):
            call()
        assert engine.stats() == before, name
        engine.check_accounting()
    engine.add(kit.request("dup", kit.prompt(10, 1), 2, keep=False))
    with pytest.raises(EngineMisuse):
        engine.add(kit.request("dup", kit.prompt(10, 2), 2))
    assert drive(engine).terminal("dup").finish_reason is FinishReason.LENGTH
    engine.release(kept)
    assert free_count(engine) == 31


def test_abort_waiting_running_and_unknown(kit: Kit, make: Make) -> None:
    bs = kit.block_size
    engine = make(64)
    engine.add(kit.request("w", kit.prompt(2 * bs, 4), 8))
    engine.abort(["w"])  # before any step: still waiting
    t = drive(engine)
    assert len(t.outputs["w"]) == 1
    w = t.terminal("w")
    assert w.finish_reason is FinishReason.ABORT and w.token_ids == [] and w.kept_blocks == []

    engine.add(kit.request("r", kit.prompt(int(2.34 * bs), 5), 50))
    engine.add(kit.request("done", kit.prompt(bs + 3, 6), 4))
    t = drive(engine, until=lambda tr: "r" in tr.outputs and len(tr.tokens("r")) >= 3)
    engine.abort(["r", "r", "unknown"])
    t = drive(engine, t)
    r = t.terminal("r")
    assert r.finish_reason is FinishReason.ABORT and r.kept_blocks == []
    assert 3 <= len(t.tokens("r")) < 50
    done = t.terminal("done")
    assert done.finish_reason is FinishReason.LENGTH and len(t.tokens("done")) == 4
    engine.release(done.kept_blocks)
    assert free_count(engine) == 63 and not engine.has_work()


def test_abort_of_a_waiting_prefix_request_releases_its_pins(kit: Kit, make: Make) -> None:
    bs = kit.block_size
    engine = make(64)
    ids, toks, kept = finish_and_keep(kit, engine, "a", int(4.69 * bs), 2, seed=21)
    turn2 = np.concatenate([ids, np.asarray(toks, dtype=np.int32), kit.prompt(30, 22)])
    engine.add(kit.request("p", turn2, 4, prefix=kept[:3]))
    engine.abort(["p"])
    assert drive(engine).terminal("p").finish_reason is FinishReason.ABORT
    assert engine.stats().num_cached_blocks == len(kept)
    engine.release(kept)
    assert free_count(engine) == 63


def test_prompt_over_max_model_len_ends_with_an_error(kit: Kit, make: Make) -> None:
    bs = kit.block_size
    engine = make(64, max_model_len=8 * bs)
    engine.add(kit.request("long", kit.prompt(8 * bs + 3, 8), 4))
    t = drive(engine)
    term = t.terminal("long")
    assert term.finish_reason is FinishReason.ERROR and kit.too_long_error in (term.error or "")
    assert t.tokens("long") == [] and term.kept_blocks == []
    assert free_count(engine) == 63


@kv_kits
def test_export_import_round_trip_restores_the_kv(kit: Kit, make: Make) -> None:
    """Blocks exported to L1, released and overwritten by other requests, then imported: a
    turn started from them answers exactly as a cold start does."""
    bs = kit.block_size
    engine = make(24, host_slots=8)
    ids, toks, kept = finish_and_keep(kit, engine, "a", int(5.47 * bs), 3, seed=31)
    engine.export_blocks(kept, 2)
    engine.release(kept)
    for i in range(2):  # reuse every free block at least once
        engine.add(kit.request(f"fill{i}", kit.prompt(20 * bs, 50 + i), 1, keep=False))
        drive(engine)
    restored = engine.import_blocks(2, len(kept))
    assert len(restored) == len(kept) and 0 not in restored
    assert engine.stats().num_cached_blocks == len(kept)
    turn2 = np.concatenate([ids, np.asarray(toks, dtype=np.int32), kit.prompt(20, 32)])
    n = usable_prefix_blocks(len(restored), turn2.size, bs)
    engine.add(kit.request("b", turn2, 4, prefix=restored[:n]))
    t = drive(engine)
    assert t.terminal("b").num_cached_tokens == n * bs
    assert t.tokens("b") == cold_tokens(kit, make, turn2, 4, 24)
    engine.release(restored)
    engine.release(t.terminal("b").kept_blocks)
    assert free_count(engine) == 23


def test_import_beyond_capacity_changes_nothing(kit: Kit, make: Make) -> None:
    engine = make(16, host_slots=32)
    before = engine.stats()
    with pytest.raises(CapacityExhausted):
        engine.import_blocks(0, 16)  # 15 usable blocks
    assert engine.stats() == before


def test_decode_out_of_blocks_ends_with_an_error_and_frees(kit: Kit, make: Make) -> None:
    bs = kit.block_size
    engine = make(8)
    for i in range(3):
        engine.add(kit.request(f"g{i}", kit.prompt(int(1.95 * bs), 90 + i), 4 * bs))
    t = drive(engine)
    terms = [t.terminal(f"g{i}") for i in range(3)]
    errors = [term.error for term in terms if term.finish_reason is FinishReason.ERROR]
    assert errors and all(kit.out_of_blocks_error in (e or "") for e in errors), errors
    assert all(term.kept_blocks == [] for term in terms if term.finish_reason is FinishReason.ERROR)
    for term in terms:
        engine.release(term.kept_blocks)
    assert free_count(engine) == 7


def test_chunked_prefill_keeps_to_the_token_budget(kit: Kit, make: Make) -> None:
    """A prompt of 4.5 budgets takes at least 5 steps to its first token."""
    bs = kit.block_size
    budget = 3 * bs
    engine = make(64, budget=budget)
    engine.add(kit.request("long", kit.prompt(budget * 9 // 2, 9), 1, keep=False))
    t = drive(engine, until=lambda tr: bool(tr.outputs.get("long")))
    assert t.steps >= 5
    drive(engine, t)
    assert t.terminal("long").finish_reason is FinishReason.LENGTH


def test_random_requests_aborts_and_releases_balance(kit: Kit, make: Make) -> None:
    bs = kit.block_size
    engine = make(200, max_num_seqs=6)
    rng = np.random.default_rng(5)
    ids = [f"r{i}" for i in range(40)]
    for rid in ids:
        engine.add(kit.request(rid, kit.prompt(int(rng.integers(1, 5 * bs)), int(rng.integers(1 << 30))),
                               int(rng.integers(1, 12)), keep=bool(rng.integers(2))))

    def churn(step: int) -> None:
        if step % 4 == 0:
            engine.abort([ids[int(rng.integers(len(ids)))]])

    t = drive(engine, max_steps=3000, before_step=churn)
    kept = [t.terminal(rid).kept_blocks for rid in ids]
    assert {t.terminal(rid).finish_reason for rid in ids} <= {FinishReason.LENGTH, FinishReason.ABORT}
    assert engine.stats().num_cached_blocks == len({b for k in kept for b in k})
    for blocks in kept:
        if blocks:
            engine.release(blocks)
    assert free_count(engine) == 199
