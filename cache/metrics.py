"""Prometheus metrics of the cache tiers, registered on a caller-supplied registry.

Nothing here touches the global default registry: the server passes its own
``CollectorRegistry`` (tests pass a fresh one each), so two managers never collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_QUEUE_BUCKETS_S = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_RESTORE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class CacheMetrics:
    """Hit rate by tier (tokens), restores, evictions, queueing and per-rank load."""

    def __init__(self, registry: CollectorRegistry, namespace: str = "deepinfer_cache") -> None:
        ns = namespace
        self.prompt_tokens = Counter(
            "prompt_tokens", "Prompt tokens of admitted turns.", namespace=ns, registry=registry
        )
        self.cached_tokens = Counter(
            "cached_tokens",
            "Prompt tokens served from cache, by tier (l0 = GPU blocks, l1 = restored from host).",
            ["tier"],
            namespace=ns,
            registry=registry,
        )
        self.restored_tokens = Counter(
            "l1_restored_tokens", "Tokens restored from L1 into a rank's GPU pool.", namespace=ns,
            registry=registry
        )
        self.restore_seconds = Histogram(
            "l1_restore_seconds",
            "Wall time of one L1 -> GPU restore (import_blocks).",
            namespace=ns,
            registry=registry,
            buckets=_RESTORE_BUCKETS_S,
        )
        self.written_blocks = Counter(
            "l1_written_blocks", "Blocks copied GPU -> L1 (write-through and moves).", namespace=ns,
            registry=registry
        )
        self.written_bytes = Counter(
            "l1_written_bytes", "Bytes copied GPU -> L1 (write-through and moves; only blocks L1 lacks).",
            namespace=ns, registry=registry,
        )
        self.evicted_blocks = Counter(
            "evicted_blocks",
            "Blocks evicted, by tier and whether L1 held a copy (l0 only).",
            ["tier", "l1_backed"],
            namespace=ns,
            registry=registry,
        )
        self.partial_prefix_admissions = Counter(
            "partial_prefix_admissions",
            "Turns that got less of their session's already-computed prefix than it had (L0 + L1).",
            namespace=ns, registry=registry,
        )
        self.lost_prefix_tokens = Counter(
            "lost_prefix_tokens", "Prompt tokens a session had computed before that its turn recomputed.",
            namespace=ns, registry=registry,
        )
        self.duplicate_blocks = Counter(
            "duplicate_blocks", "Kept blocks released because the index already held their hash.",
            namespace=ns, registry=registry,
        )
        self.output_room_grown_blocks = Counter(
            "output_room_grown_blocks", "Blocks running replies' KV reservations grew by while decoding.",
            namespace=ns, registry=registry,
        )
        self.output_room_short_blocks = Counter(
            "output_room_short_blocks", "Blocks of that growth neither free nor evictable (running "
            "sequences held the pool; new turns waited).", namespace=ns, registry=registry,
        )
        self.sessions_moved = Counter(
            "sessions_moved", "Sessions moved to another rank through L1.", namespace=ns, registry=registry
        )
        self.queue_seconds = Histogram(
            "admission_queue_seconds",
            "Time a turn waited for KV room before admission.",
            namespace=ns,
            registry=registry,
            buckets=_QUEUE_BUCKETS_S,
        )
        self.queue_depth = Gauge(
            "admission_queue_depth", "Turns waiting for KV room.", ["rank"], namespace=ns, registry=registry
        )
        self.admissions = Counter(
            "admissions", "Admission outcomes.", ["outcome"], namespace=ns, registry=registry
        )
        self.routed_turns = Counter(
            "routed_turns", "Admitted turns by rank, routing rule (cache/router.py) and request class "
            "(main, subagent: a branch of a session, auxiliary).", ["rank", "reason", "request_class"],
            namespace=ns, registry=registry,
        )
        self.prefix_copies = Counter(
            "prefix_copies", "Prefixes held on another rank copied through L1 for a new session or branch, "
            "by outcome.", ["outcome"], namespace=ns, registry=registry,
        )
        self.rank_load_tokens = Gauge(
            "rank_load_tokens",
            "Router load measure (running + waiting + idle homed session tokens).",
            ["rank"],
            namespace=ns,
            registry=registry,
        )
        self.rank_free_blocks = Gauge(
            "rank_free_blocks", "Blocks neither cached nor reserved.", ["rank"], namespace=ns,
            registry=registry
        )
        self.rank_cached_blocks = Gauge(
            "rank_cached_blocks", "Blocks held by the L0 index.", ["rank"], namespace=ns, registry=registry
        )
        self.l1_used_slots = Gauge("l1_used_slots", "L1 host slots in use.", namespace=ns, registry=registry)
        self.l1_slots = Gauge("l1_slots", "L1 host slots in the pool.", namespace=ns, registry=registry)
        self.l1_enabled = Gauge("l1_enabled", "1 when the L1 tier is on.", namespace=ns, registry=registry)
