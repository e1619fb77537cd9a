"""The stand-in's null forward (bench/decode_bench.py) and the adapter's per-step reading of
DeepInfer's outputs."""

from __future__ import annotations

from typing import Any

import numpy as np

from rank.engine import FinishReason
from tests.deepinfer.deepinfer_harness import drive, make_engine, prompt, random_scenario, request

EXTRA_TOKEN = 7


def _with_mtp_tokens(engine: Any) -> None:
    """Put an earlier MTP token before every running token output, as DeepInfer's
    ``build_request_outputs`` does with accepted draft tokens (``finished`` 0, reason "")."""
    llm = engine.llm
    inner = llm.step
    ro = engine.api.RequestOutput

    def step() -> np.ndarray:
        ptrs = []
        for ptr in inner().tolist():
            if not ro.get_finished(ptr):
                ptrs.append(ro._alloc(request_id=ro.get_request_id(ptr), prompt_len=0, token_id=EXTRA_TOKEN,
                                      finish_reason="", finished=False, num_output_tokens=0))
            ptrs.append(ptr)
        out = np.asarray(ptrs, dtype=np.uint64)
        llm._to_release.append(out)
        return out

    llm.step = step


def test_several_tokens_of_one_request_in_a_step_merge_in_order() -> None:
    engine = make_engine()
    engine.add(request("a", prompt(200, 1), 5, keep=False))
    _with_mtp_tokens(engine)
    t = drive(engine)
    outs = t.outputs["a"]
    tokens = [out.token_ids for out in outs]
    assert all(ids[0] == EXTRA_TOKEN and len(ids) == 2 for ids in tokens[:-1]), tokens
    assert len(tokens[-1]) == 1 and outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
    assert sum(map(len, tokens)) == 5 + len(tokens) - 1  # one extra per non-final step
    assert engine.stats().num_free_blocks == engine.num_blocks - 1


def test_sequences_of_ended_requests_are_dropped_once_deepinfer_frees_them() -> None:
    engine = make_engine(num_gpu_blocks=64)
    for i in range(3):
        engine.add(request(f"r{i}", prompt(150 + i, i), 3 + i, keep=False))
    drive(engine)
    assert engine._releasing == []  # the list of sequences to watch does not grow with traffic
    assert engine._live_seqs() == []
    random_scenario(engine, num_requests=20, seed=3)
    assert engine._releasing == [] and engine._live_seqs() == []


def test_null_forward_emits_ids_without_touching_the_kv_pool() -> None:
    engine = make_engine(null_forward=True, vocab_size=129280)
    for i in range(4):
        engine.add(request(f"r{i}", prompt(100 + 60 * i, i), 9, keep=False))
    t = drive(engine)
    for i in range(4):
        ids = t.tokens(f"r{i}")
        assert len(ids) == 9 and all(3 <= x < 129280 for x in ids)
        assert t.terminal(f"r{i}").finish_reason is FinishReason.LENGTH
    assert len({tuple(t.tokens(f"r{i}")) for i in range(4)}) > 1  # not one constant stream
    assert int(engine.llm._kv.count_nonzero()) == 0
    assert engine.stats().num_free_blocks == engine.num_blocks - 1
