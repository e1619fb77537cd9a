"""The disk's own speed (cache/l2_io.py ``measure_read``, ``measure_sequential``): the raw
figures that L2 restores are compared with read every byte once, at one or several reads in
flight, and stop at the end of the file."""

from __future__ import annotations

import mmap
import os
import threading

import numpy as np
import pytest

from cache.l2_format import ALIGN
from cache.l2_io import measure_read, measure_sequential, open_direct


def _buffers(n: int, nbytes: int) -> list[np.ndarray]:
    return [np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8) for _ in range(n)]


@pytest.mark.parametrize("depth", [1, 3])
def test_measure_read_reads_every_byte_once(tmp_path, monkeypatch, depth: int) -> None:
    path = str(tmp_path / "f")
    size = 37 * ALIGN  # not a whole number of 8-page chunks: the last read is a short one
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    real = os.preadv
    offsets: list[int] = []
    lock = threading.Lock()

    def recorded(fd: int, buffers: list[memoryview], offset: int) -> int:
        with lock:
            offsets.append(offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", recorded)
    fd, is_direct = open_direct(path, os.O_RDONLY)
    try:
        got, seconds = measure_read(fd, is_direct, size, _buffers(depth, 8 * ALIGN))
    finally:
        os.close(fd)
    assert got == size and seconds > 0
    assert sorted(offsets) == list(range(0, size, 8 * ALIGN))


def test_measure_read_stops_at_the_end_of_the_file(tmp_path) -> None:
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(bytes(5 * ALIGN))
    fd, is_direct = open_direct(path, os.O_RDONLY)
    try:
        got, _ = measure_read(fd, is_direct, 64 * ALIGN, _buffers(2, 4 * ALIGN))
    finally:
        os.close(fd)
    assert got == 5 * ALIGN


def test_measure_sequential_reads_at_each_depth(tmp_path) -> None:
    speed = measure_sequential(str(tmp_path), 4 << 20, chunk_bytes=1 << 20, read_depths=(2, 4))
    assert speed.read_bytes == speed.write_bytes == 4 << 20
    assert sorted(speed.read_bps_at_depth) == [2, 4] and all(v > 0 for v in speed.read_bps_at_depth.values())
    assert speed.best_read_bytes_per_s >= speed.read_bytes_per_s
    assert os.listdir(tmp_path) == []  # the scratch file is gone
