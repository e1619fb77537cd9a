"""The rank worker's transfer thread: L1 restores and writes beside the step in progress.

Why (issue 18 item 2): the loop thread reads commands only between steps. An ``import`` therefore
waited for the step in progress and then queued behind the other commands. Measured on an H200
(reference 'medium', 16 agents at 32K): a restore's round trip took 10x the copy of its bytes at
p50, 30x at p95, where a decode step takes ~60 ms and the copy ~4 ms.

For an engine that declares ``concurrent_transfers``, the worker starts this thread. The thread
owns the command socket from the backend. It runs ``import`` and ``export`` itself while the loop
thread steps; the engine makes that safe (``rank/pool_transfers.py``). Every other command (add,
abort, release, shutdown) is forwarded unchanged and in order to the loop thread, through an
inproc PUSH/PULL pair: those must stay ordered with the steps. The thread sends its replies
through its own PUSH socket to the backend's output socket, because zmq sockets are not
thread-safe (a PULL takes any number of PUSH peers, as with the heartbeat thread's). A reply's
stats are the loop's latest with the block counts as they are now (``Engine.transfer_stats``).

Order. Imports and exports commute with add and abort, which change no free count before a step.
An export's blocks are held until its reply: the cache awaits an export before it releases
the blocks (``cache/l1_transfers.py``), and the export also pins them (``BlockManager.pin_held``).
But the cache may send a release and then, without waiting for the release's reply, an import
that needs the released blocks (``L1Transfers.retire``). Applied in order, the import finds those
blocks free. Here the release may still be waiting for the loop thread's step boundary. So an
import that finds too few free blocks while forwarded commands are still unapplied is forwarded
too, and the loop thread runs it after them at the boundary: the old order and outcome. Later
imports follow it there until the loop has run it, so imports keep their order among themselves.

Failure: a refused command gets an error reply, as on the loop thread. Any other exception (a
CUDA error) stops the thread, and the loop thread raises it at its next iteration, so the rank
reports a fatal error and exits as if the loop had failed. Nothing is half-done: an import that
fails gives its blocks back, and an export unpins its blocks (``rank/pool_transfers.py``).

``DIB_TRANSFER_THREAD=0`` (``ENABLE_ENV``, set in the backend's environment: the group passes
``DIB_*`` on) keeps every command on the loop thread, for A/B measurements (``bench/transfer_overlap.py``).

TESTS ONLY: ``DIB_TEST_TRANSFER_GATE=<dir>`` (``GATE_ENV``) holds a step (the file ``hold-step``)
or a transfer (``hold-transfer``) for as long as that file exists in ``<dir>``. Meanwhile the
marker ``held-step``/``held-transfer`` is there. This lets a test order events without a clock.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from rank import wire
from rank.engine import CapacityExhausted, EngineMisuse

if TYPE_CHECKING:
    import zmq

    from rank.engine import Engine, EngineStats

ENABLE_ENV = "DIB_TRANSFER_THREAD"
GATE_ENV = "DIB_TEST_TRANSFER_GATE"
POLL_MS = 50  # how often the thread looks at its stop flag while no command comes
FORWARD_ADDR = "inproc://rank-commands"  # the loop thread's end binds it
TRANSFER_OPS = frozenset({"import", "export"})

log = logging.getLogger(__name__)
T = TypeVar("T")


def enabled(engine: Engine) -> bool:
    """Whether the worker runs this thread for ``engine`` (module docstring)."""
    return (engine.concurrent_transfers and not engine.owns_lockstep
            and os.environ.get(ENABLE_ENV, "1") != "0")


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


def gated(step: Callable[[], T]) -> Callable[[], T]:
    """TESTS ONLY: ``step`` held at the gate named ``step`` first."""
    def held_step() -> T:
        hold_at_gate("step")
        return step()

    return held_step


def run_command(engine: Engine, header: dict[str, Any]) -> dict[str, Any]:
    """Run ``release``/``export``/``import`` and return the reply (without its stats). The same
    code on either thread; raises only on an unexpected failure."""
    op = header["op"]
    cid = header.get("cid")
    try:
        result: Any = None
        if op == "release":
            engine.release(header["ids"])
        elif op == "export":
            engine.export_blocks(header["ids"], header["slot"])
        elif op == "import":
            result = engine.import_blocks(header["slot"], header["n"])
        else:
            raise EngineMisuse(f"unknown command {op!r}")
        return {"t": "reply", "cid": cid, "ok": True, "result": result}
    except (EngineMisuse, CapacityExhausted, ValueError) as exc:
        return {"t": "reply", "cid": cid, "ok": False, "etype": type(exc).__name__, "msg": str(exc)}


class TransferThread:
    """Owns the backend's command socket; runs transfers, forwards the rest (module docstring).

    ``forwarded`` (written here) and ``applied`` (written by the loop thread once it has run a
    forwarded command, before its reply) count the forwarded commands; ``num_transfers`` counts
    the replies sent (the loop resends its stats after any: a reply may overtake its messages);
    ``last_stats`` is the loop thread's latest ``engine.stats()``. Each is written by one thread.
    """

    def __init__(self, ctx: zmq.Context[Any], cmd: zmq.Socket[bytes], out_addr: str, engine: Engine,
                 last_stats: EngineStats) -> None:
        self.ctx, self.cmd, self.out_addr, self.engine = ctx, cmd, out_addr, engine
        self.last_stats = last_stats
        self.forwarded = 0
        self.applied = 0
        self._import_queued_at = 0  # ``forwarded`` just after the last import handed to the loop
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

        forward = self.ctx.socket(zmq.PUSH)
        forward.setsockopt(zmq.SNDHWM, 0)
        forward.setsockopt(zmq.LINGER, 0)
        forward.connect(FORWARD_ADDR)
        out = self.ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 2000)
        out.connect(self.out_addr)
        cmd = self.cmd
        try:
            while not self._stop.is_set():
                if not cmd.poll(POLL_MS):
                    continue
                while cast(int, cmd.get(zmq.EVENTS)) & zmq.POLLIN and not self._stop.is_set():
                    frames = cmd.recv_multipart(zmq.NOBLOCK)
                    header = wire.unpack_header(frames[0])
                    if header.get("op") not in TRANSFER_OPS:
                        self._forward(forward, frames)
                        continue
                    reply = self._transfer(header)
                    if reply is None:  # an import the loop thread runs after what is queued before it
                        self._forward(forward, frames)
                        self._import_queued_at = self.forwarded
                        continue
                    reply["stats"] = wire.stats_list(self.engine.transfer_stats(self.last_stats))
                    out.send_multipart(wire.pack(reply))
                    self.num_transfers += 1  # after the send: the loop's next stats go out after it
        except Exception as exc:  # noqa: BLE001 - handed to the loop thread, which fails the rank
            log.error("transfer thread failed: %s", traceback.format_exc())
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            forward.close(0)
            out.close()
            cmd.close(0)

    def _forward(self, forward: zmq.Socket[bytes], frames: list[bytes]) -> None:
        self.forwarded += 1
        forward.send_multipart(frames)

    def _transfer(self, header: dict[str, Any]) -> dict[str, Any] | None:
        """The reply, or None when the import must wait for forwarded commands (module docstring)."""
        if header["op"] == "import" and self.applied < self._import_queued_at:
            return None  # an import forwarded before this one is not applied yet: keep their order
        unapplied = self.applied < self.forwarded
        hold_at_gate("transfer")
        reply = run_command(self.engine, header)
        if not reply["ok"] and reply["etype"] == "CapacityExhausted" and unapplied:
            return None
        return reply
