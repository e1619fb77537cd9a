"""RankGroup's receive path in process: the drain of the PULL socket and the step dispatch.

A PUSH socket in the test stands in for a rank process (the real processes are covered by
test_rank_group_processes.py), so floods, idle gaps and odd step contents are exact.
"""

from __future__ import annotations

import asyncio
import tempfile

import orjson
import pytest
import zmq

from rank import wire
from rank.client import RequestStream
from rank.engine import EngineMisuse, EngineStats, FinishReason, RequestOutput
from rank.group import RankGroup
from rank.link import DRAIN_BATCH, RankLink, Tracked
from rank.rank_processes import FATAL_GRACE_S
from server.config import WorkloadConfig

STATS = EngineStats(10, 9, 0, 0, 0, 0, 0, 0, 0)

pytestmark = pytest.mark.timeout(60)


def _group() -> RankGroup:
    return RankGroup(WorkloadConfig(reference_model="null", ep=1, l1_cache=False).rank_config(), num_ranks=1,
                     name="t-recv")


def _track(r: RankLink, handle: int, rid: str, num_prompt: int = 5) -> RequestStream:
    stream = RequestStream(rid, r.rank, 1, num_prompt_tokens=num_prompt, num_cached_tokens=0)
    r.requests[handle] = Tracked(stream, rid, stream.push_tokens)
    return stream


async def _outputs(stream: RequestStream) -> list[RequestOutput]:
    return [out async for out in stream]


def test_push_tokens_merges_only_what_is_still_buffered() -> None:
    async def main() -> None:
        s = RequestStream("r", 0, 1, num_prompt_tokens=7, num_cached_tokens=3)
        s.push_tokens([1])
        s.push_tokens([2, 3])  # the consumer has not taken [1] yet: one output
        first = await s.__anext__()
        assert first.token_ids == [1, 2, 3] and not first.finished
        assert (first.num_prompt_tokens, first.num_cached_tokens) == (7, 3)
        s.push_tokens([4])  # a new output: the one taken is never changed
        assert first.token_ids == [1, 2, 3]
        s.push(RequestOutput("r", [5], True, FinishReason.LENGTH, 7, 3))
        s.push_tokens([6])  # after the terminal output: dropped
        rest = await _outputs(s)
        assert [o.token_ids for o in rest] == [[4], [5]] and rest[-1].finished

    asyncio.run(main())


def test_dispatch_hands_each_request_its_ids() -> None:
    """Mixed step (prefill chunks with 0 ids, several ids, one id), finished outputs, and a handle
    the backend does not know (-1, e.g. an aborted request's late output)."""

    async def main() -> None:
        group = _group()
        r = RankLink(0, None, None)  # type: ignore[arg-type]
        streams = {h: _track(r, h, f"r{h}") for h in range(5)}
        outs = [
            RequestOutput("r0", [], False), RequestOutput("r1", [11, 12, 13], False),
            RequestOutput("r2", [21], True, FinishReason.STOP, 5, 0, [7, 8], None),
            RequestOutput("gone", [99], False), RequestOutput("r3", [31], False),
            RequestOutput("r4", [41, 42], True, FinishReason.LENGTH, 5, 0, [], None),
        ]
        handles = {f"r{h}": h for h in range(5)}
        frames = wire.encode_step(outs, handles, STATS)
        group.messages.on_message(r, frames)
        # A decode step (one id each) takes the loop without offsets.
        frames = wire.encode_step([RequestOutput("r0", [1], False), RequestOutput("r1", [14], False),
                                   RequestOutput("r3", [32], True, FinishReason.ABORT, 5, 0, [], "x")],
                                  handles, STATS)
        group.messages.on_message(r, frames)
        assert set(r.requests) == {0, 1}
        assert [o.token_ids for o in streams[1].drain_nowait()] == [[11, 12, 13, 14]]
        assert [o.token_ids for o in streams[0].drain_nowait()] == [[1]]
        (fin2,) = await _outputs(streams[2])
        assert fin2.token_ids == [21] and fin2.finish_reason is FinishReason.STOP and fin2.kept_blocks == [
            7, 8]
        got3 = await _outputs(streams[3])
        assert [o.token_ids for o in got3] == [[31], [32]] and got3[-1].error == "x"
        (fin4,) = await _outputs(streams[4])
        assert fin4.token_ids == [41, 42] and fin4.finish_reason is FinishReason.LENGTH
        assert r.stats == wire.stats_list(STATS)

    asyncio.run(main())


def test_receive_drains_floods_and_wakes_after_idle() -> None:
    """More messages than one drain batch, then quiet, then more: every message is handled, in
    order, and the task wakes again after sleeping on the socket's readiness."""

    async def main() -> None:
        group = _group()
        ctx = zmq.Context()
        tmp = tempfile.mkdtemp(prefix="dib-recv-")
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.bind(f"ipc://{tmp}/out")
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(f"ipc://{tmp}/out")
        r = RankLink(0, None, pull, last_seen=0.0)  # type: ignore[arg-type]
        stream = _track(r, 3, "r3")
        handles = {"r3": 3}
        task = asyncio.create_task(r.receive(group.messages.on_message))
        try:
            num_steps = 3 * DRAIN_BATCH + 5
            for i in range(num_steps):  # queued before the task first runs
                push.send_multipart(wire.encode_step([RequestOutput("r3", [i], False)], handles, STATS))
            push.send_multipart([orjson.dumps({"t": "hb", "busy_s": 0.5, "phase": "ready", "progress": ""})])
            got: list[int] = []
            while len(got) < num_steps:
                got += [t for o in await _next_batch(stream) for t in o.token_ids]
            assert got == list(range(num_steps))
            assert r.busy_s == 0.5 and r.last_seen > 0
            for round_no in range(3):  # idle, then one message at a time
                await asyncio.sleep(0.05)
                seen = r.last_seen
                push.send_multipart(wire.encode_step([RequestOutput("r3", [1000 + round_no], False)], handles,
                                                     STATS))
                assert [o.token_ids for o in await _next_batch(stream)] == [[1000 + round_no]]
                assert r.last_seen > seen
            push.send_multipart(wire.pack({"t": "reject", "h": 3, "etype": "EngineMisuse", "msg": "bad"}))
            with pytest.raises(EngineMisuse, match="bad"):
                await stream.__anext__()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            push.close(0)
            pull.close(0)
            ctx.term()

    asyncio.run(main())


async def _next_batch(stream: RequestStream) -> list[RequestOutput]:
    first = await asyncio.wait_for(stream.__anext__(), 10)
    return [first, *stream.drain_nowait()]


def test_a_fatal_report_names_a_peer_exit_seen_within_the_grace() -> None:
    """A survivor's fatal report ("connection reset by peer") arrives before the supervisor sees
    the killed peer exit: the exit is named as the cause if it is seen within FATAL_GRACE_S."""

    async def main() -> None:
        group = _group()
        processes, on_message = group.processes, group.messages.on_message
        failure = processes.new_failure()
        r0, r1 = RankLink(0, None, None), RankLink(1, None, None)  # type: ignore[arg-type]
        on_message(r0, [orjson.dumps({"t": "fatal", "msg": "rank 0: connection reset by peer"})])
        assert not failure.done()
        processes.fail("rank 1 (pid 1) was killed by SIGKILL")
        assert failure.result() == "rank 1 (pid 1) was killed by SIGKILL"
        # Without another cause the report itself fails the epoch after the grace.
        failure = processes.new_failure()
        on_message(r0, [orjson.dumps({"t": "fatal", "msg": "rank 0: CUDA error"})])
        assert await asyncio.wait_for(failure, 5) == "rank 0: CUDA error"
        # A timer of an earlier epoch never fails the next one.
        old = processes.new_failure()
        on_message(r1, [orjson.dumps({"t": "fatal", "msg": "old"})])
        old.set_result("first cause")
        failure = processes.new_failure()
        await asyncio.sleep(FATAL_GRACE_S + 0.2)
        assert not failure.done()

    asyncio.run(main())
