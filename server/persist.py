"""Protocol state on disk under ``l2_dir``: the output ledger and the tokenizer's piece cache.

``SegmentLog`` implements ``protocol.persist.KeyedLog`` as a bounded sequence of append-only
segment files (``seg-00000001.log`` ...). A segment starts with a header (magic, stamp); then
records ``key_len u32, value_len u32, key, value, tag``, where ``tag`` is the first 16 bytes of
HMAC-SHA256 under the backend's state key (``state_key``) over the header and the record's
lengths, key and value. A record whose tag does not hold is never replayed: someone who can
write ``l2_dir`` but not read the key cannot forge or edit a record (a ledger entry that would
reach a prompt), nor move one between logs of another stamp. New records go
to the newest segment; past ``segment_bytes`` a new one starts, and past ``max_bytes`` in all
the oldest segment is deleted. ``refresh`` re-puts a key whose latest record sits in the older
half of the segments, so what is in use survives while what is not ages out (LRU-like, with
each live record rewritten at most once per half a log).

A process killed mid-record leaves a torn tail: replay stops at the first record whose length
or checksum does not hold and the segment is cut there. A segment with another stamp (another
tokenizer or model) or no magic makes the whole log start empty (its files are deleted): the
ids it holds would be wrong. A record that fails its tag cuts the segment there, as a torn one
does (a changed key, see ``state_key``, so empties the logs). Write errors (disk full, directory
gone) are logged at most once a minute and cost persistence only; the next write tries a fresh
segment.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import struct
import threading
import time
from collections.abc import Callable, Iterator

from protocol.ledger import OutputLedger
from protocol.tokenize import PromptTokenizer

log = logging.getLogger(__name__)

MAGIC = b"DIBLOG2\x00"
_REC = struct.Struct("<II")
_TAG_BYTES = 16
STATE_KEY_ENV = "DIB_STATE_KEY"  # 64 hex digits: the state key, instead of <l2_dir>/state.key
_SEG_RE = re.compile(r"^seg-(\d{8})\.log$")
MAX_RECORD_BYTES = 1 << 30


class SegmentLog:
    """See the module docstring. Thread-safe (one lock around file writes)."""

    def __init__(self, directory: str, max_bytes: int, stamp: str, *, key: bytes,
                 segment_bytes: int | None = None) -> None:
        """``key``: the records' HMAC key (``state_key``, or a key derived from it)."""
        self.directory = directory
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes or max(1 << 20, max_bytes // 8)
        self._header = MAGIC + struct.pack("<I", len(stamp.encode())) + stamp.encode()
        self._mac = hmac.new(key, self._header, hashlib.sha256)  # copied per record
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
        body = _REC.pack(len(key), len(value)) + key + value
        record = body + self._tag(body)
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

    def _tag(self, body: bytes | memoryview) -> bytes:
        mac = self._mac.copy()
        mac.update(body)
        return mac.digest()[:_TAG_BYTES]

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
            end = pos + _REC.size + klen + vlen + _TAG_BYTES
            if end > len(data):
                break
            if not hmac.compare_digest(self._tag(memoryview(data)[pos : end - _TAG_BYTES]),
                                       data[end - _TAG_BYTES : end]):
                break
            body = data[pos + _REC.size : end - _TAG_BYTES]
            yield body[:klen], body[klen:]
            pos = end
        if pos < len(data):
            log.warning("persisted log %s: segment %d has a torn, corrupt or unauthenticated record at byte "
                        "%d; cut there", self.directory, seg, pos)
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


def state_key(l2_dir: str) -> bytes:
    """The backend's key for state on disk (32 bytes): from ``DIB_STATE_KEY`` (64 hex digits)
    when set, else ``<l2_dir>/state.key`` (mode 0600, made on first start). Every file under
    ``l2_dir`` that can reach a prompt or the KV cache is authenticated with a key derived from
    it (``derived_key``). A new key (rotation, a lost file) makes every such file unreadable:
    the backend starts with empty state. Whoever can read it can forge state (docs/reliability.md)."""
    env = os.environ.get(STATE_KEY_ENV)
    if env:
        try:
            key = bytes.fromhex(env.strip())
        except ValueError:
            key = b""
        if len(key) != 32:
            raise ValueError(f"{STATE_KEY_ENV} must be 64 hex digits (32 bytes)")
        return key
    return load_or_create_key(os.path.join(l2_dir, "state.key"))


def derived_key(key: bytes, purpose: str) -> bytes:
    """An independent key for one use of the state key (HMAC-SHA256 of the purpose)."""
    return hmac.new(key, b"deepinfer-backend " + purpose.encode(), hashlib.sha256).digest()


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
        key = state_key(l2_dir)
        logs.append(SegmentLog(os.path.join(base, "pieces"), PIECES_LOG_BYTES, stamp,
                               key=derived_key(key, "pieces log")))
        num_pieces = tokenizer.cache.attach(logs[0])
        logs.append(SegmentLog(os.path.join(base, "ledger"), LEDGER_LOG_BYTES, stamp,
                               key=derived_key(key, "ledger log")))
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
