"""TEST ONLY: the DeepInfer stand-in (``standins/fake_deepinfer.py``) as a group of rank processes.

``python -m rank.worker`` imports this module instead of ``deepinfer`` when the environment has
``DIB_DEEPINFER_MODULE=standins.fake_deepinfer_lockstep`` (tests put it in the workload's
``deepinfer_env``; the worker stand-in in the backend's environment); ``DIB_FAKE_DEEPINFER`` holds
JSON options: ``patched`` (default true), ``core`` and any ``standins.fake_deepinfer.FakeOptions``
field. Never set these in production: the worker logs a warning naming the stand-in.

``core: "installed"`` runs on the DeepInfer package installed in the rank's interpreter (the
DeepInfer venv, ``scripts/build_deepinfer.sh``): DeepInfer's real ``EngineArgs`` and its compiled
``Scheduler``, ``BlockManager``, ``Sequence``, output pools and ``build_request_outputs``, the
Scheduler voting prefill (ALL/ANY points) over DeepInfer's default group across the ranks. Only
the SM100 forward and ``LLMEngine``'s step loop around it are this stand-in's (no NextN/MTP head:
``DEEPINFER_USE_NEXTN_DECODE`` defaults to 0). A ``libcuda.so.1`` must be loadable (the build's
stub on a GPU-less machine).

The in-process stand-in is one rank voting alone. This module adds what DeepInfer does *across*
ranks (facts: the ``deepinfer==0.1.0`` sdist, ``docs/deepinfer.md``), so the rank worker's lockstep
is tested against the same shape of collectives:

* ``LLMEngine`` construction creates torch.distributed's *default* group itself (gloo,
  ``tcp://$MASTER_ADDR:($MASTER_PORT-50+engine_group_rank)``, rank ``engine_rank``, world
  ``data_parallel_size``), and refuses to start if one exists already (a worker that created its
  own group would collide with DeepInfer's).
* ``has_unfinished_requests()`` is an all_reduce MAX over the group.
* every ``step()`` joins one all_reduce standing in for the forward's EP dispatch/combine (a rank
  with nothing scheduled runs DeepInfer's placeholder forward, which joins it too);
  ``flush_inflight_reqs()`` is rank-local.
* ``close()`` runs DeepInfer's double ``dist.barrier()``: a rank closing alone blocks.

Each collective carries (kind, sequence number) and checks that every rank is in the same one:
ranks out of lockstep fail loudly here ("lockstep broken") instead of silently pairing a vote
with a step, which gloo would allow for same-shaped tensors.

With ``null_forward`` (benchmarks: ``bench/decode_bench.py``) there is no forward, hence no
per-step collective: the ranks stay in lockstep through the vote alone.

Not modelled with the stand-in core: the ALL/ANY prefill votes (each rank decides prefill
locally, every ``DEEPINFER_PREFILL_ATTEMPT_INTERVAL`` decode steps); with either core: timing
and GPU memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from standins import fake_deepinfer

OPTIONS_ENV = "DIB_FAKE_DEEPINFER"
_VOTE, _STEP = 1, 2
_WORLD = "world"  # options.dp_group placeholder: the default group, once the engine created it


class LockstepBroken(RuntimeError):
    """Ranks reached different collectives (or the same one a different number of times)."""


class _GroupMember:
    """Mixin over ``FakeLLMEngine``: DeepInfer's cross-rank collectives (module docstring)."""

    options: fake_deepinfer.FakeOptions  # FakeLLMEngine's

    def __init__(self, args: Any) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised: DeepInfer creates the default "
                               "group itself, the caller must not")
        if "MASTER_PORT" not in os.environ:
            raise KeyError("MASTER_PORT is not set (DeepInfer's rendezvous is "
                           "MASTER_PORT-50+engine_group_rank)")
        port = int(os.environ["MASTER_PORT"]) - 50 + int(args.engine_group_rank)
        addr = os.environ.get("MASTER_ADDR", "localhost")
        timeout_s = int(os.environ.get("DEEPINFER_GLOO_TIMEOUT", "14400"))
        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=int(args.engine_rank),
                                world_size=int(args.data_parallel_size), timeout=timedelta(seconds=timeout_s))
        self._dist = dist
        self._num_votes = 0
        self._num_group_steps = 0
        if self.options.dp_group == _WORLD:  # DeepInfer's Scheduler votes prefill on its default group
            self.options = dataclasses.replace(self.options, dp_group=dist.group.WORLD)
        super().__init__(args)  # type: ignore[call-arg]

    def _collective(self, kind: int, seq: int, value: int) -> int:
        t = torch.tensor([kind, -kind, seq, -seq, value], dtype=torch.int64)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX)
        if int(t[0]) != -int(t[1]) or int(t[2]) != -int(t[3]):
            raise LockstepBroken(f"lockstep broken: this rank is in collective kind {kind} #{seq}, a peer in "
                                 f"kind {-int(t[1])}..{int(t[0])} #{-int(t[3])}..{int(t[2])}")
        return int(t[4])

    def has_unfinished_requests(self) -> bool:
        local = super().has_unfinished_requests()  # type: ignore[misc]
        self._num_votes += 1
        return bool(self._collective(_VOTE, self._num_votes, int(local)))

    def step(self) -> np.ndarray:
        self._num_group_steps += 1
        if not self.options.null_forward:  # the null forward has no model, so no EP collectives
            self._collective(_STEP, self._num_group_steps, 0)  # the forward's EP dispatch/combine
        return super().step()  # type: ignore[misc]

    def close(self) -> None:
        if not self.closed and self._dist.is_initialized():  # type: ignore[attr-defined]
            self._dist.barrier()
            self._dist.barrier()
        super().close()  # type: ignore[misc]


def deepinfer_api() -> SimpleNamespace:
    """What ``rank.deepinfer_adapter.import_deepinfer`` returns, over the multi-rank stand-in."""
    options: dict[str, Any] = json.loads(os.environ.get(OPTIONS_ENV) or "{}")
    patched = bool(options.pop("patched", True))
    core = options.pop("core", "stand-in")
    # Read at import time, as DeepInfer's SchedulerConfig defaults are (the adapter sets it).
    options.setdefault("prefill_attempt_interval",
                       int(os.environ.get("DEEPINFER_PREFILL_ATTEMPT_INTERVAL", "1")))
    options.setdefault("prefill_any_attempt_interval",
                       int(os.environ.get("DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL", "0")))
    if core == "installed":
        return _installed_api(options)
    if core != "stand-in":
        raise ValueError(f"{OPTIONS_ENV}: core must be 'stand-in' or 'installed', got {core!r}")
    api = fake_deepinfer.make_api(patched=patched, **options)
    api.LLMEngine = type("FakeLLMEngine", (_GroupMember, api.LLMEngine), {})
    return api


def _installed_api(options: dict[str, Any]) -> SimpleNamespace:
    """The installed DeepInfer package with this module's forward (``core: "installed"``)."""
    os.environ.setdefault("DEEPINFER_USE_NEXTN_DECODE", "0")  # read by the Scheduler's constructor
    import deepinfer  # type: ignore[import-not-found]  # noqa: F401 - the package's own __init__ runs
    from deepinfer._C import engine  # type: ignore[import-not-found]
    from deepinfer.engine.arg_utils import EngineArgs  # type: ignore[import-not-found]

    options["dp_group"] = _WORLD
    api = fake_deepinfer.make_api(core=engine, **options)
    api.LLMEngine = type("FakeLLMEngine", (_GroupMember, api.LLMEngine), {})
    api.EngineArgs = EngineArgs
    return api
