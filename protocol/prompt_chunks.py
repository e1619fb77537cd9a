"""The ids of a session's earlier prompt, chunk by chunk: a new turn tokenizes only its new part.

``protocol/bound_prompt.py`` cuts a prompt into chunks at its assistant turns (after control
tokens only, so the ids of the chunks joined are the ids of the whole prompt). Between two turns
of a session the history's chunks are the same segments at the same positions. So this cache keeps recent
prompts, found by their first chunk (the system prompt, tools and first user message, the
"head"), each as its chunks by start position with their ids. A new prompt with the same head
compares each chunk's segments with the earlier prompt's chunk at the same position (a list
compare: C work, a memcmp of the text) and takes its ids when they are equal; only the chunks
that differ, the new part, go through ``PromptTokenizer.encode_segments`` (whose piece cache
still serves any text seen before). Comparing instead of hashing matters: hashing a 474K-token
history's fresh strings (Python's siphash) costs more than the compare and the tokenizer's walk
of the cached pieces together cost.

Exactness: a chunk is reused only when its segments equal the stored chunk's segments in full;
ids depend only on the segments (``protocol/tokenize.py``), so the ids are the ones
``encode_segments`` gives. Ledger ids are never stored here: the ledger is asked anew for every
assistant turn of every request (the binding of the ids in front of it, the caller scope and the
client's view are checked exactly as without this cache), and a turn it replaces is not a chunk.
The prompts hold only what tokenizing client text gives, and they are found per caller: the
head's key includes the caller scope (``server/auth.caller_scope``), so how fast one caller's
request is tokenized never tells whether another caller sent the same history (the piece cache
below it is shared, as it holds single pieces of text, not conversations).

Bounded: at most ``per_head`` prompts per head (the most recent), and ``max_bytes`` in all
(the ids and the characters of the text held), least recently used head out first. Thread-safe:
a request reads committed prompts (never changed afterwards) and commits its own once it is complete.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from protocol.render import Segment

_CHUNK_OVERHEAD_BYTES = 160  # the chunk object, its dict slot, its ids' header
_SEGMENT_OVERHEAD_BYTES = 72  # a (kind, payload) tuple held by a stored chunk


@dataclass(slots=True)
class Chunk:
    segments: list[Segment]
    ids: np.ndarray  # read-only int32
    num_chars: int  # characters of text in the chunk (the budget's estimate scales by them)

    @property
    def nbytes(self) -> int:
        return (self.ids.nbytes + self.num_chars + _CHUNK_OVERHEAD_BYTES
                + _SEGMENT_OVERHEAD_BYTES * len(self.segments))


@dataclass(slots=True)
class _Prompt:
    chunks: dict[int, Chunk] = field(default_factory=dict)  # by start position
    nbytes: int = 0


@dataclass(slots=True)
class ChunkStats:
    num_hits: int = 0  # chunks reused
    num_misses: int = 0  # chunks tokenized
    hit_tokens: int = 0
    num_prompts: int = 0
    num_bytes: int = 0
    num_evictions: int = 0  # prompts dropped for room


class PromptView:
    """One request's use of the cache: earlier prompts with its head to reuse chunks from, and
    its own prompt, recorded chunk by chunk and kept when complete (``finish``)."""

    def __init__(self, cache: ChunkCache, head: int | None, earlier: list[_Prompt]) -> None:
        self._cache = cache
        self._head = head
        self._earlier = earlier
        self._prompt = _Prompt()
        self.extended: _Prompt | None = None  # the earlier prompt the last reused chunk came from
        self.num_hits = self.num_misses = self.hit_tokens = 0

    def get(self, segments: list[Segment], start: int, end: int) -> Chunk | None:
        """The chunk ``segments[start:end]`` from an earlier prompt, when one holds exactly these
        segments at ``start``; it is recorded in this request's prompt too."""
        for prompt in self._earlier:
            old = prompt.chunks.get(start)
            if old is None or len(old.segments) != end - start:
                continue
            now = segments[start:end]
            try:
                same = now == old.segments
            except ValueError:  # ledger ids (arrays) compared: never reused
                same = False
            if same:
                chunk = Chunk(now, old.ids, old.num_chars)  # hold this request's text, not the old
                self._add(start, chunk)
                self.extended = prompt
                self.num_hits += 1
                self.hit_tokens += len(chunk.ids)
                return chunk
        return None

    def put(self, segments: list[Segment], start: int, end: int, ids: np.ndarray, num_chars: int) -> None:
        """Record a chunk this request tokenized."""
        ids.setflags(write=False)
        self._add(start, Chunk(segments[start:end], ids, num_chars))
        self.num_misses += 1

    def _add(self, start: int, chunk: Chunk) -> None:
        self._prompt.chunks[start] = chunk
        self._prompt.nbytes += chunk.nbytes

    def finish(self, keep: bool) -> None:
        """Count this request's chunks; with ``keep`` (its prompt was tokenized in full), keep its
        prompt for the next turn (the earlier prompt it extended is dropped)."""
        self._cache._finish(self._head, self._prompt if keep else None, self)


class ChunkCache:
    """Recent prompts' chunks, found by head (module docstring)."""

    def __init__(self, max_bytes: int = 512 << 20, per_head: int = 4) -> None:
        if max_bytes < 0 or per_head < 1:
            raise ValueError("max_bytes must be >= 0 and per_head >= 1")
        self.max_bytes = max_bytes
        self.per_head = per_head
        self._heads: OrderedDict[int, list[_Prompt]] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = ChunkStats()

    def view(self, segments: list[Segment], head_end: int, scope: bytes = b"") -> PromptView:
        """A request's view; ``segments[:head_end]`` is its first chunk, ``scope`` its caller's."""
        head: int | None
        try:
            head = hash((scope, tuple(segments[:head_end])))
        except TypeError:  # ledger ids (an array) in the head: nothing to share
            head = None
        earlier: list[_Prompt] = []
        if head is not None:
            with self._lock:
                earlier = list(self._heads.get(head, ()))
                if earlier:
                    self._heads.move_to_end(head)
        return PromptView(self, head, earlier)

    def _finish(self, head: int | None, prompt: _Prompt | None, view: PromptView) -> None:
        with self._lock:
            stats = self.stats
            stats.num_hits += view.num_hits
            stats.num_misses += view.num_misses
            stats.hit_tokens += view.hit_tokens
            if head is None or prompt is None or not prompt.chunks or prompt.nbytes > self.max_bytes:
                return
            prompts = self._heads.pop(head, [])
            # the earlier prompt this one extends: this one holds its chunks (by this request's text)
            if view.extended is not None and view.extended in prompts:
                prompts.remove(view.extended)
                stats.num_bytes -= view.extended.nbytes
                stats.num_prompts -= 1
            prompts.insert(0, prompt)
            stats.num_bytes += prompt.nbytes
            stats.num_prompts += 1
            for p in prompts[self.per_head:]:
                stats.num_bytes -= p.nbytes
                stats.num_prompts -= 1
                stats.num_evictions += 1
            del prompts[self.per_head:]
            self._heads[head] = prompts
            while stats.num_bytes > self.max_bytes and self._heads:
                _, dropped = self._heads.popitem(last=False)
                for p in dropped:
                    stats.num_bytes -= p.nbytes
                    stats.num_prompts -= 1
                    stats.num_evictions += 1

    def clear(self) -> None:
        with self._lock:
            self._heads.clear()
            self.stats.num_bytes = 0
            self.stats.num_prompts = 0
