"""``RankLoop``: one rank's lockstep loop over the parts ``rank/rank_setup.py`` built.

The loop is lockstep, as DeepInfer's is: each iteration drains commands, then every rank joins a
collective vote (all_reduce MAX of [has_work, shutdown]) and, if any rank has work, every rank
steps: ``step()`` where there is work, ``placeholder_step()`` elsewhere (the reference engine
runs one tiny all_reduce in both, standing in for EP dispatch). A dead or stopped peer therefore
blocks the others in a collective, exactly like production; the supervisor sees the death (exit)
or the stall (no heartbeats) and replaces the whole group.

When the whole group is idle, each rank waits up to ``IDLE_POLL_S`` for a command before voting,
so an idle group costs a few collectives per second, not a spinning core.

Engines that own their lockstep (``owns_lockstep``: DeepInfer) vote with their own collective:
``lockstep_has_work()`` (DeepInfer's ``has_unfinished_requests`` all_reduce) then ``step()`` on
every rank (DeepInfer's own placeholder forward on a rank without work, or its rank-local flush
when the group is idle). Shutdown cannot ride in that vote, so the ranks agree on it with a
separate 1-int gloo all_reduce on the side group (``rank/rank_setup.py``), run only in iterations
that the vote found idle group-wide (the vote's result is the same on every rank, so every rank
joins it; a busy group pays nothing). A ``shutdown`` command aborts the rank's requests and mutes
its outputs, so the group drains to idle within a few steps and every rank leaves the loop in the
same iteration, then DeepInfer's ``close()`` runs its collective barriers on all ranks together.
If that does not happen within the supervisor's grace period (a wedged rank), the supervisor
SIGKILLs the group, as it does on any failure.

Engines with a transfer thread (``rank/transfers.py``) have their L1 imports, exports and
releases run there while the loop steps; every other command reaches the loop through ``cmd``
and is applied at a step boundary.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any

from rank import step_profile, transfers, wire
from rank.engine import EngineMisuse
from rank.rank_setup import RankParts, RankStatus

if TYPE_CHECKING:
    from rank.engine import EngineStats

IDLE_POLL_S = 0.02
STATS_EVERY_S = 0.1

log = logging.getLogger(__name__)


class RankLoop:
    """One rank's loop: commands in, the lockstep vote, steps, outputs out. Not thread-safe (main
    thread only; the transfer thread, if any, shares only the engine and the counters it documents)."""

    def __init__(self, parts: RankParts, status: RankStatus) -> None:
        import torch
        import zmq

        self.status = status
        self.rank = parts.rank
        self.engine = parts.engine
        self.host_pool = parts.host_pool
        self.torch, self.zmq = torch, zmq
        self.cmd, self.out, self.poller = parts.cmd, parts.out, parts.poller
        self.dist = parts.dist
        self.vote = parts.vote
        self.owns_lockstep = self.engine.owns_lockstep
        self.control_group = parts.control_group
        self.transfers = parts.transfers
        self.profile = parts.profile
        self.wire = wire
        self.handles: dict[str, int] = {}
        self.shutdown = False
        self.stats_sent_at = 0.0
        self.stats_last: list[int] = []
        self.transfers_seen = 0  # the transfer thread's replies counted at the last periodic stats

    def send(self, frames: list[bytes]) -> None:
        self.out.send_multipart(frames)

    def announce_ready(self) -> None:
        e = self.engine
        pool = self.host_pool
        self.send(self.wire.pack({
            "t": "ready", "rank": self.rank, "pid": os.getpid(), "block_size": e.block_size,
            "num_blocks": e.num_blocks, "bytes_per_block": e.bytes_per_block,
            "num_host_slots": pool.num_slots if pool is not None and pool.is_open else 0,
            "python": sys.version.split()[0], "stats": self.wire.stats_list(e.stats()),
            "prefix_cache_supported": e.prefix_cache_supported,
            "prefix_cache_reason": e.prefix_cache_reason,
        }))
        self.status.phase, self.status.progress = "ready", ""
    def run(self) -> None:
        if self.owns_lockstep:
            self._run_engine_lockstep()
            return
        group_busy = False
        if self.transfers is not None:
            self.transfers.start()
        while True:
            if self.transfers is not None:
                self.transfers.check()
            self._drain(0.0 if group_busy or self.engine.has_work() else IDLE_POLL_S)
            has_work = self.engine.has_work()
            self.status.step_started = time.monotonic()
            self.vote[0] = int(has_work)
            self.vote[1] = int(self.shutdown)
            self.dist.all_reduce(self.vote, op=self.dist.ReduceOp.MAX)
            votes = self.vote.tolist()
            if votes[1]:
                return
            group_busy = votes[0] > 0
            if group_busy:
                if has_work:
                    outputs = self.engine.step()
                    self.status.num_steps += 1
                    if outputs:
                        self.send(self.wire.encode_step(outputs, self.handles, self._stats()))
                        self.stats_sent_at = time.monotonic()
                else:
                    self.engine.placeholder_step()
            self.status.step_started = 0.0
            self._maybe_send_stats()

    def _stats(self) -> EngineStats:
        """``engine.stats()``, also left for the transfer thread's replies."""
        stats = self.engine.stats()
        if self.transfers is not None:
            self.transfers.last_stats = stats
        return stats

    def _maybe_send_stats(self) -> None:
        if time.monotonic() - self.stats_sent_at > STATS_EVERY_S:
            current = self._stats()
            stats = self.wire.stats_list(current)
            # A transfer reply may overtake a step message sent before it (two sockets), leaving
            # the backend with older counts: resend after any, so they settle within an interval.
            num_transfers = self.transfers.num_transfers if self.transfers is not None else 0
            if stats != self.stats_last or num_transfers != self.transfers_seen:
                self.send(self.wire.encode_step([], self.handles, current))  # idle: else quiet
                self.stats_last = stats
                self.transfers_seen = num_transfers
            self.stats_sent_at = time.monotonic()

    def _run_engine_lockstep(self) -> None:
        """DeepInfer's loop (module docstring): the engine's vote, its step, our idle-time shutdown vote."""
        engine, prof = self.engine, self.profile
        flag = self.torch.zeros(1, dtype=self.torch.int32)
        busy = False
        if self.transfers is not None:
            self.transfers.start()
        while True:
            if self.transfers is not None:
                self.transfers.check()
            idle = not (busy or engine.has_work())
            if idle:
                self._drain(IDLE_POLL_S)
            prof.begin()  # (an idle wait is not part of a step)
            if not idle:
                self._drain(0.0)
            prof.lap(step_profile.DRAIN)
            self.status.step_started = time.monotonic()
            busy = engine.lockstep_has_work()  # the collective: every rank, every iteration
            prof.lap(step_profile.VOTE)
            outputs = engine.step()
            prof.lap(step_profile.ADAPTER)
            if busy:
                self.status.num_steps += 1
            if outputs and not self.shutdown:  # after shutdown the backend fails its streams itself
                stats = self._stats()
                prof.lap(step_profile.STATS)
                frames = self.wire.encode_step(outputs, self.handles, stats)
                prof.lap(step_profile.ENCODE)
                self.send(frames)
                prof.lap(step_profile.SEND)
                self.stats_sent_at = time.monotonic()
            if not engine.group_had_work:  # idle on every rank alike: all of them join this one
                flag[0] = int(self.shutdown)
                self.dist.all_reduce(flag, op=self.dist.ReduceOp.MAX, group=self.control_group)
                if int(flag[0]):
                    return
            self.status.step_started = 0.0
            self._maybe_send_stats()
            prof.end(engine.group_had_work, outputs)

    def _drain(self, timeout_s: float) -> None:
        zmq, cmd = self.zmq, self.cmd
        if timeout_s > 0 and not self.poller.poll(int(timeout_s * 1000)):
            return
        # Ask zmq whether a message is queued (cheap) rather than let a recv raise zmq.Again: a
        # busy rank drains every step, nearly always finding nothing.
        while cmd.get(zmq.EVENTS) & zmq.POLLIN:
            reply = self._handle(cmd.recv_multipart(zmq.NOBLOCK), time.monotonic())
            if self.transfers is not None:  # before the reply: the backend may act on it at once
                self.transfers.applied += 1
            if reply is not None:
                self.send(self.wire.pack(reply))

    def _handle(self, frames: list[bytes], received: float) -> dict[str, Any] | None:
        """Apply one command (``received``: when it left the socket); the reply to send, if any."""
        header = self.wire.unpack_header(frames[0])
        op = header["op"]
        if op == "add":
            # A folded L1 import (rank/transfers.py): its reply goes once the add is applied,
            # before any step output of the request.
            fold_reply = transfers.loop_fold_reply(self.engine, header, received)
            try:
                request = self.wire.decode_add(header, frames[1])
                self.engine.add(request)
                self.handles[request.request_id] = header["h"]
            except Exception as exc:  # noqa: BLE001 - one bad request is refused alone, never the rank
                etype = "EngineMisuse" if isinstance(exc, EngineMisuse) else "InvalidCommand"
                if etype != "EngineMisuse":
                    log.warning("rank %d: add refused: %s", self.rank, traceback.format_exc())
                return {"t": "reject", "h": header.get("h"), "etype": etype, "msg": str(exc)}
            finally:
                if fold_reply is not None:
                    fold_reply["stats"] = self.wire.stats_list(self._stats())
                    self.send(self.wire.pack(fold_reply))
            return None
        if op == "abort":
            self.engine.abort(header["rids"])
            return None
        if op == "shutdown":
            self.shutdown = True
            if self.owns_lockstep:  # let the group drain to idle, where the ranks agree to stop
                self.engine.abort(list(self.handles))
            return None
        reply = transfers.run_command(self.engine, header, received)  # release, export, import
        reply["stats"] = self.wire.stats_list(self._stats())
        return reply

    def close(self) -> None:
        import contextlib

        self.profile.write()
        if self.transfers is not None:
            self.transfers.stop()  # after the transfer in progress: the engine's pool goes next
        self.engine.close()
        if self.host_pool is not None:
            self.host_pool.close()
        with contextlib.suppress(Exception):  # best effort at exit
            self.dist.destroy_process_group()
        self.cmd.close(0)
        self.out.close()
