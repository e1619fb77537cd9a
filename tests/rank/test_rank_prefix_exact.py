"""Starting from cached blocks gives exactly the greedy tokens of a cold run (reference engine).

Cases are seeded-random: prompt lengths, how much of the prompt a donor request covered (its
prompt is a prefix of ours, and its *output* blocks are part of our prompt too, so KV written by
decode steps is reused by prefill), how many requests share a step (batching), and the prefill
token budget (chunking). 120 cases in batches, in-process, on the tiny model in float32.
"""

from __future__ import annotations

import numpy as np
import pytest

from rank.engine import EngineRequest, FinishReason, RequestOutput, SamplingParams, usable_prefix_blocks
from rank.reference_engine import ReferenceEngine, ReferenceEngineConfig

BLOCK = 16
NUM_CASES = 120
BATCH = 24


def _run_all(engine: ReferenceEngine, requests: list[EngineRequest]) -> dict[str, RequestOutput]:
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    final: dict[str, RequestOutput] = {}
    for request in requests:
        engine.add(request)
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                out.token_ids = tokens[out.request_id]
                final[out.request_id] = out
    assert set(final) == set(tokens)
    return final


@pytest.mark.parametrize("batch_index", range(NUM_CASES // BATCH))
def test_prefix_start_matches_cold_greedy(batch_index: int) -> None:
    rng = np.random.default_rng(1000 + batch_index)
    budget = int(rng.choice([40, 64, 512]))
    engine = ReferenceEngine(
        ReferenceEngineConfig(model="tiny", block_size=BLOCK, num_blocks=512, max_num_batched_tokens=budget)
    )
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    # Donors: their prompt + output blocks become the cache.
    donors = []
    for i in range(BATCH):
        donor_len = int(rng.integers(2 * BLOCK, 5 * BLOCK))
        donors.append(EngineRequest(f"d{i}", rng.integers(3, 129_280, donor_len).astype(np.int32),
                                    SamplingParams(max_tokens=int(rng.integers(1, 12)), ignore_eos=True)))
    donor_out = _run_all(engine, donors)
    cold, warm, used = [], [], []
    for i, donor in enumerate(donors):
        out = donor_out[f"d{i}"]
        assert out.finish_reason == FinishReason.LENGTH
        history = np.concatenate([donor.prompt_ids, np.asarray(out.token_ids, np.int32)])
        # The new prompt continues the donor's history, or diverges inside it.
        cut = int(rng.integers(BLOCK + 1, len(history) + 1))
        extra = rng.integers(3, 129_280, int(rng.integers(1, 40))).astype(np.int32)
        prompt = np.concatenate([history[:cut], extra])
        num_matched = min(len(out.kept_blocks), cut // BLOCK)
        n = usable_prefix_blocks(num_matched, len(prompt), BLOCK)
        used.append(n)
        cold.append(EngineRequest(f"c{i}", prompt, greedy, keep_blocks=False))
        warm.append(EngineRequest(f"w{i}", prompt, greedy, prefix_blocks=out.kept_blocks[:n],
                                  num_cached_tokens=n * BLOCK, keep_blocks=False))
    cold_out = _run_all(engine, cold)
    warm_out = _run_all(engine, warm[::-1])  # a different batch order, too
    for i in range(BATCH):
        assert warm_out[f"w{i}"].num_cached_tokens == used[i] * BLOCK
        assert (warm_out[f"w{i}"].token_ids
                == cold_out[f"c{i}"].token_ids), f"case {i}: prefix {used[i]} blocks"
    assert sum(used) > 0
    for out in donor_out.values():
        engine.release(out.kept_blocks)
    engine.check_accounting()
    assert engine.stats().num_free_blocks == engine.num_blocks - 1
