"""``async with cache.turn(...)``: admitted on enter, settled exactly once on exit (finish when the
last output is terminal, abort on an exception, a cancellation or no terminal output), or by the
caller after ``hand_off``. Over ``LocalRankGroup`` + the reference engine; nothing may leak."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cache.sessions import SessionId, StopKind
from rank.engine import SamplingParams
from tests.cache.cache_harness import BLOCK_SIZE, make_group, make_manager, settle, tokens

pytestmark = pytest.mark.timeout(120)

SAMPLING = SamplingParams(max_tokens=8, ignore_eos=True)


def test_a_normal_exit_files_the_turn_and_the_next_turn_hits_it() -> None:
    async def main() -> None:
        group = await make_group(num_ranks=1)
        mgr, _ = make_manager(group)
        prompt = tokens(np.random.default_rng(1), 5 * BLOCK_SIZE)
        try:
            async with mgr.turn(prompt, "a", 8) as turn:
                async for out in group.submit(turn.rank, turn.engine_request("r1", SAMPLING)):
                    turn.feed(out)
                turn.stop_kind = StopKind.TOOL_USE
                assert mgr.num_open_turns == 1 and not turn.settled
            assert turn.settled and mgr.num_open_turns == 0
            session = mgr.sessions.get(SessionId("hint:a"))
            assert session is not None and session.last_stop is StopKind.TOOL_USE
            assert len(mgr.l0[0]) == (len(prompt) + len(turn.output_ids) - 1) // BLOCK_SIZE
            follow = np.concatenate([prompt, np.asarray(turn.output_ids, dtype=np.int32), prompt[:20]])
            async with mgr.turn(follow, "a", 8) as again:
                async for out in group.submit(again.rank, again.engine_request("r2", SAMPLING)):
                    again.feed(out)
            assert again.admission.num_cached_tokens == 4 * BLOCK_SIZE  # 5 filed, the last replayed
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())


def test_an_exception_in_the_block_aborts_the_turn() -> None:
    async def main() -> None:
        group = await make_group(num_ranks=1)
        mgr, _ = make_manager(group)
        try:
            with pytest.raises(RuntimeError, match="client went away"):
                async with mgr.turn(tokens(np.random.default_rng(2), 70), "a", 8) as turn:
                    raise RuntimeError("client went away")
            assert turn.settled and mgr.num_open_turns == 0
            session = mgr.sessions.get(SessionId("hint:a"))
            assert session is not None and session.last_finish_s is None  # aborted: nothing learnt
            assert session.num_in_flight == 0
            assert len(mgr.l0[0]) == 0 and mgr.state.ledgers[0].reserved_blocks == 0
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())


def test_a_cancelled_turn_is_aborted() -> None:
    async def main() -> None:
        group = await make_group(num_ranks=1)
        mgr, _ = make_manager(group)
        entered = asyncio.Event()

        async def client() -> None:
            async with mgr.turn(tokens(np.random.default_rng(3), 70), "a", 8):
                entered.set()
                await asyncio.Event().wait()  # the client never comes back

        try:
            task = asyncio.get_running_loop().create_task(client())
            await entered.wait()
            assert mgr.num_open_turns == 1 and mgr.state.ledgers[0].reserved_blocks > 0
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert mgr.num_open_turns == 0 and mgr.state.ledgers[0].reserved_blocks == 0
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())


def test_a_normal_exit_without_a_terminal_output_aborts() -> None:
    async def main() -> None:
        group = await make_group(num_ranks=1)
        mgr, _ = make_manager(group)
        try:
            async with mgr.turn(tokens(np.random.default_rng(4), 70), "a", 8) as turn:
                pass  # never submitted
            assert turn.settled and turn.last_output is None and mgr.num_open_turns == 0
            session = mgr.sessions.get(SessionId("hint:a"))
            assert session is not None and session.last_finish_s is None
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())


def test_a_handed_off_turn_stays_open_until_its_stream_ends_and_settles_once() -> None:
    async def main() -> None:
        group = await make_group(num_ranks=1)
        mgr, _ = make_manager(group)
        prompt = tokens(np.random.default_rng(5), 5 * BLOCK_SIZE)
        try:
            async with mgr.turn(prompt, "a", 8) as turn:
                stream = group.submit(turn.rank, turn.engine_request("r1", SAMPLING))
                turn.hand_off()  # e.g. a stop sequence hit: the engine's blocks come with its end
            assert not turn.settled and mgr.num_open_turns == 1
            async for out in stream:
                turn.feed(out)
            turn.settle()
            assert turn.settled and mgr.num_open_turns == 0
            assert len(mgr.l0[0]) == (len(prompt) + len(turn.output_ids) - 1) // BLOCK_SIZE  # filed
            turn.settle()
            turn.abort()  # settled already: no-ops
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())


def test_an_explicit_finish_settles_once_even_if_the_block_then_raises() -> None:
    async def main() -> None:
        group = await make_group(num_ranks=1)
        mgr, _ = make_manager(group)
        prompt = tokens(np.random.default_rng(6), 5 * BLOCK_SIZE)
        try:
            with pytest.raises(OSError, match="write failed"):
                async with mgr.turn(prompt, "a", 8) as turn:
                    async for out in group.submit(turn.rank, turn.engine_request("r1", SAMPLING)):
                        turn.feed(out)
                    turn.finish(StopKind.END_TURN)
                    raise OSError("write failed")  # e.g. writing the stream's tail to a gone client
            assert len(mgr.l0[0]) > 0  # filed before the error, not aborted by it
            session = mgr.sessions.get(SessionId("hint:a"))
            assert session is not None and session.last_stop is StopKind.END_TURN
            await settle(mgr, group)
        finally:
            await group.close()

    asyncio.run(main())
