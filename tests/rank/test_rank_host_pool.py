"""The shared L1 host pool: two mappings of one /dev/shm file see each other's bytes."""

from __future__ import annotations

import os

import pytest
import torch

from rank.host_budget import host_pool_path, plan_host_pool_bytes, unlink_host_pool
from rank.host_pool import HostPool


def test_two_mappings_share_bytes_and_unlink_removes_the_file() -> None:
    path = host_pool_path(f"test-{os.getpid()}")
    unlink_host_pool(path)
    a, b = HostPool(path, 10_000, pin=False), HostPool(path, 10_000, pin=False)
    try:
        a.open(1024)
        b.open(1024)
        assert a.num_slots == b.num_slots == 9
        device = torch.arange(4 * 1024, dtype=torch.int64).remainder(251).to(torch.uint8).view(4, 1024)
        a.copy_from_device(device, [3, 1], 7)
        back = torch.zeros_like(device)
        b.copy_to_device(back, [0, 2], 7)
        assert torch.equal(back[0], device[3]) and torch.equal(back[2], device[1])
        with pytest.raises(ValueError):
            a.copy_from_device(device, [0, 1, 2], 7)  # past the last slot
        with pytest.raises(ValueError):
            a.open(2048)  # geometry is fixed once open
    finally:
        a.close()
        b.close()
        unlink_host_pool(path)
    assert not os.path.exists(path)


def test_budget_is_lowered_to_what_the_machine_allows() -> None:
    budget, reason = plan_host_pool_bytes(1e6, 4)  # an absurd ask
    assert 0 < budget < int(1e6 * (1 << 30))
    assert "L1 host pool" in reason
