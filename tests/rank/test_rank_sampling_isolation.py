"""Rank side: no sampling value kills a rank; a bad request fails alone.

A property test over random sampling parameters, run against REAL rank processes (``RankGroup``,
2 ranks in gloo lockstep): the reference engine with the 'tiny' model (real logits, the torch
sampler) and with the 'null' model (the seed arithmetic), and engine 'deepinfer' over the CI
stand-in (the adapter's guard before its batch-level ``llm.step()``). Each example submits a
small batch to one rank, so the requests share steps. The values cover the whole engine-value
space, far outside what the boundary lets through (NaN, inf, negative, 1e-50, 5e-324, seeds
of -5 and 2**64-1, top_k at and past the vocabulary), because this layer is the defence in depth.

Properties, per example:
* the group never restarts (same epoch, state READY, no rank failure);
* a request whose values ``protocol.sampling.sampling_error`` refuses is rejected alone
  (``EngineMisuse`` on its stream) and one it accepts finishes normally (STOP or LENGTH), whatever
  its batch-mates sent.

Before the fix (red): top_p 1e-50 on 'tiny' raised in ``torch.multinomial`` inside the step and
seed -5 on 'null' raised ``OverflowError``; either killed the rank and restarted the group.
Default run: ~150 requests per engine; ``-m slow`` runs ~2,500 per engine.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from protocol.sampling import sampling_error
from rank.client import GroupState
from rank.engine import EngineMisuse, EngineRequest, FinishReason, SamplingParams
from rank.group import RankGroup
from server.config import WorkloadConfig

VOCAB = {"tiny": 129_280, "null": 129_280, "deepinfer": 1000}
pytestmark = pytest.mark.timeout(1800)


def _config(kind: str) -> WorkloadConfig:
    if kind == "deepinfer":
        fake = {"patched": True, "num_gpu_blocks": 96, "vocab_size": VOCAB[kind]}
        return WorkloadConfig(
            engine="deepinfer", deepinfer_venv=sys.prefix, model_dir="/nonexistent/model", ep=2,
            max_model_len=4096, max_num_seqs=16, max_num_batched_tokens=512, prefill_attempt_interval=1,
            prefill_any_attempt_interval=1, l1_host_gb=0.0, load_timeout_seconds=180,
            deepinfer_env={"DIB_DEEPINFER_MODULE": "standins.fake_deepinfer_lockstep",
                           "DIB_FAKE_DEEPINFER": json.dumps(fake), "OMP_NUM_THREADS": "1"})
    return WorkloadConfig(reference_model=kind, ep=2, block_size=16, reference_num_blocks=256,
                          max_num_batched_tokens=256, max_num_seqs=16, l1_host_gb=0.0)


class _Harness:
    """A started group on a private loop that the (sync) hypothesis examples drive."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.loop = asyncio.new_event_loop()
        self.group = RankGroup(_config(kind).rank_config())
        self.loop.run_until_complete(self.group.start())
        self.epoch = self.group.epoch
        self.seen: Counter[str] = Counter()
        self.next_id = 0

    def close(self) -> None:
        self.loop.run_until_complete(self.group.close())
        self.loop.close()


@pytest.fixture(scope="module", params=["tiny", "null", "deepinfer"])
def harness(request: pytest.FixtureRequest) -> Iterator[_Harness]:
    h = _Harness(request.param)
    try:
        yield h
    finally:
        print(f"\n{h.kind}: {sum(h.seen.values())} requests: {dict(h.seen)}")
        h.close()


_wild_float = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(0.0, 1e-4),
    st.sampled_from([0.0, 1e-50, 5e-324, 1e-6, 1e-5, 2.0, 2.5, -0.0, -1.0, math.nan, math.inf, 1e308]),
)
_wild_top_k = st.one_of(st.integers(-(2**31), 2**31),
                        st.sampled_from([-2, 0, 999, 1000, 1001, 129_279, 129_280]))
_wild_seed = st.one_of(st.integers(-(2**63), 2**64 - 1), st.sampled_from([-5, -1, 2**64 - 1]))


def _requests(vocab: int) -> st.SearchStrategy[tuple[int, float, float, int, int | None]]:
    """(max_tokens, temperature, top_p, top_k, seed): mostly values an engine runs (their edges
    included), a quarter with some fields wild."""
    max_tokens = st.integers(1, 4)
    temperature = st.one_of(st.just(0.0), st.floats(1e-5, 2.0), st.sampled_from([1e-5, 2.0]))
    top_p = st.one_of(st.floats(1e-6, 1.0), st.sampled_from([1e-6, 1.0]))
    top_k = st.one_of(st.just(-1), st.integers(1, vocab - 1), st.sampled_from([1, vocab - 1]))
    seed = st.one_of(st.none(), st.integers(0, 2**64 - 1), st.sampled_from([0, 2**63, 2**64 - 1]))
    valid = st.tuples(max_tokens, temperature, top_p, top_k, seed)
    mixed = st.tuples(st.one_of(max_tokens, st.integers(-1, 0)), st.one_of(temperature, _wild_float),
                      st.one_of(top_p, _wild_float), st.one_of(top_k, _wild_top_k),
                      st.one_of(seed, _wild_seed))
    return st.one_of(valid, valid, valid, mixed)


async def _outcome(stream: Any) -> str:
    last = None
    try:
        async for out in stream:
            last = out
    except EngineMisuse:
        return "rejected"
    assert last is not None and last.finished
    return last.finish_reason.value if last.finish_reason else "none"


def _check_batch(h: _Harness, batch: list[tuple[int, float, float, int, int | None]], rank: int) -> None:
    async def run() -> list[str]:
        streams = []
        for max_tokens, temperature, top_p, top_k, seed in batch:
            h.next_id += 1
            ids = np.random.default_rng(h.next_id).integers(3, VOCAB[h.kind], size=20, dtype=np.int32)
            sp = SamplingParams(max_tokens, temperature, top_p, top_k, seed, ignore_eos=True)
            streams.append(h.group.submit(rank, EngineRequest(f"s{h.next_id}", ids, sp, keep_blocks=False)))
        return list(await asyncio.wait_for(asyncio.gather(*(_outcome(s) for s in streams)), 120))

    outcomes = h.loop.run_until_complete(run())
    assert h.group.state is GroupState.READY and h.group.epoch == h.epoch, (
        f"the rank group restarted: {h.group.last_failure}")
    for (max_tokens, temperature, top_p, top_k, seed), got in zip(batch, outcomes):
        h.seen[got] += 1
        runnable = sampling_error(max_tokens, temperature, top_p, top_k, seed, VOCAB[h.kind]) is None
        expected = {FinishReason.STOP.value, FinishReason.LENGTH.value} if runnable else {"rejected"}
        assert got in expected, (max_tokens, temperature, top_p, top_k, seed, got)


def _property(h: _Harness, num_examples: int) -> None:
    @settings(max_examples=num_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(batch=st.lists(_requests(VOCAB[h.kind]), min_size=1, max_size=6), rank=st.integers(0, 1))
    @example(batch=[(4, 0.8, 1e-50, -1, None), (4, 0.8, 0.9, 40, 7)], rank=0)  # tiny: multinomial raised
    @example(batch=[(4, 0.8, 1.0, -1, -5), (4, 0.8, 1.0, -1, 2**64 - 1), (3, 0.0, 1.0, -1, 1)],
             rank=1)  # null: OverflowError
    @example(batch=[(4, 1e-5, 1e-6, 999, 2**64 - 1), (2, math.nan, 1.0, -1, None)], rank=0)
    def check(batch: list[tuple[int, float, float, int, int | None]], rank: int) -> None:
        _check_batch(h, batch, rank)

    check()


def test_random_sampling_values_never_kill_a_rank(harness: _Harness) -> None:
    _property(harness, 40)


@pytest.mark.slow
def test_random_sampling_values_never_kill_a_rank_thousands(harness: _Harness) -> None:
    _property(harness, 700)
