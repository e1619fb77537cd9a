"""The object format of L3 (a cross-node KV store): one object per chain block.

An object is a fixed header followed by the block's bytes (``bytes_per_block``, the row the
engines' block pools and the L1 host pool hold)::

    magic          8s   b"DIBKVL3\\0"
    version        u32  FORMAT_VERSION
    header_len     u32  HEADER_BYTES
    stamp_digest   u64  xxh3_64 of the stamp's canonical JSON (``L2Stamp.encode``)
    chain_hash     u64  the block's chain hash (its key names it too)
    parent_hash    u64  the chain hash of the block before it (the root hash for block 0)
    payload_len    u64  bytes after the header
    payload_xxh3   u64  xxh3_64 of the payload
    header_xxh3    u64  xxh3_64 of every header byte before it

Its key is ``<namespace>/<stamp digest>/<chain hash>``: a backend of another model, block geometry
or KV layout looks under other keys, and one that finds an object under its own key still checks
every field, so an object that is garbled in the store, truncated, or written by something else
is dropped and never restored. A chain hash fixes the block's position and every token before it
(``cache/hashing.py``), so any node of the same model and geometry may restore it.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import xxhash

from cache.hashing import BlockHash
from cache.l2_format import L2Stamp

if TYPE_CHECKING:
    import numpy as np

MAGIC = b"DIBKVL3\x00"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIIQQQQQ")
HEADER_BYTES = _HEADER.size + 8  # + header_xxh3


def stamp_digest(stamp: L2Stamp) -> int:
    return xxhash.xxh3_64_intdigest(stamp.encode() + b"|l3-format-%d" % FORMAT_VERSION)


def object_key(namespace: str, digest: int, chain_hash: BlockHash) -> str:
    return f"{namespace}/{digest:016x}/{chain_hash:016x}"


def object_bytes(bytes_per_block: int) -> int:
    return HEADER_BYTES + bytes_per_block


def write_header(dst: np.ndarray, digest: int, chain_hash: BlockHash, parent_hash: BlockHash) -> None:
    """Fill ``dst[:HEADER_BYTES]`` for the payload that follows it in ``dst`` (uint8, 1-D)."""
    payload = dst[HEADER_BYTES:]
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, digest, chain_hash, parent_hash,
                        payload.nbytes, xxhash.xxh3_64_intdigest(payload.data))
    view = dst.data.cast("B")
    view[: _HEADER.size] = head
    view[_HEADER.size : HEADER_BYTES] = struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def check_object(obj: np.ndarray, digest: int, chain_hash: BlockHash, parent_hash: BlockHash) -> str | None:
    """None when ``obj`` (uint8, 1-D, header + payload) is this block as we wrote it; else why not."""
    if obj.nbytes < HEADER_BYTES:
        return "truncated"
    raw = bytes(obj[:HEADER_BYTES].data)
    if raw[:8] != MAGIC:
        return "not ours"
    (sum_header,) = struct.unpack_from("<Q", raw, _HEADER.size)
    if xxhash.xxh3_64_intdigest(raw[: _HEADER.size]) != sum_header:
        return "corrupt header"
    _, version, header_len, dig, chain, parent, payload_len, sum_payload = _HEADER.unpack_from(raw)
    if version != FORMAT_VERSION or header_len != HEADER_BYTES:
        return "stale format"
    if dig != digest:
        return "foreign stamp"
    if chain != chain_hash or parent != parent_hash:
        return "another block"
    if payload_len != obj.nbytes - HEADER_BYTES:
        return "wrong size"
    if xxhash.xxh3_64_intdigest(obj[HEADER_BYTES:].data) != sum_payload:
        return "corrupt payload"
    return None
