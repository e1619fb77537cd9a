"""Output ledger: the exact token ids each turn generated, so history re-renders byte-exact.

Why: with tools on, V4.1 keeps reasoning in history, so the next prompt's prefix matches the
KV cache only if the assistant turn re-renders to exactly the ids the model produced
(reference section 2). Re-encoding the parsed view loses that (whitespace, JSON formatting,
parameter order, non-canonical token splits). The ledger keeps the ids and hands them back.

Scope: an entry belongs to the conversation that produced it. It records a *binding*: a
128-bit hash (xxh3-128 under a secret seed) of the caller's scope and the exact prompt ids the
turn was generated from. A later request can use the entry for an assistant turn only when the
prompt ids in front of that turn, under the same scope, hash to the same binding
(``Protocol.encode_prompt`` computes it while it tokenizes, one pass over the ids). Two
conversations that share a visible turn but not the history before it never share its hidden
part (reasoning, exact ids); nor do two callers the server tells apart (API key), even with the
same history.

Handles: an Anthropic thinking block's ``signature`` is ``base64url(entry_id[16] ||
HMAC-SHA256(key, entry_id)[:16])``; a forged or foreign signature fails the MAC and is ignored
(the turn falls back to rendering). Turns without a signature (OpenAI, chat mode) are found by
their binding and a hash of their content view. Either way the binding must hold and the
client's view must equal the recorded view, or the turn is rendered from the client's view.

Invariant: an entry is used only when its binding equals the binding of the prefix in front of
the turn and the client-visible view it recorded equals the client's view of that turn; memory
is bounded by ``max_bytes`` (LRU).

Persistence (``log``, a ``protocol.persist.KeyedLog``): every recorded entry is also put to the
log and every hit refreshes it there, and a new ledger replays the log, so after a backend
restart history still re-renders to the generated ids. Signatures stay valid across the restart
only with the same ``key`` (the server keeps it in a file next to the log).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import xxhash

from protocol.persist import KeyedLog

logger = logging.getLogger(__name__)

_ID_BYTES = 16
_MAC_BYTES = 16
_ENTRY_OVERHEAD_BYTES = 512
_META_LEN = 4  # bytes of the encoded entry's metadata length prefix
_SIGNATURE_CHARS = 4 * ((_ID_BYTES + _MAC_BYTES + 2) // 3)  # base64 of entry id + MAC


@dataclass(slots=True)
class LedgerEntry:
    """One generated turn. ``think_end`` is the index of the first ``</think>`` id in
    ``output_ids`` (-1 if none); ``thinking`` says the prompt ended with ``<think>``."""

    entry_id: bytes
    output_ids: np.ndarray
    thinking: bool
    think_end: int
    reasoning: str
    text_parts: tuple[str, ...]
    calls: tuple[tuple[str, Any], ...]  # (name, parsed arguments)
    binding: bytes = b""  # the prefix it was generated from (module docstring); b"": matches nothing
    persist: bool = True  # False: kept in memory only (a Responses reply with ``store: false``)

    def render_ids(self, with_reasoning: bool, end_think_id: int, eos_id: int) -> np.ndarray | None:
        """Ids standing in for the assistant message's rendering, or None if they cannot."""
        ids = self.output_ids
        if self.thinking:
            if self.think_end < 0:
                return None  # reasoning never closed: the template cannot hold it
            part = ids if with_reasoning else ids[self.think_end + 1 :]
        else:
            if with_reasoning:
                part = np.concatenate([np.asarray([end_think_id], dtype=np.int32), ids])
            else:
                part = ids
        if len(part) == 0 or int(part[-1]) != eos_id:
            part = np.concatenate([part, np.asarray([eos_id], dtype=np.int32)])
        return part

    @property
    def nbytes(self) -> int:
        text_bytes = sum(len(t) for t in self.text_parts) + len(self.reasoning)
        return int(self.output_ids.nbytes) + text_bytes + _ENTRY_OVERHEAD_BYTES


def encode_entry(entry: LedgerEntry) -> bytes:
    """The entry as bytes for the log: metadata length (u32), metadata JSON, then int32 ids."""
    meta = orjson.dumps({
        "thinking": entry.thinking, "think_end": entry.think_end, "reasoning": entry.reasoning,
        "text_parts": list(entry.text_parts), "calls": [[name, args] for name, args in entry.calls],
        "binding": entry.binding.hex(),
    })
    ids = np.ascontiguousarray(entry.output_ids, dtype="<i4").tobytes()
    return len(meta).to_bytes(_META_LEN, "little") + meta + ids


def decode_entry(entry_id: bytes, raw: bytes) -> LedgerEntry:
    """Inverse of ``encode_entry``; raises ValueError on malformed bytes."""
    try:
        n = int.from_bytes(raw[:_META_LEN], "little")
        meta = orjson.loads(raw[_META_LEN : _META_LEN + n])
        body = raw[_META_LEN + n :]
        if len(body) % 4:
            raise ValueError("token id bytes are not a multiple of 4")
        ids = np.frombuffer(body, dtype="<i4").astype(np.int32)
        return LedgerEntry(entry_id, ids, bool(meta["thinking"]), int(meta["think_end"]),
                           str(meta["reasoning"]), tuple(str(t) for t in meta["text_parts"]),
                           tuple((str(name), args) for name, args in meta["calls"]),
                           bytes.fromhex(str(meta.get("binding", ""))))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed ledger record: {exc}") from None


def content_key(text: str, calls: tuple[tuple[str, Any], ...], binding: bytes = b"") -> int:
    """Hash of the binding and the content view (text + calls); reasoning is checked separately
    because OpenAI clients often drop ``reasoning_content``."""
    h = xxhash.xxh3_128()
    h.update(binding)
    h.update(text.encode("utf-8", "surrogatepass"))
    for name, args in calls:
        h.update(b"\x00")
        h.update(name.encode("utf-8", "surrogatepass"))
        h.update(b"\x01")
        try:
            h.update(orjson.dumps(args, option=orjson.OPT_SORT_KEYS))
        except TypeError:
            h.update(repr(args).encode())
    return h.intdigest()


@dataclass(slots=True)
class LedgerStats:
    num_recorded: int = 0
    num_hits: int = 0
    num_divergences: int = 0  # entry found but the client's view differed
    num_bad_signatures: int = 0
    num_evictions: int = 0
    num_bytes: int = 0
    num_restored: int = 0  # entries replayed from the persisted log at start
    num_unbound: int = 0  # a genuine signature whose entry was made from another prefix or scope


@dataclass(slots=True)
class _Index:
    by_id: OrderedDict[bytes, LedgerEntry] = field(default_factory=OrderedDict)
    by_content: dict[int, bytes] = field(default_factory=dict)
    visible: dict[int, int] = field(default_factory=dict)  # content key without binding -> entries


class OutputLedger:
    """Bounded store of generated turns; an entry is reachable only through its binding (module
    docstring). Thread-safe."""

    def __init__(self, key: bytes | None = None, max_bytes: int = 512 << 20,
                 log: KeyedLog | None = None) -> None:
        self._key = key if key is not None else os.urandom(32)
        # the binding hash's seed: secret, so nobody can craft another prefix with the same binding
        self._seed = int.from_bytes(hmac.new(self._key, b"ledger binding seed", hashlib.sha256)
                                    .digest()[:8], "little")
        self.max_bytes = max_bytes
        self._idx = _Index()
        self._lock = threading.Lock()
        self.stats = LedgerStats()
        self._persist = log
        if log is not None:
            self._replay(log)

    def _replay(self, log: KeyedLog) -> None:
        bad = 0
        for entry_id, raw in log.replay():
            try:
                self._insert(decode_entry(entry_id, raw), restored=True)
            except ValueError:
                bad += 1
        if bad:
            logger.warning("output ledger: skipped %d unreadable persisted entries", bad)
        self.stats.num_restored = len(self._idx.by_id)
        logger.info("output ledger: %d entries (%.1f MiB) restored from the persisted log",
                    self.stats.num_restored, self.stats.num_bytes / (1 << 20))

    # --- bindings ----------------------------------------------------------------------------
    def prefix_hasher(self, scope: bytes = b"") -> xxhash.xxh3_128:
        """A hasher that, fed a prompt's ids in order (int32 bytes), gives at any point the
        binding of the prefix fed so far (``digest()``). ``scope``: the caller's (b"": none)."""
        h = xxhash.xxh3_128(seed=self._seed)
        h.update(len(scope).to_bytes(2, "little") + scope)
        return h

    # --- handles -----------------------------------------------------------------------------
    def new_entry_id(self) -> bytes:
        return os.urandom(_ID_BYTES)

    def signature(self, entry_id: bytes) -> str:
        mac = hmac.new(self._key, entry_id, hashlib.sha256).digest()[:_MAC_BYTES]
        return base64.urlsafe_b64encode(entry_id + mac).decode("ascii")

    def verify_signature(self, signature: str) -> bytes | None:
        """The entry id of a genuine signature; None for forged, foreign or malformed ones."""
        if len(signature) != _SIGNATURE_CHARS:  # not ours, whatever it decodes to
            return None
        try:
            raw = base64.urlsafe_b64decode(signature.encode("ascii"))
        except (ValueError, UnicodeEncodeError):
            return None
        if len(raw) != _ID_BYTES + _MAC_BYTES:
            return None
        entry_id, mac = raw[:_ID_BYTES], raw[_ID_BYTES:]
        good = hmac.new(self._key, entry_id, hashlib.sha256).digest()[:_MAC_BYTES]
        return entry_id if hmac.compare_digest(mac, good) else None

    # --- record / lookup ---------------------------------------------------------------------------
    def record(self, entry: LedgerEntry) -> None:
        if self._insert(entry) and self._persist is not None and entry.persist:
            try:
                raw = encode_entry(entry)
            except TypeError as exc:  # e.g. an integer argument wider than 64 bits: memory only
                logger.debug("ledger entry %s not persisted: %s", entry.entry_id.hex(), exc)
                return
            self._persist.put(entry.entry_id, raw)

    def _insert(self, entry: LedgerEntry, restored: bool = False) -> bool:
        size = entry.nbytes
        if size > self.max_bytes:
            return False
        ckey = content_key("".join(entry.text_parts), entry.calls, entry.binding)
        vkey = content_key("".join(entry.text_parts), entry.calls)
        with self._lock:
            idx = self._idx
            previous = idx.by_id.pop(entry.entry_id, None)  # a replayed log repeats refreshed entries
            if previous is not None:
                self.stats.num_bytes -= previous.nbytes
                _uncount(idx.visible, content_key("".join(previous.text_parts), previous.calls))
            idx.by_id[entry.entry_id] = entry
            idx.by_content[ckey] = entry.entry_id
            idx.visible[vkey] = idx.visible.get(vkey, 0) + 1
            self.stats.num_bytes += size
            if not restored:
                self.stats.num_recorded += 1
            while self.stats.num_bytes > self.max_bytes and idx.by_id:
                old_id, old = idx.by_id.popitem(last=False)
                self.stats.num_bytes -= old.nbytes
                self.stats.num_evictions += 1
                okey = content_key("".join(old.text_parts), old.calls, old.binding)
                if idx.by_content.get(okey) == old_id:
                    del idx.by_content[okey]
                _uncount(idx.visible, content_key("".join(old.text_parts), old.calls))
        return True

    def _get(self, entry_id: bytes) -> LedgerEntry | None:
        with self._lock:
            entry = self._idx.by_id.get(entry_id)
            if entry is not None:
                self._idx.by_id.move_to_end(entry_id)
            return entry

    def screen(self, signature: str | None, text_parts: list[str],
               calls: list[tuple[str, Any]]) -> tuple[bool, str | None]:
        """Whether any entry could serve this turn, whatever its binding (one the signature names,
        or one with this visible content; False lets the caller skip computing the binding), and
        the signature to pass to ``match``: None for a forged or foreign one (counted here)."""
        if signature:
            entry_id = self.verify_signature(signature)
            if entry_id is None:
                with self._lock:
                    self.stats.num_bad_signatures += 1
                signature = None
            elif entry_id in self._idx.by_id:
                return True, signature
        return content_key("".join(text_parts), tuple(calls)) in self._idx.visible, signature

    def match(
        self,
        binding: bytes,
        signature: str | None,
        reasoning: str | None,
        text_parts: list[str],
        calls: list[tuple[str, Any]],
        strict_parts: bool,
    ) -> LedgerEntry | None:
        """The entry for a client's assistant turn, if it was generated from the prefix whose
        binding is ``binding`` and the client's view equals it.

        ``reasoning`` None means the client sent no reasoning (then it is not compared).
        ``strict_parts``: compare text blocks one by one (Anthropic) instead of joined (OpenAI).
        """
        entry: LedgerEntry | None = None
        if not binding:
            return None
        if signature:
            entry_id = self.verify_signature(signature)
            if entry_id is None:
                with self._lock:
                    self.stats.num_bad_signatures += 1
            else:
                entry = self._get(entry_id)
                if entry is not None and not hmac.compare_digest(entry.binding, binding):
                    with self._lock:
                        self.stats.num_unbound += 1
                    entry = None
        calls_t = tuple(calls)
        if entry is None:
            ckey = content_key("".join(text_parts), calls_t, binding)
            with self._lock:
                eid = self._idx.by_content.get(ckey)
            if eid is None:
                return None
            entry = self._get(eid)
            if entry is None:
                return None
        same = (
            (reasoning is None or reasoning == entry.reasoning)
            and (tuple(text_parts) == entry.text_parts
                 if strict_parts else "".join(text_parts) == "".join(entry.text_parts))
            and _same_calls(calls_t, entry.calls)
        )
        with self._lock:
            if same:
                self.stats.num_hits += 1
            else:
                self.stats.num_divergences += 1
        if same and self._persist is not None:
            hit = entry
            self._persist.refresh(hit.entry_id, lambda: encode_entry(hit))
        if not same:
            logger.debug("ledger divergence for entry %s: %s", entry.entry_id.hex(),
                         _first_difference(entry, reasoning, text_parts, calls_t))
            return None
        return entry


def _uncount(counts: dict[int, int], key: int) -> None:
    left = counts.get(key, 0) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def _same_calls(a: tuple[tuple[str, Any], ...], b: tuple[tuple[str, Any], ...]) -> bool:
    if len(a) != len(b):
        return False
    return all(na == nb and _args_equal(xa, xb) for (na, xa), (nb, xb) in zip(a, b))


def _args_equal(a: Any, b: Any) -> bool:
    if isinstance(a, str) and not isinstance(b, str):
        try:
            a = orjson.loads(a)
        except orjson.JSONDecodeError:
            return False
    return bool(a == b)


def _first_difference(entry: LedgerEntry, reasoning: str | None, parts: list[str],
                      calls: tuple[Any, ...]) -> str:
    if reasoning is not None and reasoning != entry.reasoning:
        return f"reasoning differs at char {_diff_pos(reasoning, entry.reasoning)}"
    a, b = "".join(parts), "".join(entry.text_parts)
    if a != b:
        return f"text differs at char {_diff_pos(a, b)}"
    if tuple(parts) != entry.text_parts:
        return "text blocks split differently"
    return f"tool calls differ ({len(calls)} vs {len(entry.calls)})"


def _diff_pos(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
