"""One way to build and drive every Engine (rank/engine.py), for the engine-contract suite.

A ``Kit`` builds an engine of a given size with what the contract needs (``num_blocks`` blocks of
``block_size`` tokens including scratch block 0, a token budget per step, ``max_num_seqs``, an
optional L1 host pool of ``host_slots`` slots), makes prompts from its vocabulary and names the
words its errors use. ``drive`` runs the engine as the rank worker does and checks the output
invariants on the way (one output per request per step, one terminal, nothing after it) and
``check_accounting`` after every step.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rank.engine import Engine, EngineRequest, RequestOutput, SamplingParams


@dataclass(frozen=True)
class Kit:
    name: str
    block_size: int
    vocab_size: int
    build: Callable[...,
                    Engine]  # build(tmp, num_blocks=, host_slots=, budget=, max_num_seqs=, max_model_len=)
    too_long_error: str  # a word of the error a prompt over max_model_len ends with
    out_of_blocks_error: str  # ... and of the one a decode that finds no free block ends with

    def prompt(self, n: int, seed: int) -> np.ndarray:
        return np.random.default_rng(seed).integers(3, min(900, self.vocab_size), size=n, dtype=np.int32)

    def request(self, rid: str, ids: np.ndarray, max_tokens: int = 8, prefix: list[int] | None = None,
                keep: bool = True, ignore_eos: bool = True, **sampling: Any) -> EngineRequest:
        prefix = prefix or []
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, **sampling)
        return EngineRequest(rid, ids, sp, prefix, self.block_size * len(prefix), keep)


@dataclass
class Transcript:
    """Everything a drive produced, checked against the Engine output invariants on the way."""

    outputs: dict[str, list[RequestOutput]] = field(default_factory=dict)
    steps: int = 0

    def tokens(self, rid: str) -> list[int]:
        return [t for out in self.outputs[rid] for t in out.token_ids]

    def terminal(self, rid: str) -> RequestOutput:
        last = self.outputs[rid][-1]
        assert last.finished, f"{rid} has no terminal output"
        return last

    def record(self, outs: list[RequestOutput]) -> None:
        seen: set[str] = set()
        for out in outs:
            assert out.request_id not in seen, f"two outputs for {out.request_id} in one step"
            seen.add(out.request_id)
            prior = self.outputs.setdefault(out.request_id, [])
            assert not (prior and prior[-1].finished), f"output for {out.request_id} after its terminal"
            prior.append(out)


def drive(engine: Engine, transcript: Transcript | None = None, max_steps: int = 2000,
          before_step: Callable[[int], None] | None = None,
          until: Callable[[Transcript], bool] | None = None) -> Transcript:
    """The rank worker's loop until idle: the group's vote (DeepInfer's own where the engine owns
    the lockstep: its outputs can come one step after the vote), then ``step``."""
    t = transcript or Transcript()
    owns_lockstep = bool(getattr(engine, "owns_lockstep", False))
    for i in range(max_steps):
        if before_step is not None:
            before_step(i)
        group_has_work = (engine.lockstep_has_work()
                          if owns_lockstep else engine.has_work())  # type: ignore[attr-defined]
        outs = engine.step()
        t.steps += 1
        t.record(outs)
        engine.check_accounting()
        if until is not None and until(t):
            return t
        if not group_has_work and not outs and not engine.has_work():
            return t
    raise AssertionError(f"engine still busy after {max_steps} steps")


# --- the engines --------------------------------------------------------------------------------


def _host_pool(tmp: Path, host_slots: int, bytes_per_block: int) -> Any:
    """An L1 pool file of ``host_slots`` blocks of ``bytes_per_block`` (its ``num_slots`` says)."""
    if not host_slots:
        return None
    from rank.host_pool import HostPool

    return HostPool(os.path.join(str(tmp), "l1"), host_slots * bytes_per_block, pin=False)


_REFERENCE_BYTES_PER_BLOCK = {"tiny": 8192, "null": 64}  # at block_size 16 (ReferenceEngine.bytes_per_block)


def _reference(model: str) -> Kit:
    def build(tmp: Path, *, num_blocks: int, host_slots: int = 0, budget: int = 48, max_num_seqs: int = 4,
              max_model_len: int = 400) -> Engine:
        from rank.reference_engine import ReferenceEngine, ReferenceEngineConfig

        config = ReferenceEngineConfig(model=model, block_size=16, num_blocks=num_blocks,
                                       max_num_seqs=max_num_seqs,
                                       max_num_batched_tokens=budget, max_model_len=max_model_len)
        return ReferenceEngine(config, _host_pool(tmp, host_slots, _REFERENCE_BYTES_PER_BLOCK[model]))

    return Kit(f"reference-{model}", 16, 129280, build, "max_model_len", "KV pool exhausted")


def _scripted() -> Kit:
    def build(tmp: Path, *, num_blocks: int, host_slots: int = 0, budget: int = 48, max_num_seqs: int = 4,
              max_model_len: int = 400) -> Engine:
        from standins.scripted_engine import ScriptedEngine, load_tokenizer
        from standins.scripted_replies import Script

        script = Script.model_validate({"tokens_per_step": 3, "replies": [],
                                        "default": {"name": "default", "text": "A scripted reply."}})
        return ScriptedEngine(script, _tokenizer(load_tokenizer), block_size=16, num_blocks=num_blocks,
                              max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=budget,
                              host_pool=_host_pool(tmp, host_slots, 16 * 4))

    return Kit("scripted", 16, 129280, build, "max_model_len", "KV pool exhausted")


_TOKENIZER: list[Any] = []


def _tokenizer(load: Callable[[], Any]) -> Any:
    if not _TOKENIZER:
        _TOKENIZER.append(load())
    return _TOKENIZER[0]


def native_core() -> dict[str, Any]:
    """DeepInfer's compiled scheduler (the DeepInfer venv, ``scripts/test_deepinfer_build.sh``)."""
    import torch.distributed as dist

    os.environ["DEEPINFER_USE_NEXTN_DECODE"] = "0"  # read by the Scheduler's constructor (default 5)
    try:
        from deepinfer import _C as module  # the DeepInfer venv's (libcuda.so.1: the build's stub)
    except ImportError as exc:
        if os.environ.get("DEEPINFER_BUILD_DIR"):  # in CI's deepinfer_build step: it must be there
            pytest.fail(f"deepinfer._C does not import ({exc})")
        pytest.skip(f"DeepInfer is not importable here ({exc}): bash scripts/test_deepinfer_build.sh runs it")
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return {"core": module.engine, "dp_group": dist.group.WORLD}


def _deepinfer(core: str) -> Kit:
    def build(tmp: Path, *, num_blocks: int, host_slots: int = 0, budget: int = 512, max_num_seqs: int = 8,
              max_model_len: int = 4096) -> Engine:
        from tests.deepinfer.deepinfer_harness import make_engine

        native = native_core() if core == "installed" else {}
        return make_engine(host_slots=host_slots, num_gpu_blocks=num_blocks, **native,
                           settings_overrides={"max_model_len": max_model_len,
                                               "max_num_batched_tokens": budget,
                                               "max_num_seqs": max_num_seqs})

    return Kit(f"deepinfer-{core}", 128, 1000, build, "prompt_length_exceeded",
               "insufficient_system_resource")


KITS = {kit.name: kit for kit in (_reference("tiny"), _reference("null"), _deepinfer("fake"),
                                  _deepinfer("installed"), _scripted())}
