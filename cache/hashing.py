"""Chain hashes of full KV blocks: the names the L0 and L1 indexes file blocks under.

Block ``i`` of a token sequence is named by ``h_i = xxh3_64(tokens[i*bs:(i+1)*bs] as int32 bytes,
seed=h_{i-1})`` with ``h_{-1} = root_hash(block_size, salt)``. Seeding XXH3 with the parent hash
puts the parent into the hash state without building a ``parent || tokens`` buffer per block, so
the name of a block depends on every token before it: two prompts share ``h_i`` exactly when they
share their first ``(i+1) * block_size`` tokens (up to a 64-bit collision, ~2^-64 per pair).

Only full blocks are named; the tokens after the last full block are never cached.
Speed: one XXH3 call per block over a memoryview of the prompt (no per-token Python, no copies);
about 2 ms for a 1M-token prompt at 128 tokens per block on one core (``python -m bench.cache_bench``).
"""

from __future__ import annotations

from collections.abc import Container, Sequence

import numpy as np
import xxhash

# A NewType (rank/ids.py, with BlockId and HostSlot): block hashes, block ids and host slots are
# all ints; mixing them up is the classic bug in a cache index, and a type checker catches it.
from rank.ids import BlockHash

__all__ = ["BlockHash", "as_token_array", "chain_hashes", "filed_prefix_length", "root_hash"]

_ROOT_TAG = b"deepinfer-backend/kv-block-chain/v1"


def root_hash(block_size: int, salt: bytes = b"") -> BlockHash:
    """The parent hash of block 0. It covers ``block_size`` and a salt (model, KV format), so
    chains computed under different layouts can never name the same block."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return BlockHash(xxhash.xxh3_64_intdigest(_ROOT_TAG + block_size.to_bytes(4, "little") + salt))


def as_token_array(token_ids: np.ndarray | Sequence[int]) -> np.ndarray:
    """Token ids as a contiguous 1-D int32 array (a view when they already are one)."""
    arr = np.ascontiguousarray(token_ids, dtype=np.int32)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    return arr


def filed_prefix_length(hashes: Sequence[BlockHash], filed: Container[BlockHash]) -> int:
    """How many leading blocks of a chain are in ``filed``, by binary search. Valid for indexes
    that keep chains prefix-closed (a block is filed only after its parent), as every tier does."""
    lo, hi = 0, len(hashes)  # invariant: hashes[:lo] filed, hashes[hi:] not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if hashes[mid - 1] in filed:
            lo = mid
        else:
            hi = mid - 1
    return lo


def common_prefix(a: Sequence[BlockHash], b: Sequence[BlockHash]) -> int:
    """Length of the longest common prefix of two chains. Chain hashes name a block *and* its
    whole prefix, so equal hashes at index i mean equal prefixes up to i: a binary search."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def chain_hashes(
    token_ids: np.ndarray | Sequence[int],
    block_size: int,
    parent: BlockHash,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hashes of full blocks ``start_block ..`` of ``token_ids``.

    ``parent`` is the hash of block ``start_block - 1`` (or the root hash when ``start_block`` is
    0), which lets a caller extend a chain it already has without rehashing its prefix.
    """
    tokens = as_token_array(token_ids)
    num_full_blocks = len(tokens) // block_size
    if start_block < 0 or start_block > num_full_blocks:
        raise ValueError(f"start_block {start_block} outside 0..{num_full_blocks}")
    data = tokens.data.cast("B")
    step_bytes = block_size * 4
    digest = xxhash.xxh3_64_intdigest
    out: list[BlockHash] = []
    append = out.append
    h = int(parent)
    for offset in range(start_block * step_bytes, num_full_blocks * step_bytes, step_bytes):
        h = digest(data[offset : offset + step_bytes], h)
        append(h)  # type: ignore[arg-type]  # BlockHash is an int at run time
    return out


class ChainHasher:
    """Hashes token sequences for one block size and salt (the backend has one per model).

    ``caller_salt`` (optional, per request): a second salt mixed into the root, so chains of
    different callers never name the same block, as vLLM's ``cache_salt`` does
    (https://docs.vllm.ai/en/latest/design/prefix_caching/). Only block 0's parent changes;
    the tiers never recompute a block's hash from its parent, so salted chains need nothing else."""

    __slots__ = ("block_size", "root", "_salt")

    def __init__(self, block_size: int, salt: bytes = b"") -> None:
        self.block_size = block_size
        self._salt = salt
        self.root = root_hash(block_size, salt)

    def root_for(self, caller_salt: bytes) -> BlockHash:
        if not caller_salt:
            return self.root
        return root_hash(self.block_size, self._salt + b"\x00caller\x00" + caller_salt)

    def hashes(self, token_ids: np.ndarray | Sequence[int], caller_salt: bytes = b"") -> list[BlockHash]:
        return chain_hashes(token_ids, self.block_size, self.root_for(caller_salt))

    def extend(
        self, prefix_hashes: Sequence[BlockHash], token_ids: np.ndarray | Sequence[int],
        caller_salt: bytes = b"",
    ) -> list[BlockHash]:
        """Hashes of all full blocks of ``token_ids``, reusing ``prefix_hashes`` (the hashes of
        its leading blocks, computed earlier over the same tokens) instead of rehashing them."""
        tokens = as_token_array(token_ids)
        num_known = min(len(prefix_hashes), len(tokens) // self.block_size)
        parent = prefix_hashes[num_known - 1] if num_known else self.root_for(caller_salt)
        return list(prefix_hashes[:num_known]) + chain_hashes(
            tokens, self.block_size, parent, start_block=num_known
        )
