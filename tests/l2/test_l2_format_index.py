"""L2 extent headers (stamp, checksums, rejections) and the L2 index (prefix closure, bound)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from cache.l2_format import ALIGN, ExtentHeader, ExtentRejected, decode_header
from cache.l2_index import L2Extent, L2Index
from tests.l2.l2_helpers import HASHER, STAMP, chain


def header(first: int = 0, n: int = 3) -> ExtentHeader:
    hashes = chain(first + n)
    parent = hashes[first - 1] if first else HASHER.root
    return ExtentHeader(STAMP, first, parent, hashes[first:], [7 * i + 1 for i in range(n)])


def test_header_round_trip_and_padding() -> None:
    h = header(2, 5)
    raw = h.encode()
    assert len(raw) == h.payload_offset and h.payload_offset % ALIGN == 0 and h.file_bytes % ALIGN == 0
    assert decode_header(raw, STAMP, h.file_bytes) == h


def test_a_header_rewritten_without_the_key_is_rejected() -> None:
    """Someone who can write l2_dir but not read the key cannot file KV under other hashes."""
    key = b"k" * 32
    h = header(0, 4)
    assert decode_header(h.encode(key), STAMP, h.file_bytes, key) == h
    forged = h._replace(hashes=chain(9)[5:])  # the same bytes claimed for another prompt's blocks
    for raw in (forged.encode(), forged.encode(b"another key")):
        with pytest.raises(ExtentRejected) as err:
            decode_header(raw, STAMP, forged.file_bytes, key)
        assert err.value.reason == "corrupt"


@pytest.mark.parametrize("change", [
    {"model": "reference:other-model"},
    {"block_size": 8},
    {"bytes_per_block": STAMP.bytes_per_block * 2},
    {"kv_layout": "test:bf16:2x4x8"},
])
def test_foreign_stamp_is_rejected(change: dict) -> None:
    other = dataclasses.replace(STAMP, **change)
    h = header()._replace(stamp=other)
    with pytest.raises(ExtentRejected) as info:
        decode_header(h.encode(), STAMP, 1 << 30)
    assert info.value.reason == "foreign"


def test_corrupt_truncated_stale_and_not_ours_headers_are_rejected() -> None:
    h = header()
    raw = bytearray(h.encode())
    raw[60] ^= 0xFF  # inside the stamp / hashes: the header checksum catches it
    with pytest.raises(ExtentRejected, match="corrupt"):
        decode_header(bytes(raw), STAMP, h.file_bytes)
    with pytest.raises(ExtentRejected, match="truncated"):
        decode_header(h.encode(), STAMP, h.file_bytes - 1)
    stale = bytearray(h.encode())
    stale[8] = 99  # format version
    with pytest.raises(ExtentRejected, match="stale"):
        decode_header(bytes(stale), STAMP, h.file_bytes)
    with pytest.raises(ExtentRejected, match="not_ours"):
        decode_header(b"PK\x03\x04" + bytes(100), STAMP, 1 << 20)


# ------------------------------------------------------------------------------------------- index

def extent(name: str, hashes: list, first: int, n: int, used: float = 0.0, size: int = 100) -> L2Extent:
    parent = hashes[first - 1] if first else HASHER.root
    return L2Extent(name, first, parent, hashes[first : first + n], [0] * n, ALIGN, size, used)


def test_index_files_suffix_extents_and_shares_prefixes() -> None:
    idx = L2Index(10_000)
    a = chain(10)
    b = HASHER.hashes(list(range(24)) + list(range(900, 924)))  # a's first 6 blocks, then its own
    assert b[:6] == a[:6] and b[6] != a[6]
    assert idx.add(extent("a0", a, 0, 4)) and idx.add(extent("a1", a, 4, 6))
    assert idx.match(a) == 10 and idx.match(b) == 6
    assert idx.add(extent("b1", b, 6, len(b) - 6))
    assert idx.match(b) == len(b)
    runs = idx.runs(b, 2, len(b) - 2)
    got = [(r.extent.name, r.index, r.count) for r in runs]
    assert got == [("a0", 2, 2), ("a1", 0, 2), ("b1", 0, len(b) - 6)]
    assert not idx.add(extent("dup", a, 0, 10))  # adds nothing new
    assert not idx.add(extent("orphan", chain(9, base=5), 5, 4))  # its block 4 is not on disk
    idx.check()


def test_index_remove_cascades_to_dependent_extents() -> None:
    idx = L2Index(10_000)
    a = chain(10)
    idx.add(extent("a0", a, 0, 4))
    idx.add(extent("a1", a, 4, 3))
    idx.add(extent("a2", a, 7, 3))
    removed = idx.remove(idx.extents["a1"])
    assert sorted(e.name for e in removed) == ["a1", "a2"]
    assert idx.match(a) == 4 and idx.used_bytes == 100
    idx.check()


def test_index_make_room_evicts_lru_but_never_kept_extents() -> None:
    idx = L2Index(300)
    for i, used in enumerate([5.0, 1.0, 3.0]):
        idx.add(extent(f"e{i}", chain(2, base=1000 * i), 0, 2, used=used))
    keep = [idx.extents["e1"]]
    victims = idx.make_room(150, keep=keep)
    assert victims is not None and [e.name for e in victims] == ["e2", "e0"]  # oldest not kept first
    assert idx.used_bytes + idx.reserved_bytes == 250 <= idx.max_bytes
    assert idx.make_room(100, keep=keep) is None  # 100 kept + 150 reserved + 100 > 300: nothing changes
    assert idx.used_bytes == 100 and "e1" in idx.extents
    idx.release(150)
    assert idx.make_room(301) is None
    idx.check()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 12), st.integers(0, 2)), min_size=1, max_size=40))
def test_index_stays_prefix_closed_and_bounded(ops: list[tuple[int, int, int]]) -> None:
    """Random saves (of 4 chain families, any length, as suffix extents) and evictions."""
    idx = L2Index(2_000)
    families = [chain(16, base=10_000 * f) for f in range(4)]
    for step, (fam, n, op) in enumerate(ops):
        hashes = families[fam][:n]
        if op == 2 and idx.extents:
            idx.remove(min(idx.extents.values(), key=lambda e: e.name))
        else:
            k = idx.match(hashes)
            if k < n:
                keep = idx.path(hashes, k)
                size = 50 * (n - k)
                if idx.make_room(size, keep) is not None:
                    idx.release(size)
                    idx.add(extent(f"x{step:03d}", hashes, k, n - k, used=float(step), size=size))
        idx.check()
        assert idx.used_bytes <= idx.max_bytes
        for f in families:  # match agrees with a linear scan (prefix closure)
            m = idx.match(f)
            assert all(h in idx._where for h in f[:m]) and (m == len(f) or f[m] not in idx._where)


def test_the_disk_store_implements_the_tier_seam() -> None:
    import inspect

    from cache.kv_tier import KVTier
    from cache.l2_store import L2Store

    for name in ("match", "save", "load"):
        assert inspect.signature(getattr(L2Store, name)).parameters.keys() == \
            inspect.signature(getattr(KVTier, name)).parameters.keys()
