"""Engine 'deepinfer' in real rank processes (``rank.worker``), over the CI stand-in.

The worker imports ``standins.fake_deepinfer_lockstep`` instead of DeepInfer (``DIB_DEEPINFER_MODULE``,
test only): DeepInfer's default group created by the engine at MASTER_PORT-50, its collective
``has_unfinished_requests`` vote, one collective per ``step()`` (placeholder forward included)
and the double barrier in ``close()``, each checked for lockstep. So these tests fail if the
worker creates its own group, steps out of lockstep, or shuts down on some ranks only.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from rank.client import GroupState
from rank.engine import EngineMisuse, EngineRequest, FinishReason, SamplingParams, usable_prefix_blocks
from rank.errors import RankFailed
from rank.group import RankGroup
from server.config import WorkloadConfig
from tests.rank.rank_stream_helpers import collect

BS = 128
NUM_BLOCKS = 96
VOCAB = 1000


def _config(patched: bool, vocab: int = VOCAB, **overrides: Any) -> WorkloadConfig:
    fake = {"patched": patched, "num_gpu_blocks": NUM_BLOCKS, "vocab_size": vocab}
    base: dict[str, Any] = dict(
        engine="deepinfer", deepinfer_venv=sys.prefix, model_dir="/nonexistent/model", ep=2,
        max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=512, prefill_attempt_interval=4,
        l1_host_gb=0.002, load_timeout_seconds=180,
        deepinfer_env={"DIB_DEEPINFER_MODULE": "standins.fake_deepinfer_lockstep",
                       "DIB_FAKE_DEEPINFER": json.dumps(fake), "OMP_NUM_THREADS": "1"},
    )
    base.update(overrides)
    return WorkloadConfig(**base)


def _ids(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n, dtype=np.int32)


def _request(rid: str, ids: np.ndarray, max_tokens: int, prefix: list[int] | None = None,
             keep: bool = True) -> EngineRequest:
    prefix = prefix or []
    return EngineRequest(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), prefix,
                         BS * len(prefix), keep)


async def _wait_all_free(group: RankGroup) -> None:
    """Every block back on every rank (stats arrive with steps and replies, so poll a little)."""
    for _ in range(1200):  # stats arrive every 100 ms; up to 60 s on a loaded machine
        if all(group.stats(r).num_free_blocks == group.num_blocks - 1 for r in range(group.num_ranks)):
            return
        await asyncio.sleep(0.05)
    raise AssertionError([group.stats(r) for r in range(group.num_ranks)])


def _exit_codes(group: RankGroup) -> list[int | None]:
    return [r.proc.returncode if r.proc is not None else None for r in group.links]


@pytest.mark.timeout(240)
def test_patched_two_ranks_serve_prefixes_and_shut_down_cleanly() -> None:
    async def scenario() -> None:
        group = RankGroup(_config(patched=True).rank_config(), python=sys.executable)
        await group.start()
        try:
            assert group.state == GroupState.READY and len(group.pids()) == 2
            assert group.block_size == BS and group.num_blocks == NUM_BLOCKS and group.num_host_slots > 0
            health = group.health()
            assert health["prefix_cache_supported"] is True
            assert [r["prefix_cache_supported"] for r in health["ranks"]] == [True, True]

            # Turn 1: concurrent requests of different lengths on both ranks, blocks kept.
            lengths = [260, 300, 384, 520, 270, 400]
            prompts = [_ids(n, seed=i) for i, n in enumerate(lengths)]
            streams = [group.submit(i % 2, _request(f"t1-{i}", p, 4 + i)) for i, p in enumerate(prompts)]
            first = await asyncio.gather(*(collect(s) for s in streams))
            for i, (tokens, last) in enumerate(first):
                assert len(tokens) == 4 + i and last.finish_reason == FinishReason.LENGTH
                assert len(last.kept_blocks) == (lengths[i] + len(tokens) - 1) // BS

            # Turn 2: each conversation continues on its rank from its kept blocks (the last matched
            # block replayed), and the same prompt runs cold on the other rank: same tokens, since
            # the stand-in's model reads its context back through the block table.
            warm, cold, num_cached = [], [], []
            for i, (tokens, last) in enumerate(first):
                ids = np.concatenate([prompts[i], np.asarray(tokens, np.int32), _ids(40 + i, seed=100 + i)])
                usable = usable_prefix_blocks(len(last.kept_blocks), ids.size, BS)
                assert usable >= 1
                num_cached.append(BS * usable)
                warm.append(group.submit(i % 2, _request(f"t2-{i}", ids, 6, last.kept_blocks[:usable])))
                cold.append(group.submit(1 - i % 2, _request(f"c2-{i}", ids, 6, keep=False)))
            warm_out = await asyncio.gather(*(collect(s) for s in warm))
            cold_out = await asyncio.gather(*(collect(s) for s in cold))
            for i, ((wt, wl), (ct, cl)) in enumerate(zip(warm_out, cold_out)):
                assert wt == ct and len(wt) == 6, i
                assert wl.num_cached_tokens == num_cached[i] and cl.kept_blocks == []
            assert sum(group.stats(r).num_cached_tokens_total for r in range(2)) == sum(num_cached)

            for i, (_, last) in enumerate([*first, *warm_out]):
                await group.release(i % 2, last.kept_blocks)
            await _wait_all_free(group)
            assert all(group.stats(r).num_cached_blocks == 0 for r in range(2))
        finally:
            await group.close()
        # Both ranks left the lockstep loop together and ran DeepInfer's close() barriers.
        assert _exit_codes(group) == [0, 0]
        assert group.state == GroupState.STOPPED

    asyncio.run(scenario())


@pytest.mark.timeout(240)
def test_shutdown_under_load_drains_every_rank_and_fails_streams() -> None:
    async def scenario() -> None:
        group = RankGroup(_config(patched=True).rank_config(), python=sys.executable)
        await group.start()
        streams = [group.submit(i % 2, _request(f"long-{i}", _ids(200 + 50 * i, seed=i), 3000))
                   for i in range(4)]
        first = [await s.__anext__() for s in streams]  # every request is running
        assert all(out.token_ids and not out.finished for out in first)
        await group.close()
        assert _exit_codes(group) == [0, 0]  # agreed shutdown, not the SIGKILL fallback
        for s in streams:
            with pytest.raises(RankFailed, match="closed"):
                await collect(s)

    asyncio.run(scenario())


@pytest.mark.timeout(240)
def test_unpatched_two_ranks_serve_with_the_prefix_cache_off() -> None:
    async def scenario() -> None:
        group = RankGroup(_config(patched=False).rank_config(), python=sys.executable)
        await group.start()
        try:
            health = group.health()
            assert health["prefix_cache_supported"] is False
            assert health["prefix_cache_reason"].startswith("rank 0: DeepInfer lacks the prefix-cache patch")
            assert "add_sequence_with_prefix" in health["prefix_cache_reason"]
            assert [r["prefix_cache_supported"] for r in health["ranks"]] == [False, False]

            lengths = [140, 260, 390, 130]
            streams = [group.submit(i % 2, _request(f"u-{i}", _ids(n, seed=i), 5))
                       for i, n in enumerate(lengths)]
            results = await asyncio.gather(*(collect(s) for s in streams))
            for tokens, last in results:
                assert len(tokens) == 5 and last.finish_reason == FinishReason.LENGTH
                assert last.kept_blocks == []  # keep_blocks asked, nothing can be kept
            # A request naming prefix blocks is refused with the reason; the group serves on.
            with pytest.raises(EngineMisuse, match="prefix blocks given but"):
                await collect(group.submit(0, _request("bad", _ids(300, seed=9), 3, prefix=[5])))
            tokens, last = await collect(group.submit(1, _request("after", _ids(150, seed=10), 3)))
            assert len(tokens) == 3 and group.state == GroupState.READY
            await _wait_all_free(group)
        finally:
            await group.close()
        assert _exit_codes(group) == [0, 0]

    asyncio.run(scenario())


@pytest.mark.timeout(300)
def test_unpatched_runtime_healthz_says_prefix_cache_off(tmp_path: Path) -> None:
    """The whole server over the unpatched stand-in: /healthz degraded with the engine's reason,
    the cache manager runs without L0 and L1, and chat still works."""
    from protocol.tokenize import default_tokenizer_path
    from server.runtime import Runtime

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    os.symlink(default_tokenizer_path(), model_dir / "tokenizer.json")
    config = _config(patched=False, vocab=129_280, model_dir=str(model_dir), port=0, max_num_seqs=4)

    async def scenario() -> None:
        runtime = Runtime(config, rank_mode="process")
        await runtime.start()
        try:
            async with httpx.AsyncClient(base_url=runtime.url, timeout=60) as client:
                body = (await client.get("/healthz")).json()
                assert body["status"] == "degraded"
                off = [r for r in body["reasons"] if r.startswith("prefix cache off: ")]
                assert len(off) == 1 and "DeepInfer lacks the prefix-cache patch" in off[0]
                assert any(r.startswith("L1 host cache off") for r in body["reasons"])
                assert runtime.cache.config.prefix_cache is False and not runtime.cache.l1_enabled
                messages = [{"role": "user", "content": "hello " * 200}]
                for _ in range(2):  # the same conversation twice: no prefix to reuse, still served
                    resp = await client.post("/v1/chat/completions", json={
                        "model": "default", "max_tokens": 5, "messages": messages})
                    assert resp.status_code == 200, resp.text
                    assert resp.json()["usage"]["completion_tokens"] == 5
                    messages = [*messages, resp.json()["choices"][0]["message"],
                                {"role": "user", "content": "more"}]
        finally:
            await runtime.stop()

    asyncio.run(scenario())


@pytest.mark.timeout(240)
def test_sigkill_of_a_rank_fails_requests_and_the_group_restarts() -> None:
    """The survivor blocks in DeepInfer's vote; the supervisor fails the epoch, replaces both ranks
    (a fresh rendezvous at the new MASTER_PORT-50) and serves again."""
    import signal

    async def scenario() -> None:
        group = RankGroup(_config(patched=True).rank_config(), python=sys.executable)
        epochs: list[int] = []
        group.add_restart_listener(epochs.append)
        await group.start()
        try:
            streams = [group.submit(i % 2, _request(f"k-{i}", _ids(200, seed=i), 3000)) for i in range(4)]
            for s in streams:
                await s.__anext__()
            os.kill(group.pids()[1], signal.SIGKILL)
            for s in streams:
                with pytest.raises(RankFailed, match="rank 1 .* was killed by SIGKILL"):
                    await collect(s)
            await group.wait_ready(timeout_s=180)
            assert group.epoch == 2 and epochs == [2] and group.health()["prefix_cache_supported"] is True
            tokens, last = await collect(group.submit(1, _request("again", _ids(300, seed=7), 4)))
            assert len(tokens) == 4 and last.finish_reason == FinishReason.LENGTH
            await group.release(1, last.kept_blocks)
            await _wait_all_free(group)
        finally:
            await group.close()
        assert _exit_codes(group) == [0, 0]

    asyncio.run(scenario())


def test_the_stand_in_refuses_a_default_group_made_by_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepInfer creates the default group itself; a worker that made one first must fail loudly."""
    import socket

    import torch.distributed as dist

    from standins import fake_deepinfer_lockstep

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        monkeypatch.setenv("MASTER_PORT", str(port + 50))
        api = fake_deepinfer_lockstep.deepinfer_api()
        with pytest.raises(RuntimeError, match="DeepInfer creates the default group itself"):
            api.LLMEngine.from_engine_args(api.EngineArgs(model="/m", data_parallel_size=1))
    finally:
        dist.destroy_process_group()
