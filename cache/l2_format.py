"""The on-disk format of an L2 extent file: a header that names its blocks, then their bytes.

One file holds blocks ``first_block .. first_block+n-1`` of one chain (a session's KV), in
order, as the rows the engines' block pools and the L1 host pool hold (``bytes_per_block``
each)::

    offset 0          header (below), zero-padded to ALIGN
    payload_offset    n x bytes_per_block payload bytes, zero-padded to ALIGN

Header, little endian::

    magic         8s   b"DIBKVL2\\0"
    version       u32  FORMAT_VERSION
    header_len    u32  bytes of the header up to and including its checksum
    first_block   u32  chain position of the first block
    num_blocks    u32
    bytes_per_block u64
    parent_hash   u64  chain hash of block first_block-1 (the root hash for block 0)
    stamp_len     u32, stamp  canonical JSON of ``L2Stamp``
    hashes        num_blocks x u64   chain hashes of the blocks
    checksums     num_blocks x u64   xxh3_64 of each block's payload bytes
    header_tag    16 bytes  HMAC-SHA256 of every header byte before it, truncated

Why a stamp: a file written by another model, block geometry, KV layout or format version holds
bytes that would decode as garbage KV; the stamp must equal the running backend's exactly or the
file is rejected before a byte of its payload is used. Why per-block checksums: a restore often
reads a prefix of an extent (a session that diverged inside it), and a corrupt block must cut the
restore there, not poison it.

Why a keyed tag: the header names which chain hashes (which prompts) a file's KV stands for. The
tag is keyed with the backend's state key (``server/persist.state_key``; the store gets a key
derived from it), so a header written or edited by anyone without the key is rejected
(``corrupt``): KV cannot be filed under another prompt's hashes. The per-block checksums are
inside the tagged header, so a payload edit must keep each block's xxh3_64; that is integrity
against accidents, not a MAC (xxh3 is not a cryptographic hash; a full MAC over every restored
byte was not chosen, see docs/reliability.md).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import dataclass
from typing import NamedTuple

import xxhash

from cache.hashing import BlockHash

MAGIC = b"DIBKVL2\x00"
FORMAT_VERSION = 2  # 2: the header's keyed tag (1 had an unkeyed xxh3_64)
ALIGN = 4096  # header and payload sizes are padded to this (direct I/O alignment)
EXTENT_SUFFIX = ".kv"

_PREFIX = struct.Struct("<8sII")  # magic, version, header_len
_FIXED = struct.Struct("<IIQQI")  # first_block, num_blocks, bytes_per_block, parent_hash, stamp_len
_TAG_BYTES = 16
MAX_HEADER_BYTES = 64 << 20  # a sanity bound when reading a header_len from a file


class ExtentRejected(ValueError):
    """A file that must not be loaded. ``reason``: ``not_ours`` (no L2 magic), ``stale`` (another
    format version), ``foreign`` (another model, block geometry or KV layout), ``corrupt``
    (checksum or fields), ``truncated`` (shorter than its header says)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class L2Stamp:
    """What KV bytes mean: equal stamps <=> interchangeable bytes.

    ``model``: the hash salt the chain hashes were made with (engine and model name);
    ``kv_layout``: the engine's description of a block row (dtype, layers, heads, order)."""

    model: str
    block_size: int
    bytes_per_block: int
    kv_layout: str

    def encode(self) -> bytes:
        fields = {"model": self.model, "block_size": self.block_size, "bytes_per_block": self.bytes_per_block,
                  "kv_layout": self.kv_layout}
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> L2Stamp:
        fields = json.loads(raw)
        return cls(str(fields["model"]), int(fields["block_size"]), int(fields["bytes_per_block"]),
                   str(fields["kv_layout"]))


def align_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def block_checksum(data: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


class ExtentHeader(NamedTuple):
    stamp: L2Stamp
    first_block: int
    parent_hash: BlockHash
    hashes: list[BlockHash]
    checksums: list[int]

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    @property
    def payload_offset(self) -> int:
        return align_up(_PREFIX.size + _FIXED.size + len(self.stamp.encode()) + 16 * self.num_blocks
                        + _TAG_BYTES)

    @property
    def payload_bytes(self) -> int:
        return self.num_blocks * self.stamp.bytes_per_block

    @property
    def file_bytes(self) -> int:
        return self.payload_offset + align_up(self.payload_bytes)

    def encode(self, key: bytes = b"") -> bytes:
        """The header padded to ``payload_offset`` bytes; ``key``: the tag's (the store's)."""
        if len(self.checksums) != len(self.hashes) or not self.hashes:
            raise ValueError("an extent needs one checksum per block and at least one block")
        stamp = self.stamp.encode()
        n = self.num_blocks
        body = b"".join((
            _FIXED.pack(self.first_block, n, self.stamp.bytes_per_block, self.parent_hash, len(stamp)),
            stamp,
            struct.pack(f"<{n}Q", *self.hashes),
            struct.pack(f"<{n}Q", *self.checksums),
        ))
        header_len = _PREFIX.size + len(body) + _TAG_BYTES
        head = _PREFIX.pack(MAGIC, FORMAT_VERSION, header_len) + body
        raw = head + header_tag(key, head)
        return raw + bytes(self.payload_offset - len(raw))


def header_tag(key: bytes, head: bytes) -> bytes:
    return hmac.digest(key, head, hashlib.sha256)[:_TAG_BYTES]


def header_length(prefix: bytes) -> int:
    """``header_len`` from a file's first bytes; raises ExtentRejected for files not ours."""
    if len(prefix) < _PREFIX.size:
        raise ExtentRejected("truncated", f"{len(prefix)} bytes, shorter than a header")
    magic, version, header_len = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise ExtentRejected("not_ours", "not an L2 extent file (bad magic)")
    if version != FORMAT_VERSION:
        raise ExtentRejected("stale", f"format version {version}, this backend writes {FORMAT_VERSION}")
    if not _PREFIX.size + _FIXED.size + _TAG_BYTES <= header_len <= MAX_HEADER_BYTES:
        raise ExtentRejected("corrupt", f"header length {header_len} out of range")
    return int(header_len)


def decode_header(raw: bytes, expected: L2Stamp, file_size: int, key: bytes = b"") -> ExtentHeader:
    """Parse and validate a header (``raw`` holds at least ``header_length`` bytes) whose tag
    was made with ``key``.

    Raises ExtentRejected (see its reasons)."""
    header_len = header_length(raw)
    if len(raw) < header_len:
        raise ExtentRejected("truncated", f"header is {header_len} bytes, file has {len(raw)}")
    head, tag = raw[: header_len - _TAG_BYTES], raw[header_len - _TAG_BYTES : header_len]
    if not hmac.compare_digest(header_tag(key, head), tag):
        raise ExtentRejected("corrupt", "header tag mismatch (damaged, or not written with this key)")
    first_block, n, bytes_per_block, parent_hash, stamp_len = _FIXED.unpack_from(head, _PREFIX.size)
    pos = _PREFIX.size + _FIXED.size
    if n == 0 or pos + stamp_len + 16 * n != len(head):
        raise ExtentRejected("corrupt", "header fields disagree with its length")
    try:
        stamp = L2Stamp.decode(head[pos : pos + stamp_len])
    except (ValueError, KeyError, TypeError) as exc:
        raise ExtentRejected("corrupt", f"unreadable stamp ({exc})") from None
    if stamp != expected or bytes_per_block != expected.bytes_per_block:
        raise ExtentRejected("foreign", f"written for {stamp}, this backend runs {expected}")
    pos += stamp_len
    hashes = [BlockHash(h) for h in struct.unpack_from(f"<{n}Q", head, pos)]
    checksums = list(struct.unpack_from(f"<{n}Q", head, pos + 8 * n))
    header = ExtentHeader(stamp, first_block, BlockHash(parent_hash), hashes, checksums)
    if file_size < header.file_bytes:
        raise ExtentRejected("truncated", f"{file_size} bytes, the header promises {header.file_bytes}")
    return header
