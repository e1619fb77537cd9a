"""Turns the service stops listening to while their engine request ends anyway must not leak.

A stop sequence found in the same engine step that finishes the request (the scripted model
emits its whole reply in one step here): the engine already handed the turn's blocks to the
cache, so closing the admission with a plain abort would leave them held forever. The balance
check (engine cache-held == L0, free + held == pool) after each turn catches that.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.support.runtime_thread import RuntimeThread

LONG = " ".join(f"w{i}" for i in range(120))
SCRIPT = {"description": "abort races", "tokens_per_step": 4096,
          "replies": [{"name": "stop", "text": f"{LONG} STOPHERE tail"}]}


@pytest.fixture(scope="module")
def rt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RuntimeThread]:
    script = tmp_path_factory.mktemp("races") / "script.json"
    script.write_text(json.dumps(SCRIPT))
    config = {"engine": "scripted", "script_file": str(script), "ep": 1, "block_size": 16,
              "reference_num_blocks": 512, "max_model_len": 4096, "l1_cache": False, "port": 0}
    with RuntimeThread(config, rank_mode="local") as handle:
        yield handle


@pytest.mark.parametrize("api,stream",
                         [("anthropic", True), ("anthropic", False), ("openai", True), ("openai", False)])
def test_stop_sequence_in_the_final_step_keeps_blocks_balanced(rt: RuntimeThread, api: str,
                                                               stream: bool) -> None:
    messages = [{"role": "user", "content": f"{api} {stream} please " + LONG}]
    if api == "anthropic":
        body = {"model": "default", "max_tokens": 1000, "stream": stream, "messages": messages,
                "stop_sequences": ["STOPHERE"]}
        resp = httpx.post(rt.url + "/v1/messages", json=body, timeout=60)
    else:
        body = {"model": "default", "max_tokens": 1000, "stream": stream, "messages": messages,
                "stop": ["STOPHERE"]}
        resp = httpx.post(rt.url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200
    assert " tail" not in resp.text  # cut at the stop sequence
    if api == "anthropic":
        assert "stop_sequence" in resp.text
    sizes = rt.settle()
    assert sum(sizes["l0_blocks"]) > 0, "the turn's blocks were not filed"
    assert sizes["l0_blocks"] == sizes["engine_cached_blocks"]
