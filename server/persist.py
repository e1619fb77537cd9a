"""Protocol state on disk under ``l2_dir``: the output ledger and the tokenizer's piece cache.

``SegmentLog`` implements ``protocol.persist.KeyedLog`` as a bounded sequence of append-only
segment files (``seg-00000001.log`` ...). A segment starts with a header (magic, stamp); then
records ``key_len u32, value_len u32, key, value, xxh3_64(key || value) u64``. New records go
to the newest segment; past ``segment_bytes`` a new one starts, and past ``max_bytes`` in all
the oldest segment is deleted. ``refresh`` re-puts a key whose latest record sits in the older
half of the segments, so what is in use survives while what is not ages out (LRU-like, with
each live record rewritten at most once per half a log).

A process killed mid-record leaves a torn tail: replay stops at the first record whose length
or checksum does not hold and the segment is cut there. A segment with another stamp (another
tokenizer or model) or no magic makes the whole log start empty (its files are deleted): the
ids it holds would be wrong. Write errors (disk full, directory gone) are logged at most once a
minute and cost persistence only; the next write tries a fresh segment.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import struct
import threading
import time
from collections.abc import Callable, Iterator

import xxhash

from protocol.ledger import OutputLedger
from protocol.tokenize import PromptTokenizer

log = logging.getLogger(__name__)

MAGIC = b"DIBLOG1\x00"
_REC = struct.Struct("<II")
_SUM = struct.Struct("<Q")
_SEG_RE = re.compile(r"^seg-(\d{8})\.log$")
MAX_RECORD_BYTES = 1 << 30


class SegmentLog:
    """See the module docstring. Thread-safe (one lock around file writes)."""

    def __init__(self, directory: str, max_bytes: int, stamp: str, *,
                 segment_bytes: int | None = None) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes or max(1 << 20, max_bytes // 8)
        self._header = MAGIC + struct.pack("<I", len(stamp.encode())) + stamp.encode()
        self._lock = threading.Lock()
        self._sizes: dict[int, int] = {}  # segment number -> bytes, oldest first
        self._where: dict[bytes, int] = {}  # key -> segment of its latest record
        self._fd: int | None = None
        self._last_warning = -1e9
        os.makedirs(directory, exist_ok=True)
        self._open_existing()

    # ----------------------------------------------------------------- KeyedLog

    def replay(self) -> Iterator[tuple[bytes, bytes]]:
        for seg in list(self._sizes):
            for key, value in self._records(seg):
                self._where[key] = seg
                yield key, value

    def put(self, key: bytes, value: bytes) -> None:
        check = _SUM.pack(xxhash.xxh3_64_intdigest(key + value))
        record = _REC.pack(len(key), len(value)) + key + value + check
        if len(record) > min(self.segment_bytes, MAX_RECORD_BYTES):
            return
        with self._lock:
            try:
                seg = self._writable_segment(len(record))
                os.write(self._fd, record)  # type: ignore[arg-type]
                self._sizes[seg] += len(record)
                self._where[key] = seg
            except OSError as exc:
                self._close_fd()
                now = time.monotonic()
                if now - self._last_warning >= 60.0:
                    self._last_warning = now
                    log.warning("persisted log %s: write failed (%s); state is kept in memory only until "
                                "writes succeed again", self.directory, exc)

    def refresh(self, key: bytes, value: Callable[[], bytes]) -> None:
        with self._lock:
            seg = self._where.get(key)
            if seg is None:
                return  # never put here (too large, or put by nobody)
            segments = list(self._sizes)
            recent = seg in self._sizes and segments.index(seg) >= len(segments) // 2
        if not recent:
            try:
                self.put(key, value())
            except (TypeError, ValueError) as exc:  # the caller could not encode it: keep the old record
                log.debug("persisted log %s: refresh skipped (%s)", self.directory, exc)

    def close(self) -> None:
        with self._lock:
            self._close_fd()

    @property
    def num_bytes(self) -> int:
        return sum(self._sizes.values())

    # ----------------------------------------------------------------- files

    def _path(self, seg: int) -> str:
        return os.path.join(self.directory, f"seg-{seg:08d}.log")

    def _open_existing(self) -> None:
        found = sorted(int(m.group(1)) for m in map(_SEG_RE.match, os.listdir(self.directory)) if m)
        for seg in found:
            with open(self._path(seg), "rb") as f:
                head = f.read(len(self._header))
            if head != self._header:
                log.warning("persisted log %s: segment %d is from another tokenizer/model or not ours; "
                            "starting empty", self.directory, seg)
                for s in found:
                    os.unlink(self._path(s))
                self._sizes.clear()
                return
            self._sizes[seg] = os.path.getsize(self._path(seg))

    def _records(self, seg: int) -> Iterator[tuple[bytes, bytes]]:
        path = self._path(seg)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            log.warning("persisted log %s: cannot read segment %d (%s)", self.directory, seg, exc)
            return
        pos = len(self._header)
        while pos + _REC.size <= len(data):
            klen, vlen = _REC.unpack_from(data, pos)
            end = pos + _REC.size + klen + vlen + _SUM.size
            if end > len(data):
                break
            body = data[pos + _REC.size : end - _SUM.size]
            if xxhash.xxh3_64_intdigest(body) != _SUM.unpack_from(data, end - _SUM.size)[0]:
                break
            yield body[:klen], body[klen:]
            pos = end
        if pos < len(data):
            log.warning("persisted log %s: segment %d has a torn or corrupt record at byte %d; cut there",
                        self.directory, seg, pos)
            with open(path, "r+b") as f:
                f.truncate(pos)
            self._sizes[seg] = pos

    def _writable_segment(self, nbytes: int) -> int:
        """The segment to append to (starting a new one when full); drops old ones past the bound."""
        newest = next(reversed(self._sizes), 0)
        if self._fd is None or self._sizes[newest] + nbytes > self.segment_bytes:
            self._close_fd()
            newest += 1
            os.makedirs(self.directory, exist_ok=True)
            fd = os.open(self._path(newest), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
            os.write(fd, self._header)
            self._fd = fd
            self._sizes[newest] = len(self._header)
        while len(self._sizes) > 1 and sum(self._sizes.values()) + nbytes > self.max_bytes:
            oldest = next(iter(self._sizes))
            del self._sizes[oldest]
            try:
                os.unlink(self._path(oldest))
            except FileNotFoundError:
                pass
        return newest

    def _close_fd(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


def load_or_create_key(path: str) -> bytes:
    """The ledger's HMAC key (32 bytes, file mode 0600), created on first use, so signatures
    handed to clients stay valid across restarts."""
    try:
        with open(path, "rb") as f:
            key = f.read()
        if len(key) == 32:
            return key
        log.warning("ledger key %s has %d bytes, not 32; making a new one (old signatures stop matching)",
                    path, len(key))
    except FileNotFoundError:
        pass
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    key = secrets.token_bytes(32)
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, key)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return key


LEDGER_LOG_BYTES = 512 << 20
PIECES_LOG_BYTES = 256 << 20


def open_protocol_state(l2_dir: str, model_name: str, tokenizer: PromptTokenizer,
                        ) -> tuple[OutputLedger, list[SegmentLog]]:
    """The output ledger and the tokenizer's piece cache, persisted under ``<l2_dir>/protocol``
    (both stamped with the model name and the tokenizer's fingerprint). Returns the ledger and
    the logs to close at shutdown; a directory that cannot be used gives an in-memory ledger."""
    base = os.path.join(l2_dir, "protocol")
    stamp = f"{model_name}:{tokenizer.fingerprint}"
    logs: list[SegmentLog] = []
    try:
        logs.append(SegmentLog(os.path.join(base, "pieces"), PIECES_LOG_BYTES, stamp))
        num_pieces = tokenizer.cache.attach(logs[0])
        logs.append(SegmentLog(os.path.join(base, "ledger"), LEDGER_LOG_BYTES, stamp))
        ledger = OutputLedger(key=load_or_create_key(os.path.join(base, "ledger.key")), log=logs[1])
    except OSError as exc:
        for opened in logs:
            opened.close()
        log.warning("cannot persist protocol state under %s (%s); the ledger and tokenization cache "
                    "are in memory only", base, exc)
        return OutputLedger(), []
    log.info("protocol state persisted under %s: %d tokenized pieces and %d ledger entries restored",
             base, num_pieces, ledger.stats.num_restored)
    return ledger, logs
