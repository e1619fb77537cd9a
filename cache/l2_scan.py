"""Rebuild the L2 index at startup from the extent files' headers (no journal to keep in sync).

Why headers and not a journal: an extent file becomes visible only by its final ``rename``,
after its payload and header are written and synced, so the directory listing *is* the
journal; a crash leaves at worst a ``*.tmp`` file, removed here. Reading one header per file
is one small read each (a 1M-token extent's header is about 128 KiB), a few seconds for
thousands of extents; payloads are verified block by block when they are read.

Every rejected file gets one log line saying why. Files of ours that can never be used
(stale format, another model or geometry, corrupt, truncated, orphaned, duplicated) are
deleted so they do not hold disk space outside the bound; files that are not ours (no L2
magic) are left alone.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field

from cache.l2_format import (
    ALIGN,
    EXTENT_SUFFIX,
    ExtentHeader,
    ExtentRejected,
    L2Stamp,
    decode_header,
    header_length,
)
from cache.l2_index import L2Extent, L2Index

log = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"


@dataclass(slots=True)
class ScanReport:
    num_files: int = 0
    rejected: Counter[str] = field(default_factory=Counter)  # reason -> files
    deleted: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if not self.rejected:
            return "none rejected"
        return "rejected " + ", ".join(f"{n} {reason}" for reason, n in sorted(self.rejected.items()))


def read_header(path: str, stamp: L2Stamp, key: bytes = b"") -> tuple[ExtentHeader, int, float]:
    """(header, file size, mtime) of an extent file; raises ExtentRejected or OSError."""
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        raw = os.pread(fd, ALIGN, 0)
        header_len = header_length(raw)
        if header_len > len(raw):
            raw = os.pread(fd, header_len, 0)
        return decode_header(raw, stamp, st.st_size, key), st.st_size, st.st_mtime
    finally:
        os.close(fd)


def extent_from_header(name: str, header: ExtentHeader, last_used_s: float) -> L2Extent:
    return L2Extent(name, header.first_block, header.parent_hash, header.hashes, header.checksums,
                    header.payload_offset, header.file_bytes, last_used_s)


def _delete(directory: str, name: str, report: ScanReport) -> None:
    try:
        os.unlink(os.path.join(directory, name))
        report.deleted.append(name)
    except FileNotFoundError:
        pass


def scan_into(index: L2Index, directory: str, stamp: L2Stamp, key: bytes = b"") -> ScanReport:
    """File every usable extent of ``directory`` into ``index`` (empty), oldest chains first, then
    evict down to the bound; delete what cannot be used. Blocking."""
    report = ScanReport()
    found: list[tuple[L2Extent, float]] = []
    for entry in os.scandir(directory):
        if not entry.is_file(follow_symlinks=False):
            continue
        if entry.name.endswith(TMP_SUFFIX):
            log.info("L2: removing %s, a write that never finished", entry.name)
            _delete(directory, entry.name, report)
            continue
        if not entry.name.endswith(EXTENT_SUFFIX):
            continue
        report.num_files += 1
        try:
            header, _size, mtime = read_header(entry.path, stamp, key)
        except ExtentRejected as exc:
            report.rejected[exc.reason] += 1
            if exc.reason == "not_ours":
                log.warning("L2: ignoring %s (%s); it is not ours, left in place", entry.name, exc)
                continue
            log.warning("L2: rejected %s (%s); deleted", entry.name, exc)
            _delete(directory, entry.name, report)
            continue
        except OSError as exc:
            report.rejected["unreadable"] += 1
            log.warning("L2: cannot read %s (%s); skipped", entry.name, exc)
            continue
        found.append((extent_from_header(entry.name, header, mtime), mtime))
    # Parents before children: by chain position, longer extents first (a duplicate's blocks
    # are then already filed), older first on ties.
    found.sort(key=lambda item: (item[0].first_block, -item[0].num_blocks, item[1]))
    for extent, _ in found:
        if not index.add(extent):
            report.rejected["orphan_or_duplicate"] += 1
            log.warning("L2: %s holds no reachable new block (its parent extent is gone or it "
                        "duplicates others); deleted", extent.name)
            _delete(directory, extent.name, report)
    evicted = index.make_room(0) or []
    for extent in evicted:
        _delete(directory, extent.name, report)
    if evicted:
        log.info("L2: evicted %d extents to fit the bound of %.2f GiB", len(evicted),
                 index.max_bytes / (1 << 30))
    return report
