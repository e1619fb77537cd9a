"""Shared settings for the rank tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The tiny model's ops are small: with the 2 CI cores shared by other processes, OpenMP
    threads spin-waiting on each other make them ~6x slower (measured), so run on one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
