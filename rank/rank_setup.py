"""Building one rank process's parts before its loop runs (``build_rank``, used by ``rank/worker.py``).

In order: the sockets to the backend, the ``RankConfig`` the supervisor wrote, the shared L1 host
pool, the engine (``rank/engines.py``), the lockstep group, the L1 pool's pin (chunk by chunk in a
thread, started only now: a register holds the CUDA driver, which the engine build needs;
``rank/host_pin.py``), then the transfer thread (``rank/transfers.py``), which
takes the backend's command socket and leaves the loop an inproc one. ``rank/rank_loop.py`` runs
the loop over what comes out (``RankParts``); of this module only the collectives handed to the
engine (``step_collective``, ``group_min``) run once the loop has started.

The group: engines that own their lockstep (``owns_lockstep``: DeepInfer) create
torch.distributed's default group while loading; the worker checks it and adds a gloo side group
of its own (``new_group``, never interleaving with DeepInfer's traffic) for the shutdown vote and
``Engine.group_min``. For the others the worker creates the group (gloo, or NCCL for the CUDA
reference engine with a GPU per rank) and gives the engine its ``step_collective``.

Knobs read from the rank's environment (the supervisor passes ``DIB_*`` on, ``rank/launch.py``):
``DIB_RANK_PROFILE`` (benchmarks: ``rank/step_profile.py``), ``DIB_TRANSFER_THREAD`` (A/B
measurements: ``rank/transfers.py``), and two that only tests set, each logged as a warning:

* ``DIB_DEEPINFER_MODULE`` (``TEST_DEEPINFER_MODULE_ENV``): engine 'deepinfer' imports that
  module's ``deepinfer_api()`` instead of DeepInfer (``standins.fake_deepinfer_lockstep``: the CI
  stand-in as a multi-process group); the worker then lifts DeepInfer's Python 3.12 requirement.
* ``DIB_TEST_ENGINE_WRAPPER`` (``TEST_ENGINE_WRAPPER_ENV``): a module whose ``wrap_engine(engine)``
  is applied to the engine once it is built (``standins.step_gate``: holds steps at a test's gate).
  The product code has no test hook of its own in the engine or the loop.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rank import step_profile, transfers
from rank.config import RankConfig

if TYPE_CHECKING:
    import torch
    import zmq
    from torch.distributed import ProcessGroup

    from rank.engine import Engine
    from rank.host_pool import HostPool

    Context = zmq.Context[zmq.Socket[bytes]]

TEST_DEEPINFER_MODULE_ENV = "DIB_DEEPINFER_MODULE"  # tests only: a stand-in for DeepInfer's Python API
TEST_ENGINE_WRAPPER_ENV = "DIB_TEST_ENGINE_WRAPPER"  # tests only: wraps the built engine

log = logging.getLogger(__name__)


class RankStatus:
    """What the heartbeat thread reports (written by the main thread; reads are racy by design:
    a heartbeat only needs a recent value)."""

    __slots__ = ("phase", "progress", "step_started", "num_steps")

    def __init__(self) -> None:
        self.phase = "starting"
        self.progress = ""
        self.step_started = 0.0  # monotonic time the current step/vote began, 0 when not in one
        self.num_steps = 0


@dataclass(slots=True)
class RankParts:
    """Everything ``RankLoop`` runs on, built by ``build_rank``; closed by ``RankLoop.close``."""

    rank: int
    engine: Engine
    host_pool: HostPool | None
    cmd: zmq.Socket[bytes]  # the commands the loop applies (the transfer thread's inproc end when it runs)
    out: zmq.Socket[bytes]  # PUSH to the backend: step messages, replies, ready
    poller: zmq.Poller  # polls ``cmd``
    dist: Any  # torch.distributed
    vote: torch.Tensor  # [has_work, shutdown], on the group's device
    control_group: ProcessGroup | None  # the side group, engines that own the lockstep only
    transfers: transfers.TransferThread | None
    profile: step_profile.NoProfile


def load_config(path: str) -> RankConfig:
    """The ``RankConfig`` the supervisor wrote (validated by the backend, resolved there)."""
    import orjson

    with open(path, "rb") as f:
        return RankConfig.from_json(orjson.loads(f.read()))


def build_rank(args: argparse.Namespace, ctx: Context, status: RankStatus) -> RankParts:
    """Sockets, config, host pool, engine, group, pin, transfer thread: in that order (module docstring)."""
    import torch
    import zmq

    cmd = ctx.socket(zmq.PULL)
    cmd.connect(args.cmd_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(args.out_addr)
    config = load_config(args.config)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    host_pool = None
    if args.host_pool_path and args.host_pool_bytes > 0:
        from rank.host_pool import HostPool

        host_pool = HostPool(args.host_pool_path, args.host_pool_bytes, background_pin=True)
    status.phase, status.progress = "loading", f"building {config.engine} engine"
    engine = _build_engine(config, args.rank, host_pool)
    if host_pool is not None and not host_pool.is_open and engine.bytes_per_block:
        host_pool.open(engine.bytes_per_block)
    status.progress = "joining the rank group"
    dist, vote, control_group = _join_group(config, args, engine)
    if host_pool is not None:
        host_pool.start_pin(lambda done, chunks: _pin_progress(status, done, chunks))
    profile = step_profile.from_environment(args.rank)  # benchmarks only (DIB_RANK_PROFILE)
    profile.wrap_engine_step(engine)
    engine = _test_wrapper(engine, args.rank)
    poller = zmq.Poller()
    # Restores and writes beside the step in progress (rank/transfers.py): the thread takes the
    # backend's command socket and forwards the rest to an inproc socket, the loop's ``cmd``.
    thread: transfers.TransferThread | None = None
    if transfers.enabled(engine):
        forwarded = ctx.socket(zmq.PULL)
        forwarded.setsockopt(zmq.RCVHWM, 0)
        forwarded.bind(transfers.FORWARD_ADDR)
        thread = transfers.TransferThread(ctx, cmd, args.out_addr, engine, engine.stats(), args.channel_addr)
        cmd = forwarded
    poller.register(cmd, zmq.POLLIN)
    return RankParts(args.rank, engine, host_pool, cmd, out, poller, dist, vote, control_group, thread,
                     profile)


def _pin_progress(status: RankStatus, done: int, chunks: int) -> None:
    """The pin's progress in the rank's heartbeat (``/healthz`` shows it per rank) until it ends."""
    status.progress = f"L1 pool pinned {done}/{chunks} chunks" if done < chunks else ""


def _build_engine(config: RankConfig, rank: int, host_pool: HostPool | None) -> Engine:
    from rank import rendezvous
    from rank.engines import make_engine

    rendezvous.install()  # before DeepInfer builds its group: the store binds MASTER_ADDR only
    stand_in = None
    if config.engine == "deepinfer":
        stand_in = os.environ.get(TEST_DEEPINFER_MODULE_ENV) or None
    return make_engine(config, rank, host_pool, deepinfer_module=stand_in)


def _join_group(config: RankConfig, args: argparse.Namespace,
                engine: Engine) -> tuple[Any, torch.Tensor, ProcessGroup | None]:
    """torch.distributed, the vote tensor and the side group (module docstring)."""
    import torch
    import torch.distributed as dist

    control_group: ProcessGroup | None = None
    if engine.owns_lockstep:
        # DeepInfer built its default group while loading; ours would collide with it.
        if not dist.is_initialized():
            raise RuntimeError(f"engine {config.engine!r} owns the lockstep but created no "
                               "torch.distributed group")
        if dist.get_world_size() != args.world_size:
            raise RuntimeError(f"engine's group has {dist.get_world_size()} ranks, the supervisor "
                               f"started {args.world_size}")
        control_group = dist.new_group(backend="gloo")  # collective: every rank, same point
        side = control_group

        def group_min(values: list[int]) -> list[int]:
            """``Engine.group_min``: all_reduce MIN on the side group."""
            t = torch.tensor(values, dtype=torch.int32)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=side)
            return [int(v) for v in t.tolist()]

        engine.group_min = group_min
    else:
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): ranks that share GPUs
        # (fewer visible than ranks, e.g. bench.multi_gpu_run --gpus 1) vote over gloo.
        use_nccl = (config.engine == "reference" and config.uses_gpu
                    and torch.cuda.device_count() >= args.world_size)
        dist.init_process_group(
            "nccl" if use_nccl else "gloo", init_method=f"tcp://{args.master_addr}:{args.master_port}",
            rank=args.rank, world_size=args.world_size,
        )
        if use_nccl:
            torch.cuda.set_device(0)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    vote = torch.zeros(2, dtype=torch.int32, device=device)
    if not engine.owns_lockstep:
        tick = torch.zeros(1, dtype=torch.int32, device=device)
        engine.step_collective = lambda: dist.all_reduce(tick)
    return dist, vote, control_group


def _test_wrapper(engine: Engine, rank: int) -> Engine:
    """TESTS ONLY: the engine as ``$DIB_TEST_ENGINE_WRAPPER.wrap_engine`` returns it (module docstring)."""
    name = os.environ.get(TEST_ENGINE_WRAPPER_ENV)
    if not name:
        return engine
    log.warning("rank %d: %s=%s: TEST wrapper around the engine", rank, TEST_ENGINE_WRAPPER_ENV, name)
    wrapped: Engine = importlib.import_module(name).wrap_engine(engine)
    return wrapped
