"""MASTER_PORT: the configured port is the one the ranks rendezvous on, in every epoch; unset, the
group picks a free one. The interpreter: the DeepInfer venv's whenever one is configured."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import numpy as np
import psutil
import pytest

from rank.client import GroupState
from rank.engine import EngineRequest, SamplingParams
from rank.group import RankGroup
from rank.launch import rank_python
from server.config import WorkloadConfig
from tests.rank.rank_stream_helpers import collect
from tests.support.ports import free_port


def _config(**overrides: Any) -> WorkloadConfig:
    base: dict[str, Any] = dict(reference_model="tiny", ep=2, block_size=16, reference_num_blocks=64,
                                max_num_batched_tokens=256, l1_host_gb=0, load_timeout_seconds=120)
    base.update(overrides)
    return WorkloadConfig(**base)


def _master_ports(group: RankGroup) -> set[str]:
    ports = set()
    for pid in group.pids():
        cmd = psutil.Process(pid).cmdline()
        ports.add(cmd[cmd.index("--master-port") + 1])
        assert psutil.Process(pid).environ()["MASTER_PORT"] == cmd[cmd.index("--master-port") + 1]
    return ports


def test_rank_python_is_the_deepinfer_venvs_whatever_the_engine() -> None:
    assert (rank_python(_config(deepinfer_venv="/workspace/di-venv").rank_config())
            == "/workspace/di-venv/bin/python")
    assert rank_python(_config().rank_config()) == sys.executable
    assert (RankGroup(_config(deepinfer_venv="/workspace/di-venv").rank_config()).python
            == "/workspace/di-venv/bin/python")


@pytest.mark.timeout(240)
def test_configured_master_port_is_used_in_every_epoch() -> None:
    port = free_port()

    async def scenario() -> None:
        group = RankGroup(_config(deepinfer_env={"MASTER_PORT": str(port)}).rank_config(),
                          python=sys.executable,
                          restart_backoff_s=0.2)
        await group.start()
        try:
            assert _master_ports(group) == {str(port)}
            os.kill(group.pids()[1], signal.SIGKILL)
            for _ in range(600):  # the restart binds the same port again (no TIME_WAIT trouble)
                if group.epoch == 2 and group.state == GroupState.READY:
                    break
                await asyncio.sleep(0.1)
            assert group.epoch == 2 and group.state == GroupState.READY, group.last_failure
            assert _master_ports(group) == {str(port)}
            ids = np.arange(3, 40, dtype=np.int32)
            tokens, _ = await collect(group.submit(0, EngineRequest("r", ids, SamplingParams(max_tokens=3))))
            assert len(tokens) == 3
        finally:
            await group.close()

    asyncio.run(scenario())


@pytest.mark.timeout(120)
def test_env_master_port_counts_and_unset_picks_a_free_one() -> None:
    assert _config(env={"MASTER_PORT": "29600"}).master_port == "29600"
    assert _config(env={"MASTER_PORT": "29600"},
                   deepinfer_env={"MASTER_PORT": "29611"}).master_port == "29611"
    assert _config().master_port is None

    async def scenario() -> None:
        group = RankGroup(_config(ep=1).rank_config(), python=sys.executable)
        await group.start()
        try:
            (picked,) = _master_ports(group)
            assert int(picked) > 1024
        finally:
            await group.close()

    asyncio.run(scenario())


@pytest.mark.timeout(240)
def test_rank_listeners_bind_loopback_only() -> None:
    """torch's tcp:// rendezvous store used to listen on every interface (``::``) without
    authentication; every TCP listener of a rank (the store on rank 0, Gloo's pair sockets) is
    on loopback now."""

    async def scenario() -> None:
        group = RankGroup(_config().rank_config(), python=sys.executable)
        await group.start()
        try:
            listeners = [(pid, c.laddr) for pid in group.pids()
                         for c in psutil.Process(pid).net_connections(kind="inet") if c.status == "LISTEN"]
            master = int(_master_ports(group).pop())
            assert any(addr.port == master for _pid, addr in listeners), listeners  # the store was seen
            assert all(addr.ip in ("127.0.0.1", "::1") for _pid, addr in listeners), listeners
        finally:
            await group.close()

    asyncio.run(scenario())
