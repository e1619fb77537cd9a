"""The service submits admitted turns through the gate (``submit_gate``): exact submit orders.

Stand-ins: a cache that admits every turn on rank 0 with ``cached`` tokens of its prompt cached,
a protocol whose streams only count, and a rank client whose streams the test feeds.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np

from rank.client import GroupState, RequestStream
from rank.engine import FinishReason, RequestOutput
from server.config import load_config
from server.metrics import ServerMetrics
from server.service import ChatService
from standins.admit_all_cache import AdmitAllCache


class _Client:
    state = GroupState.READY

    def __init__(self) -> None:
        self.streams: dict[str, RequestStream] = {}
        self.order: list[str] = []

    def submit(self, rank: int, request_id: str) -> RequestStream:
        self.order.append(request_id)
        self.streams[request_id] = RequestStream(request_id, rank, 1)
        return self.streams[request_id]

    def first_token(self, request_id: str) -> None:
        self.streams[request_id].push(RequestOutput(request_id, [7], False, None, 0, 0))

    def end(self, request_id: str) -> None:
        self.streams[request_id].push(RequestOutput(request_id, [8], True, FinishReason.LENGTH, 0, 0))


class _Protocol:
    def new_stream(self, prepared: Any, request_id: str) -> Any:
        return SimpleNamespace(feed=lambda tokens: b"", stop_hit=False, response_body=dict,
                               finish=lambda *a: b"", finish_reason="length")


def prepared(num_tokens: int) -> Any:
    return SimpleNamespace(api="anthropic", num_prompt_tokens=num_tokens, prompt_ids=np.arange(num_tokens),
                           session_key=None, max_tokens=4, max_tokens_is_default=False,
                           temperature=1.0, top_p=1.0, top_k=0, seed=None, one_off=False)


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def run_three(gate: bool) -> list[list[str]]:
    """A (800 uncached), B (600) and C (1,200 prompt, 1,100 cached: 100 uncached) on one rank
    with a 1,024-token engine budget; the submit order after each event."""
    async def main() -> list[list[str]]:
        config = load_config({"max_num_batched_tokens": 1024, "submit_gate": gate,
                              "submit_gate_max_hold_secs": 600})
        cache, client = AdmitAllCache(max_output_tokens=4), _Client()
        cache.cached[1200] = 1100
        service = ChatService(_Protocol(), cache, client, ServerMetrics(), config)
        tasks, seen = [], []
        for rid, n in (("A", 800), ("B", 600), ("C", 1200)):
            tasks.append(asyncio.create_task(service.complete(prepared(n), rid, 0.0)))
            await _settle()
        seen.append(list(client.order))
        client.first_token("A")  # A's prefill is done: its 800 tokens leave the engine's queue
        await _settle()
        seen.append(list(client.order))
        for rid in list(client.order):
            client.end(rid)
        await asyncio.gather(*tasks)
        seen.append(list(client.order))
        return seen

    return asyncio.run(main())


def test_service_submits_through_the_gate_shortest_work_first_within_the_budget() -> None:
    # A goes; B (800 + 600 > 1,024) waits; C (100 uncached) passes it; A's first token lets B go
    assert run_three(gate=True) == [["A", "C"], ["A", "C", "B"], ["A", "C", "B"]]


def test_service_without_the_gate_submits_in_arrival_order_at_once() -> None:
    assert run_three(gate=False) == [["A", "B", "C"], ["A", "B", "C"], ["A", "B", "C"]]


def test_workload_keys_reach_the_gate_and_the_router() -> None:
    config = load_config({"max_num_batched_tokens": 4096, "submit_gate": True,
                          "submit_gate_max_hold_secs": 3})
    sched = config.scheduling_config()
    assert (sched.enabled, sched.engine_budget_tokens, sched.max_hold_s) == (True, 4096, 3.0)
    assert load_config({}).scheduling_config().enabled is False  # off by default (docs/loadtest.md)
    assert load_config({}).cache_config().router().place_homeless is True  # on by default (late binding)
    assert load_config({"place_homeless": False}).cache_config().router().place_homeless is False
