"""A reply longer than its admission's reservation completes when idle cached blocks can make room,
on the reference engine, the scripted engine and the DeepInfer adapter over
its stand-in; a max_tokens that can never fit is refused before the first token.

The turn loop below does what ``server/service.py`` does: it reports the output count to
``CacheManager.make_room`` as outputs arrive. The pool is mostly held by an idle session's cached
blocks; without the growth each engine runs out of blocks mid-reply (the reference and scripted
engines fail the request, DeepInfer preempts it), which the control case asserts, so the scenario
really needs room the admission did not reserve. Runs on virtual time (conftest.py).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from cache.config import CacheConfig
from cache.manager import CacheManager
from cache.metrics import CacheMetrics
from cache.sessions import StopKind
from protocol.errors import ContextLimitExceeded
from rank.engine import FinishReason, RequestOutput, SamplingParams
from rank.local_group import LocalRankGroup
from tests.cache.cache_harness import make_group

_ids = itertools.count()


async def _turn(mgr: CacheManager, group: Any, prompt: np.ndarray, hint: str, max_tokens: int,
                grow: bool = True, default: bool = False) -> tuple[int, RequestOutput]:
    """One turn as the service runs it; returns (output tokens, terminal output)."""
    adm = await mgr.admit(prompt, hint, max_tokens, max_tokens_is_default=default)
    n = 0
    last = None
    sp = SamplingParams(max_tokens=adm.max_output_tokens, ignore_eos=True)
    try:
        async for out in group.submit(adm.rank, adm.engine_request(f"t{next(_ids)}", prompt, sp)):
            n += len(out.token_ids)
            last = out
            if grow:
                mgr.make_room(adm, n)
    except BaseException:
        mgr.abort(adm)
        raise
    assert last is not None and last.finished
    if last.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
        mgr.finish(adm, prompt, [0] * n if last.kept_blocks else [], last, StopKind.END_TURN)
    else:
        mgr.abort(adm)
    return n, last


def _ids_for(engine: str, n: int, seed: int) -> np.ndarray:
    hi = 900 if engine == "deepinfer" else 100_000
    return np.random.default_rng(seed).integers(3, hi, size=n, dtype=np.int32)


# (engine, idle prompt tokens, long reply's prompt, max_tokens): each pool holds the idle session
# and the reply only if the growth evicts part of the idle session.
CASES = {
    "reference": (700, 40, 600),
    "scripted": (700, 40, 600),
    "deepinfer": (3000, 200, 3500),
}


async def _group(engine: str) -> tuple[Any, CacheConfig]:
    if engine == "reference":  # null model, 64 blocks x 16 tokens, with an L1 pool
        group = await make_group("null", num_blocks=64, num_ranks=1, host_slots=256)
        return group, CacheConfig(output_reserve_tokens=64, output_lead_tokens=32, output_grow_tokens=64,
                                  protect_s=0.0, queue_recheck_s=0.01)
    if engine == "scripted":  # 64 blocks x 16 tokens, a reply that runs to max_tokens
        from standins.scripted_engine import ScriptedEngine, load_tokenizer
        from standins.scripted_replies import Script

        script = Script.model_validate({"tokens_per_step": 8, "replies": [{"text": "long", "eos": False}]})
        tok = load_tokenizer()
        group = LocalRankGroup(lambda rank: ScriptedEngine(script, tok, block_size=16, num_blocks=64,
                                                           max_model_len=8192), 1, step_s=0.001)
        await group.start()
        return group, CacheConfig(output_reserve_tokens=64, output_lead_tokens=32, output_grow_tokens=64,
                                  protect_s=0.0, queue_recheck_s=0.01)
    from tests.deepinfer.deepinfer_harness import make_engine  # 48 blocks x 128 tokens, 0.9 watermark

    group = LocalRankGroup(lambda rank: make_engine(num_gpu_blocks=48, vocab_size=1000), 1, step_s=0.001)
    await group.start()
    return group, CacheConfig(output_reserve_tokens=256, output_lead_tokens=256, output_grow_tokens=512,
                              usable_fraction=0.9, protect_s=0.0, queue_recheck_s=0.01)


def _run(engine: str, body: Callable[[CacheManager, Any], Awaitable[None]]) -> None:
    async def main() -> None:
        group, config = await _group(engine)
        mgr = CacheManager(group, config, CacheMetrics(CollectorRegistry()),
                           clock=asyncio.get_running_loop().time)
        try:
            await body(mgr, group)
            await mgr.drain()
            mgr.check_balance()
            group.check_accounting()
        finally:
            await group.close()

    asyncio.run(main())


@pytest.mark.parametrize("engine", sorted(CASES))
def test_a_long_reply_completes_by_evicting_idle_blocks(engine: str) -> None:
    idle_len, prompt_len, max_tokens = CASES[engine]

    async def body(mgr: CacheManager, group: Any) -> None:
        await _turn(mgr, group, _ids_for(engine, idle_len, 1), "idle", 4)
        held = len(mgr.l0[0])
        assert held * group.block_size >= idle_len - group.block_size, "the idle session was not cached"
        n, last = await _turn(mgr, group, _ids_for(engine, prompt_len, 2), "long", max_tokens)
        assert (n, last.finish_reason) == (max_tokens, FinishReason.LENGTH), last.error
        room = mgr.output_room
        assert room.num_grows >= 2 and room.num_evicted_blocks > 0 and room.num_short_blocks == 0
        assert len(mgr.l0[0]) < held + (prompt_len + max_tokens) // group.block_size  # idle blocks went

    _run(engine, body)


@pytest.mark.parametrize("engine", sorted(CASES))
def test_without_the_growth_the_engine_runs_out_mid_reply(engine: str) -> None:
    """Control: the same turn without make_room fails in the engine (so the test above needs it)."""
    idle_len, prompt_len, max_tokens = CASES[engine]

    async def body(mgr: CacheManager, group: Any) -> None:
        await _turn(mgr, group, _ids_for(engine, idle_len, 1), "idle", 4)
        n, last = await _turn(mgr, group, _ids_for(engine, prompt_len, 2), "long", max_tokens, grow=False)
        assert last.finish_reason is FinishReason.ERROR and 0 < n < max_tokens, (n, last)

    _run(engine, body)


def test_a_max_tokens_that_can_never_fit_is_refused_before_the_first_token() -> None:
    async def body(mgr: CacheManager, group: Any) -> None:
        limit_tokens = (63 - mgr.config.reserve_blocks) * 16  # the usable pool of one rank
        with pytest.raises(ContextLimitExceeded) as err:
            await mgr.admit(_ids_for("reference", 100, 3), "big", limit_tokens)
        assert err.value.http_status == 400
        assert err.value.message.startswith(
            f"input length and `max_tokens` exceed context limit: 100 + {limit_tokens} > {limit_tokens}")
        adm = await mgr.admit(_ids_for("reference", 100, 3), "big", limit_tokens - 100)  # fits exactly
        assert adm.max_output_tokens == limit_tokens - 100
        mgr.abort(adm)
        default = await mgr.admit(_ids_for("reference", 100, 3), "big", 8000, max_tokens_is_default=True)
        assert default.max_output_tokens == limit_tokens - 100  # a default is trimmed, not refused
        mgr.abort(default)

    _run("reference", body)


def test_admitted_replies_fit_the_pool_together_so_a_second_long_one_waits() -> None:
    """Two replies of 540 tokens on a pool of 976: each one's worst case fits alone, not both, so
    the second is admitted only when the first has ended, and both reach max_tokens with no
    growth over the pool (before: both ran, their growth overcommitted the pool)."""

    async def body(mgr: CacheManager, group: Any) -> None:
        long = [asyncio.create_task(_turn(mgr, group, _ids_for("reference", 40, 4 + i), f"r{i}", 540))
                for i in range(2)]
        results = await asyncio.gather(*long)
        assert all(r[0] == 540 and r[1].finish_reason is FinishReason.LENGTH for r in results), results
        assert mgr.output_room.num_short_blocks == 0 and mgr.queue.num_queued >= 1

    _run("reference", body)


def test_replies_on_one_shared_head_count_it_once_and_run_together() -> None:
    """Two replies of 200 tokens on prompts that start with the same 400 tokens (a system prompt
    and tools every session sends), filed in L0 by an earlier turn: each worst case is 40 blocks,
    80 together against 61 usable, but the head blocks both pin (24-25) exist once, so both
    run at once and reach max_tokens with no growth over the pool. Before, the second waited for
    the first to end."""

    async def body(mgr: CacheManager, group: Any) -> None:
        head = _ids_for("reference", 400, 20)

        def prompt(seed: int, n: int) -> np.ndarray:
            return np.concatenate([head, _ids_for("reference", n, seed)])

        await _turn(mgr, group, prompt(21, 16), "warm", 1)
        assert mgr.queue.num_queued == 0
        both = [asyncio.create_task(_turn(mgr, group, prompt(22 + i, 40), f"h{i}", 200)) for i in range(2)]
        results = await asyncio.gather(*both)
        assert all(r[0] == 200 and r[1].finish_reason is FinishReason.LENGTH for r in results), results
        assert all(r[1].num_cached_tokens >= 384 for r in results), results  # the head, from L0
        assert mgr.queue.num_queued == 0 and mgr.output_room.num_short_blocks == 0

    _run("reference", body)


def test_growth_over_a_pool_held_by_running_replies_is_counted_and_new_turns_wait() -> None:
    """Two long replies whose max_tokens was a default (counted at their admission reserve only)
    and whose growth no idle block can cover: the shortfall is reserved anyway (counted), so a
    turn arriving meanwhile queues behind them instead of taking their blocks."""

    async def body(mgr: CacheManager, group: Any) -> None:
        long = [asyncio.create_task(_turn(mgr, group, _ids_for("reference", 40, 4 + i), f"r{i}", 540,
                                          default=True))
                for i in range(2)]
        while mgr.output_room.num_short_blocks == 0 and not all(t.done() for t in long):
            await asyncio.sleep(0.001)
        assert mgr.output_room.num_short_blocks > 0, "the replies' growth never overcommitted the pool"
        queued_before = mgr.queue.num_queued
        _, last = await _turn(mgr, group, _ids_for("reference", 40, 9), "late", 4)
        assert last.finish_reason is FinishReason.LENGTH and mgr.queue.num_queued == queued_before + 1
        results = await asyncio.gather(*long)
        assert any(r[1].finish_reason is FinishReason.LENGTH and r[0] == 540 for r in results), results

    _run("reference", body)
