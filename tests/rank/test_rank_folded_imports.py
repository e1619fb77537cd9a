"""An L1 import folded into the ``add`` it serves (``EngineRequest.fold``, rank/transfers.py), in
real rank processes on CPU: the reference engine with the transfer thread and without it (the
loop thread runs the import), and the DeepInfer adapter over the CI stand-in.

The fold's reply settles before the request's first output; the add reads the restored prefix
(the same tokens as the prompt computed cold); an import that fails leaves the add with its
fallback prefix, which it computes on from; a request aborted while its import is held still
gets the reply (the caller owns those blocks) and nothing leaks; a rank killed meanwhile fails it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rank.client import RequestStream
from rank.engine import (
    CapacityExhausted,
    EngineMisuse,
    EngineRequest,
    FoldedImport,
    SamplingParams,
    usable_prefix_blocks,
)
from rank.errors import RankFailed
from rank.group import RankGroup
from rank.ids import BlockId, HostSlot
from rank.rank_setup import TEST_ENGINE_WRAPPER_ENV
from rank.transfers import ENABLE_ENV, GATE_ENV
from server.config import WorkloadConfig
from tests.rank.rank_stream_helpers import collect
from tests.rank.test_rank_deepinfer_processes import _config as _deepinfer_config

WAIT_S = 60  # bounds on a hang, not timing asserts
ENGINES = ("reference", "reference-no-thread", "deepinfer")


def _group(engine: str, gate: Path) -> RankGroup:
    env = {**os.environ, GATE_ENV: str(gate), TEST_ENGINE_WRAPPER_ENV: "standins.step_gate",
           ENABLE_ENV: "0" if engine == "reference-no-thread" else "1"}
    if engine == "deepinfer":
        return RankGroup(_deepinfer_config(patched=True, ep=1).rank_config(), python=sys.executable,
                         base_env=env)
    config = WorkloadConfig(reference_model="tiny", ep=1, block_size=16, reference_num_blocks=64,
                            max_num_batched_tokens=256, l1_host_gb=0.005)
    return RankGroup(config.rank_config(), base_env=env)


def _request(rid: str, ids: np.ndarray, max_tokens: int, prefix: list[BlockId] | None = None,
             num_cached: int = 0, fold: FoldedImport | None = None, keep: bool = True) -> EngineRequest:
    return EngineRequest(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), list(prefix or []),
                         num_cached, keep, fold)


def _ids(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 1000, size=n, dtype=np.int32)


def _fold(slot: int, num_blocks: int, fallback_blocks: int, block_size: int) -> FoldedImport:
    return FoldedImport(HostSlot(slot), num_blocks, fallback_blocks, fallback_blocks * block_size,
                        asyncio.get_running_loop().create_future())


async def _idle(group: RankGroup) -> None:
    for _ in range(WAIT_S * 20):
        if group.stats(0).num_free_blocks == group.num_blocks - 1:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(group.stats(0))


async def _spilled_session(group: RankGroup) -> tuple[np.ndarray, int]:
    """A turn whose kept blocks went to L1 slots 0.. and left the GPU; its next prompt and the
    blocks of it that L1 can restore."""
    bs = group.block_size
    ids = _ids(3 * bs + bs // 2, seed=1)
    tokens, last = await asyncio.wait_for(collect(group.submit(0, _request("a", ids, 3))), WAIT_S)
    kept = list(last.kept_blocks)
    assert len(kept) == 3
    await asyncio.wait_for(group.export_blocks(0, kept, HostSlot(0)), WAIT_S)
    await group.release(0, kept)
    await _idle(group)
    turn2 = np.concatenate([ids, np.asarray(tokens, np.int32), _ids(2 * bs, seed=2)])
    return turn2, usable_prefix_blocks(len(kept), turn2.size, bs)


async def _cold(group: RankGroup, ids: np.ndarray, max_tokens: int) -> list[int]:
    cold = group.submit(0, _request("cold", ids, max_tokens, keep=False))
    tokens, _ = await asyncio.wait_for(collect(cold), WAIT_S)
    return tokens


def _run(engine: str, gate: Path, scenario: Callable[[RankGroup], Awaitable[None]]) -> None:
    async def main() -> None:
        group = _group(engine, gate)
        await group.start()
        try:
            await scenario(group)
        finally:
            await group.close()

    asyncio.run(main())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("engine", ENGINES)
def test_a_folded_import_settles_before_the_first_output_and_the_add_reads_the_restored_prefix(
        engine: str, tmp_path: Path) -> None:
    async def scenario(group: RankGroup) -> None:
        bs = group.block_size
        prompt, usable = await _spilled_session(group)
        fold = _fold(0, usable, 0, bs)
        stream = group.submit(0, _request("warm", prompt, 5, num_cached=bs * usable, fold=fold))
        tokens: list[int] = []
        last = None
        async for out in stream:
            assert fold.reply.done()  # filed before any output of the request can be seen
            tokens += out.token_ids
            last = out
        assert last is not None and last.finished
        imported = fold.reply.result()
        assert len(imported) == usable and fold.sent
        assert last.num_cached_tokens == bs * usable
        assert last.kept_blocks[:usable] == imported  # the add's prefix is the imported blocks
        assert tokens == await _cold(group, prompt, 5)
        await group.release(0, imported)
        await group.release(0, last.kept_blocks)
        await _idle(group)

    _run(engine, tmp_path, scenario)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("engine", ENGINES)
def test_a_folded_import_that_fails_leaves_the_add_its_fallback_prefix(engine: str, tmp_path: Path) -> None:
    async def scenario(group: RankGroup) -> None:
        bs = group.block_size
        prompt, _ = await _spilled_session(group)
        # One block of the prompt is resident (L0); the import asks for more blocks than the pool
        # has, so it fails: the add keeps its one block and computes the rest.
        l0 = group.submit(0, _request("l0", prompt[: 2 * bs], 1))
        _, first = await asyncio.wait_for(collect(l0), WAIT_S)
        resident = list(first.kept_blocks[:1])
        await group.release(0, list(first.kept_blocks[1:]))
        too_many = group.num_blocks
        fold = _fold(1, too_many, 1, bs)
        request = _request("warm", prompt, 5, prefix=resident, num_cached=bs * (1 + too_many), fold=fold)
        tokens, last = await asyncio.wait_for(collect(group.submit(0, request)), WAIT_S)
        with pytest.raises((CapacityExhausted, EngineMisuse)):  # short of blocks, or of host slots
            fold.reply.result()
        assert last.num_cached_tokens == bs  # the fallback prefix
        assert tokens == await _cold(group, prompt, 5)
        await group.release(0, resident)
        await group.release(0, last.kept_blocks)
        await _idle(group)

    _run(engine, tmp_path, scenario)


async def _held_fold(group: RankGroup, gate: Path) -> tuple[FoldedImport, RequestStream, int]:
    """A folded add whose import is held on the transfer thread (the gate)."""
    bs = group.block_size
    prompt, usable = await _spilled_session(group)
    (gate / "hold-transfer").touch()
    fold = _fold(0, usable, 0, bs)
    stream = group.submit(0, _request("warm", prompt, 50, num_cached=bs * usable, fold=fold))
    for _ in range(WAIT_S * 100):
        if (gate / "held-transfer").exists():
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("the folded import never reached the gate")
    return fold, stream, usable


@pytest.mark.timeout(240)
def test_a_request_aborted_while_its_folded_import_runs_still_gets_the_reply_and_leaks_nothing(
        tmp_path: Path) -> None:
    async def scenario(group: RankGroup) -> None:
        fold, stream, usable = await _held_fold(group, tmp_path)
        stream.abort()  # the client went away while the import is in flight
        (tmp_path / "hold-transfer").unlink()
        imported = await asyncio.wait_for(fold.reply, WAIT_S)  # the caller owns these blocks
        assert len(imported) == usable
        _, last = await asyncio.wait_for(collect(stream), WAIT_S)
        await group.release(0, imported)
        await group.release(0, list(last.kept_blocks))
        await _idle(group)

    _run("reference", tmp_path, scenario)


@pytest.mark.timeout(240)
def test_a_rank_killed_while_its_folded_import_is_held_fails_the_reply(tmp_path: Path) -> None:
    async def scenario(group: RankGroup) -> None:
        fold, stream, _ = await _held_fold(group, tmp_path)
        pid: Any = group.pids()[0]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RankFailed):
            await asyncio.wait_for(fold.reply, WAIT_S)
        with pytest.raises(RankFailed):
            await asyncio.wait_for(collect(stream), WAIT_S)
        (tmp_path / "hold-transfer").unlink()

    _run("reference", tmp_path, scenario)
