"""The cache tiers' own settings (``CacheConfig``), built from the workload config by the server
(``WorkloadConfig.cache_config``).

Only ``prefix_cache``, ``l1_cache`` and ``l1_host_gb`` come from the seed guide's keys; the
rest are tuning knobs with defaults taken from the workload research
(the public agent traces in ``docs/loadtest.md``) and documented in ``docs/cache.md``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from cache.admission import AdmissionConfig
from cache.router import RouterConfig

DEEPINFER_KV_WATERMARK = 0.9  # DeepInfer 0.1.0 (docs/deepinfer.md): prefill only at usage <= this


class CacheConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    prefix_cache: bool = Field(True, description="L0 prefix cache + session routing; off = every turn cold.")
    l1_cache: bool = Field(True, description="L1 host tier (needs an engine with export/import and a pool).")
    l1_host_gb: float = Field(128, ge=0, description="L1 budget per rank, GiB (see rank/host_budget.py).")
    hash_salt: str = Field("", description="Mixed into the root block hash (model / KV format name).")
    protect_s: float = Field(
        30.0, ge=0, description="A session expected back within this many seconds is not evicted "
        "to admit another turn (until that turn has queued force_after_s)."
    )
    output_reserve_tokens: int = Field(
        8192, ge=1, description="Output tokens a turn reserves at admission (capped: clients such "
        "as OpenAI SDKs without max_tokens would otherwise reserve the whole context). Longer "
        "replies grow their reservation while they decode, evicting idle blocks (cache/output_room.py)."
    )
    output_lead_tokens: int = Field(
        256, ge=1, description="A running reply's KV reservation grows once fewer than this many of "
        "its tokens are left (time for evicted blocks' releases to land before the engine needs them)."
    )
    output_grow_tokens: int = Field(
        2048, ge=1, description="Tokens a running reply's reservation grows by (cache/output_room.py)."
    )
    reserve_blocks: int = Field(
        2, ge=0, description="Blocks per rank kept out of admission (slack for decode overrun)."
    )
    usable_fraction: float = Field(
        1.0, gt=0, le=1, description="Share of each rank's pool the cache may fill with cached + "
        "reserved blocks. DeepInfer counts cached blocks in the KV usage that gates prefill (a rank "
        "stops prefilling above 0.9), so WorkloadConfig.cache_config sets 0.9 for engine 'deepinfer'."
    )
    l1_write_watermark: float = Field(
        0.0, ge=0, le=1, description="Write a finished turn's new blocks through to L1 (and L2 behind "
        "it) once the rank's pool is this full (cached + reserved blocks / usable blocks). 0, the "
        "default: after every turn, so a crash loses only the turns in flight."
    )
    l1_headroom_fraction: float = Field(0.125, ge=0, le=4, description="Extra L1 slots per session extent.")
    l1_min_headroom_blocks: int = Field(16, ge=0, description="Minimum extra L1 slots per extent.")
    home_horizon_s: float = Field(
        900.0, gt=0, description="Idle sessions expected back within this count toward their rank's load."
    )
    session_forget_s: float = Field(7200.0, gt=0,
                                    description="Idle sessions holding nothing are forgotten after this.")
    queue_force_after_s: float = Field(5.0, ge=0,
                                       description="Queued head may evict protected sessions after this.")
    queue_fail_after_s: float = Field(120.0, gt=0, description="Queued turn fails with 503 after this.")
    queue_recheck_s: float = Field(0.25, gt=0, description="Queued head re-check period.")
    max_queue_depth: int = Field(1024, ge=1, description="Turns waiting per rank before new ones get 503.")
    overload_ratio: float = Field(1.5, ge=1,
                                  description="Move sessions off a rank this much above the lightest.")
    move_min_tokens: int = Field(65_536, ge=0, description="...and at least this many tokens above it.")
    move_cooldown_s: float = Field(60.0, ge=0, description="A session moves at most once per this period.")
    place_homeless: bool = Field(
        True, description="Late binding: a session with nothing on its home rank that L1 lacks runs on "
        "the first rank with room (cache/router.py rule 4; docs/loadtest.md, \"Late binding\")."
    )
    branch_routing: bool = Field(
        True, description="Each branch of a session (a subagent: its agent id header, or detected from "
        "prompts that extend none of the session's tails while it has a turn in flight) is its own "
        "routing unit; off: every turn under one session key goes to the session's home rank "
        "(cache/sessions.py, docs/cache.md \"Routing rules\")."
    )
    l1_copy_cost: float = Field(
        0.1, ge=0, le=1, description="What a prompt token held on another rank (or in L1) costs a rank "
        "without it in the router's rule 3, in prefilled tokens (one copy through L1 instead of a prefill)."
    )
    copy_min_tokens: int = Field(2048, ge=0, description="The least held prefix worth copying through L1.")

    def admission(self) -> AdmissionConfig:
        return AdmissionConfig(
            force_after_s=self.queue_force_after_s,
            fail_after_s=self.queue_fail_after_s,
            recheck_s=self.queue_recheck_s,
            max_queue_depth=self.max_queue_depth,
        )

    def router(self) -> RouterConfig:
        return RouterConfig(
            overload_ratio=self.overload_ratio,
            move_min_tokens=self.move_min_tokens,
            move_cooldown_s=self.move_cooldown_s,
            place_homeless=self.place_homeless,
            l1_copy_cost=self.l1_copy_cost,
            copy_min_tokens=self.copy_min_tokens,
        )
