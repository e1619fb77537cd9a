"""The rank worker's transfer thread: L1 restores and writes beside the step in progress.

Why: the loop thread reads commands only between steps. An ``import`` therefore
waited for the step in progress and then queued behind the other commands. Measured on an H200
(reference 'medium', 16 agents at 32K): a restore's round trip took 10x the copy of its bytes at
p50, 30x at p95, where a decode step takes ~60 ms and the copy ~4 ms. With imports here but
releases still at the boundary, the serving run's restores were bimodal (~7 ms, or 50-100 ms
when an import needed the blocks of a release sent just before it): releases now run here too.

For an engine that declares ``concurrent_transfers`` (the reference engine, and DeepInfer since
``rank/deepinfer_transfers.py``), the worker starts this thread, in both of its loops. The thread
owns the command socket from the backend and the transfer channel (``rank/transfer_channel.py``:
a Unix socket for transfers and their replies, with less latency than zmq), and takes commands
from both in the backend's order (their ``sq``). It runs ``import`` and ``export`` itself while the loop
thread steps; the engine makes that safe (``rank/pool_transfers.py``). It runs a ``release``
itself too unless an earlier command holds it back (below). Every other command (add, abort,
shutdown, and the releases held back) is forwarded unchanged and in order to the loop thread,
through an inproc PUSH/PULL pair: those must stay ordered with the steps. The thread sends its
replies through its own PUSH socket to the backend's output socket, because zmq sockets are not
thread-safe (a PULL takes any number of PUSH peers, as with the heartbeat thread's). A reply's
stats are the loop's latest with the block counts as they are now (``Engine.transfer_stats``);
the loop resends its stats after any such reply (``num_transfers``), since a reply may overtake
a step message sent before it.

Order. Imports and exports commute with add and abort, which change no free count before a step.
An export's blocks are held until its reply: the cache awaits an export before it releases
the blocks (``cache/retire.py``), and the export also pins them (``BlockManager.pin_held``).
The cache may send a release and then, without waiting for the release's reply, an import
that needs the released blocks (``Retirer.retire``); applied in order, the import finds those
blocks free. A release therefore runs here, at once, unless a forwarded ``add`` that the loop has
not applied yet names one of its blocks as a prefix block; then it is forwarded and applied after
that add (a prefix is all an add references). Why that is enough (the gate tests check 1, 2
and the order; 3 rests on the CUDA argument there, run by the concurrent tests on a GPU):

1. An unapplied add that references a block the release drops: run first, the release could free
   the block and an import reuse it, and the add would then validate against (and read) another
   session's bytes. Such a release is forwarded, behind the add. The add counts as unapplied
   until ``_handle`` has returned (``applied`` moves after it), so its validate-then-incref is
   never split by a release here.
2. An abort (applied or not): it only marks the request; the step drops the sequence's refs. A
   release here drops cache refs only, so a block the sequence holds stays allocated until the
   step drops that ref, after the fence (3). Releases commute with aborts and with releases still
   queued for the loop (forwarded ones): all of them only decrement counts, and each validates
   and decrements in one critical section (``BlockManager.release_held``), so two releases of
   one block cannot both pass the check and underflow it. If the cache released a block twice,
   which of the two gets the error could change; the counts could not.
3. The CUDA fence: a block freed here after the loop dropped a running sequence's ref may have
   a queued read by that sequence (never a write: cache-held blocks are not written). The loop
   records the fence before it drops such refs, whether or not they reach 0 then, and an import
   waits for the latest record (``rank/pool_transfers.py``; DeepInfer records it after every
   step call, which precedes the call that frees the sequence: ``rank/deepinfer_transfers.py``).
4. Replies: a release's reply leaves from the thread that applied it, with the stats as any
   transfer reply's (above). Replies carry their ``cid``, so their order across the two sockets
   does not matter; the cache awaits each one.
5. The step allocates under ``BlockManager.lock`` while a release runs here; the release's
   check and change are one critical section, so the step sees it wholly or not at all.

Long writes. Both engines copy an export in parts (``rank/pool_transfers.py``:
``EXPORT_PART_BYTES``, ~0.6 ms of copy on an H200) and, between parts, this thread runs the
commands that arrived meanwhile, in order, up to the next export (``_between_parts``). So a
restore, which a turn waits for, waits at most one part of a write-through or spill, which no
one waits for: in the H200 serving run imports had waited up to ~8 ms behind 10 ms exports. Those
commands commute with the export in progress: its blocks stay pinned (a release of one frees it
after the export), an import takes only free blocks, and an add only references held ones.

An import that finds too few free blocks while forwarded commands are still unapplied (a
release held back behind an add, say) is forwarded too, and the loop thread runs it after them
at the boundary: the old order and outcome. Later imports follow it there until the loop has run
it, so imports keep their order among themselves. A release here never waits behind such an
import: it can only leave the import more free blocks.

Folded imports. An ``add`` may carry a small L1 restore (``im``, ``rank/engine.py``
``FoldedImport``): the import the cache would otherwise have sent and awaited before sending the
add. A restore's own round trip (command, reply, the backend's event loop, then the add) costs
0.6-1.1 ms on the H200 host, more than 3x the copy of a few blocks. This thread runs the import
where the ``add`` stands in the backend's order, exactly as a separate ``import`` there would
run (same gate, same fallback to the loop thread when blocks are short while forwarded commands
are unapplied), rewrites the add's prefix (``wire.apply_fold``: the imported blocks appended, or
the fallback prefix if the import failed) and forwards it; the loop thread sends the import's
reply once it has applied the add (``loop_fold_reply``), before any step output of the request,
on the socket that carries those outputs: the backend files the blocks before it can see the
request finish. A release of an imported block cannot overtake the add: the forwarded add names
them among its prefix blocks (point 1). Without this thread the loop thread runs the import the
same way.

Failure: a refused command gets an error reply, as on the loop thread. Any other exception (a
CUDA error) stops the thread, and the loop thread raises it at its next iteration, so the rank
reports a fatal error and exits as if the loop had failed. Nothing is half-done: an import that
fails gives its blocks back, and an export unpins its blocks (``rank/pool_transfers.py``).

``DIB_TRANSFER_THREAD=0`` (``ENABLE_ENV``, set in the backend's environment: the group passes
``DIB_*`` on) keeps every command on the loop thread, for A/B measurements (``bench/transfer_overlap.py``).

TESTS ONLY: ``DIB_TEST_TRANSFER_GATE=<dir>`` (``GATE_ENV``) holds a transfer on this thread (the
file ``hold-transfer``) or an export between its parts (``hold-part``) for as long as that file
exists in ``<dir>``; meanwhile the marker ``held-transfer``/``held-part`` is there. This lets a test
order events without a clock. Steps are held the same way (``hold-step``) by the test wrapper
``standins/step_gate.py`` around the engine (``rank/rank_setup.py``), not by product code.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import orjson

from rank import transfer_channel, wire
from rank.engine import CapacityExhausted, EngineMisuse
from rank.transfer_channel import FrameReader, Reorder, header_seq

if TYPE_CHECKING:
    import zmq

    from rank.engine import Engine, EngineStats

ENABLE_ENV = "DIB_TRANSFER_THREAD"
GATE_ENV = "DIB_TEST_TRANSFER_GATE"
POLL_MS = 50  # how often the thread looks at its stop flag while no command comes
FORWARD_ADDR = "inproc://rank-commands"  # the loop thread's end binds it
THREAD_OPS = frozenset({"import", "export", "release"})  # run here (a release: unless held back)
OS_THREAD_NAME = b"rank-transfers"  # /proc/<pid>/task/<tid>/comm: bench/decode_figures.py counts it as ours

log = logging.getLogger(__name__)
Command = tuple[list[bytes], dict[str, Any], float]  # frames, header, when taken off its socket


def enabled(engine: Engine) -> bool:
    """Whether the worker runs this thread for ``engine`` (module docstring)."""
    return engine.concurrent_transfers and os.environ.get(ENABLE_ENV, "1") != "0"


def _name_os_thread(name: bytes) -> None:
    """Best effort: the calling thread's name as the OS shows it (Linux ``prctl(PR_SET_NAME)``),
    so per-thread CPU readings can tell this thread from the loop thread it was started by."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name, 0, 0, 0)  # 15: PR_SET_NAME, at most 15 bytes
    except (OSError, AttributeError):
        pass


def hold_at_gate(name: str) -> None:
    """TESTS ONLY (module docstring): wait while ``<gate dir>/hold-<name>`` exists."""
    gate = os.environ.get(GATE_ENV)
    if not gate or not os.path.exists(os.path.join(gate, f"hold-{name}")):
        return
    marker = os.path.join(gate, f"held-{name}")
    with open(marker, "w"):
        pass
    try:
        while os.path.exists(os.path.join(gate, f"hold-{name}")):
            time.sleep(0.01)
    finally:
        os.unlink(marker)


def run_command(engine: Engine, header: dict[str, Any], received: float,
                between: Callable[[], None] | None = None) -> dict[str, Any]:
    """Run ``release``/``export``/``import`` and return the reply (without its stats). The same
    code on either thread; raises only on an unexpected failure. ``between``: an export's, as in
    ``Engine.export_blocks``.

    A successful reply's ``ts`` is [received, started, done] on ``time.monotonic()`` (system-wide on
    Linux, so the backend can compare it with its own clock: ``rank/link.py`` ``TransferTiming``):
    when the command left the socket, when this call began, when the engine returned."""
    op = header["op"]
    cid = header.get("cid")
    started = time.monotonic()
    try:
        result: Any = None
        if op == "release":
            engine.release(header["ids"])
        elif op == "export":
            engine.export_blocks(header["ids"], header["slot"], between)
        elif op == "import":
            result = engine.import_blocks(header["slot"], header["n"])
        else:
            raise EngineMisuse(f"unknown command {op!r}")
        return {"t": "reply", "cid": cid, "ok": True, "result": result,
                "ts": [received, started, time.monotonic()]}
    except (EngineMisuse, CapacityExhausted, ValueError) as exc:
        return {"t": "reply", "cid": cid, "ok": False, "etype": type(exc).__name__, "msg": str(exc)}


def run_fold(engine: Engine, header: dict[str, Any], received: float) -> dict[str, Any]:
    """Run an ``add``'s folded import (``im``) and rewrite the add (``wire.apply_fold``); the
    import's reply (without its stats)."""
    reply = run_command(engine, fold_command(header), received)
    wire.apply_fold(header, reply)
    return reply


def fold_command(header: dict[str, Any]) -> dict[str, Any]:
    """The ``import`` command an ``add``'s ``im`` stands for."""
    im = header["im"]
    return {"op": "import", "cid": im["cid"], "slot": im["slot"], "n": im["n"]}


def loop_fold_reply(engine: Engine, header: dict[str, Any], received: float) -> dict[str, Any] | None:
    """On the loop thread, for an ``add`` before it is applied: the folded import's reply, to send
    once the add is applied (module docstring, "Folded imports"); runs the import now if the
    transfer thread left it to this thread. None for an add without one."""
    if "im" in header:
        return run_fold(engine, header, received)
    reply: dict[str, Any] | None = header.pop("imr", None)
    return reply


class TransferThread:
    """Owns the backend's command socket; runs transfers and releases, forwards the rest (module
    docstring).

    ``forwarded`` (written here) and ``applied`` (written by the loop thread once it has run a
    forwarded command, before its reply) count the forwarded commands; ``num_transfers`` counts
    the replies sent (the loop resends its stats after any: a reply may overtake its messages);
    ``last_stats`` is the loop thread's latest ``engine.stats()``. Each is written by one thread.
    """

    def __init__(self, ctx: zmq.Context[Any], cmd: zmq.Socket[bytes], out_addr: str, engine: Engine,
                 last_stats: EngineStats, channel_addr: str = "") -> None:
        self.ctx, self.cmd, self.out_addr, self.engine = ctx, cmd, out_addr, engine
        self.channel_addr = channel_addr
        self._channel: socket.socket | None = None  # the transfer channel, while connected
        self._reader = FrameReader()
        self._out: zmq.Socket[bytes] | None = None
        # Set by ``_run``: the poller over both sockets, the forwarding socket.
        self._poller: zmq.Poller | None = None
        self._forward_sock: zmq.Socket[bytes] | None = None
        self._order: Reorder[Command] = Reorder()
        self._ready: deque[Command] = deque()  # taken in order, not handled yet
        self._in_export = False  # inside an export's ``between``: no nesting
        self.last_stats = last_stats
        self.forwarded = 0
        self.applied = 0
        self._import_queued_at = 0  # ``forwarded`` just after the last import handed to the loop
        # Forwarded adds with prefix blocks, as (``forwarded`` just after the add, its blocks),
        # until the loop has applied them (``_held_back``).
        self._adds: deque[tuple[int, frozenset[int]]] = deque()
        self.error: str | None = None
        self.num_transfers = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rank-transfers", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop after the transfer in progress (if any); the thread closes its sockets."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def check(self) -> None:
        """On the loop thread: raise the thread's failure, if it had one."""
        if self.error is not None:
            raise RuntimeError(f"transfer thread failed: {self.error}")

    def _run(self) -> None:
        import zmq

        _name_os_thread(OS_THREAD_NAME)
        forward = self.ctx.socket(zmq.PUSH)
        forward.setsockopt(zmq.SNDHWM, 0)
        forward.setsockopt(zmq.LINGER, 0)
        forward.connect(FORWARD_ADDR)
        out = self.ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 2000)
        out.connect(self.out_addr)
        self._out = out
        cmd = self.cmd
        poller = zmq.Poller()
        poller.register(cmd, zmq.POLLIN)
        self._channel = self._connect()
        if self._channel is not None:
            poller.register(self._channel.fileno(), zmq.POLLIN)
        self._poller, self._forward_sock = poller, forward
        try:
            while not self._stop.is_set():
                readable = dict(poller.poll(0 if self._ready else POLL_MS))
                if readable:
                    self._take(readable)
                while self._ready and not self._stop.is_set():
                    self._handle(*self._ready.popleft())
        except Exception as exc:  # noqa: BLE001 - handed to the loop thread, which fails the rank
            log.error("transfer thread failed: %s", traceback.format_exc())
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            forward.close(0)
            out.close()
            cmd.close(0)
            if self._channel is not None:
                self._channel.close()

    def _connect(self) -> socket.socket | None:
        """The transfer channel to the backend (``rank/transfer_channel.py``), if it offers one."""
        if not self.channel_addr:
            return None
        try:
            return transfer_channel.connect(self.channel_addr)
        except OSError as exc:
            log.warning("no transfer channel (%s): transfers stay on zmq", exc)
            return None

    def _take(self, readable: dict[Any, int] | None = None) -> None:
        """Every command waiting on the sockets that ``readable`` (a poll's result; polled now if
        None) names into ``_ready``, in the backend's order."""
        if readable is None:
            assert self._poller is not None  # set by ``_run``
            readable = dict(self._poller.poll(0))
        for command in self._arrived(readable):
            self._ready.extend(self._order.push(header_seq(command[1]), command))

    def _between_parts(self) -> None:
        """An export's ``between`` (``Engine.export_blocks``): run the commands that are ready now,
        in order, up to the next export (which waits for this one). They commute with the export
        in progress: its blocks are pinned, imports take free blocks, adds reference held ones."""
        if self._in_export:
            return
        self._in_export = True
        try:
            hold_at_gate("part")
            self._take()
            while self._ready and self._ready[0][1].get("op") != "export" and not self._stop.is_set():
                self._handle(*self._ready.popleft())
        finally:
            self._in_export = False

    def _arrived(self, readable: dict[Any, int]) -> list[Command]:
        """Every command waiting on the sockets in ``readable``, as (frames, header, when taken
        off). Only those: a transfer read off the channel costs no zmq call before it runs."""
        import zmq

        arrived = []
        channel = self._channel
        if channel is not None and channel.fileno() in readable:
            try:
                data = channel.recv(1 << 20, socket.MSG_DONTWAIT)
            except BlockingIOError:
                data = None
            if data == b"":  # the backend closed it; a partial message is dropped (it resends it)
                self._drop_channel()
            elif data:
                now = time.monotonic()
                arrived += [([m], wire.unpack_header(m), now) for m in self._reader.feed(data)]
        cmd = self.cmd
        while cmd in readable and cast(int, cmd.get(zmq.EVENTS)) & zmq.POLLIN and not self._stop.is_set():
            frames = cmd.recv_multipart(zmq.NOBLOCK)
            arrived.append((frames, wire.unpack_header(frames[0]), time.monotonic()))
        return arrived

    def _handle(self, frames: list[bytes], header: dict[str, Any], received: float) -> None:
        """One command, in the backend's order: run here or forwarded (module docstring)."""
        op = header.get("op")
        if op == "add" and "im" in header:
            if self._fold(header, received):
                frames = [orjson.dumps(header), *frames[1:]]
            else:  # the loop thread runs it after what is queued before it
                self._forward(frames, header)
                self._import_queued_at = self.forwarded
                return
        if op not in THREAD_OPS or (op == "release" and self._held_back(header)):
            self._forward(frames, header)
            return
        reply = self._transfer(header, received)
        if reply is None:  # an import the loop thread runs after what is queued before it
            self._forward(frames, header)
            self._import_queued_at = self.forwarded
            return
        reply["stats"] = wire.stats_list(self.engine.transfer_stats(self.last_stats))
        self._reply(reply)
        self.num_transfers += 1  # after the send: the loop's next stats go out after it

    def _reply(self, reply: dict[str, Any]) -> None:
        """On the channel while there is one, else (or if it breaks) on the output socket."""
        if self._channel is not None:
            try:
                self._channel.sendall(transfer_channel.encode(orjson.dumps(reply)))
                return
            except OSError as exc:
                log.warning("transfer channel lost (%s): replies go by zmq", exc)
                self._drop_channel()
        assert self._out is not None  # set by ``_run`` before any command
        self._out.send_multipart(wire.pack(reply))

    def _drop_channel(self) -> None:
        """The channel is gone (the backend closed it, or a reply could not be written): out of
        the poll, closed; commands and replies go by zmq from here."""
        assert self._channel is not None and self._poller is not None
        self._poller.unregister(self._channel.fileno())
        self._channel.close()
        self._channel = None

    def _forward(self, frames: list[bytes], header: dict[str, Any]) -> None:
        forward = self._forward_sock
        assert forward is not None  # set by ``_run``
        self.forwarded += 1
        if header.get("op") == "add":
            prefix = header.get("pb")
            blocks = frozenset(b for b in prefix if isinstance(b, int)) if isinstance(prefix, list) else None
            if blocks:
                self._unapplied_adds().append((self.forwarded, blocks))
        forward.send_multipart(frames)

    def _unapplied_adds(self) -> deque[tuple[int, frozenset[int]]]:
        """``_adds`` without those the loop thread has applied by now."""
        adds = self._adds
        while adds and adds[0][0] <= self.applied:
            adds.popleft()
        return adds

    def _held_back(self, header: dict[str, Any]) -> bool:
        """Whether a release must go to the loop thread: a forwarded add it has not applied yet
        names one of the release's blocks (module docstring, point 1). A malformed release goes
        there too, to be refused as before."""
        adds = self._unapplied_adds()
        ids = header.get("ids")
        if not isinstance(ids, list):
            return True
        return bool(adds) and any(isinstance(b, int) and b in blocks for b in ids for _, blocks in adds)

    def _fold(self, header: dict[str, Any], received: float) -> bool:
        """Run an ``add``'s folded import here, as ``_transfer`` runs an ``import``; False (the add
        unchanged) when it must wait for forwarded commands and go to the loop thread instead."""
        if self.applied < self._import_queued_at:
            return False
        unapplied = self.applied < self.forwarded
        hold_at_gate("transfer")
        reply = run_command(self.engine, fold_command(header), received)
        if not reply["ok"] and reply["etype"] == "CapacityExhausted" and unapplied:
            return False
        wire.apply_fold(header, reply)
        return True

    def _transfer(self, header: dict[str, Any], received: float) -> dict[str, Any] | None:
        """The reply, or None when the import must wait for forwarded commands (module docstring)."""
        if header["op"] == "import" and self.applied < self._import_queued_at:
            return None  # an import forwarded before this one is not applied yet: keep their order
        unapplied = self.applied < self.forwarded
        hold_at_gate("transfer")
        reply = run_command(self.engine, header, received, self._between_parts)
        if not reply["ok"] and reply["etype"] == "CapacityExhausted" and unapplied:
            return None
        return reply
