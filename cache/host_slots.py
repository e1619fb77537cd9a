"""The shared L1 host pool as the backend process sees it: plain bytes, no torch.

The rank processes own the pool (``rank/host_pool.py``: a ``/dev/shm`` file they map and pin) and
move blocks between it and the GPUs. The backend maps the same file ``MAP_SHARED`` so the L2
tier can move slots to and from disk without a trip through a rank: disk -> host here, then
host -> GPU in the rank (``import_blocks``), and the reverse for a spill.
"""

from __future__ import annotations

import numpy as np


class HostSlots:
    """``[num_slots, bytes_per_block]`` uint8; ``run(slot, n)`` is a writable view of ``n``
    consecutive slots (contiguous, because slots are rows of one C-ordered array)."""

    def __init__(self, array: np.ndarray) -> None:
        if array.dtype != np.uint8 or array.ndim != 2 or not array.flags.c_contiguous:
            raise ValueError("host slots must be a C-contiguous 2-D uint8 array")
        self.array = array
        self.num_slots, self.bytes_per_block = array.shape

    @classmethod
    def map_file(cls, path: str, bytes_per_block: int, num_slots: int) -> HostSlots:
        """Map the pool file the ranks created (it must already have the full size)."""
        return cls(np.memmap(path, dtype=np.uint8, mode="r+", shape=(num_slots, bytes_per_block)))

    @classmethod
    def in_memory(cls, bytes_per_block: int, num_slots: int) -> HostSlots:
        """Private memory (tests and benches without rank processes)."""
        return cls(np.zeros((num_slots, bytes_per_block), dtype=np.uint8))

    def check_row_bytes(self, stamp_bytes_per_block: int) -> None:
        """A tier below L1 stores blocks of its stamp's size: refuse slots of another size."""
        if self.bytes_per_block != stamp_bytes_per_block:
            raise ValueError(f"host slots hold {self.bytes_per_block} bytes per block, "
                             f"the stamp says {stamp_bytes_per_block}")

    def run(self, slot: int, count: int) -> np.ndarray:
        if count < 1 or slot < 0 or slot + count > self.num_slots:
            raise ValueError(f"host slots [{slot}, {slot + count}) outside 0..{self.num_slots}")
        return self.array[slot : slot + count].reshape(-1)
