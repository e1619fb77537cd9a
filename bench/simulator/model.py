"""The modelled deployment: pool sizes, engine cost model, the load test's arrivals, and the fit.

Published figures of the seed deployment (its guide, "Run DeepInfer with InferenceKey", 4x B200,
DeepSeek-V4.1-Flash on DeepInfer, ep 4): 14.3M tokens of GPU KV pool and 154M tokens of L1 per rank,
``max_num_seqs`` 128, ``max_num_batched_tokens`` 16384 per rank and ``max_model_len`` 1,064,960; a
1M-token session restores from L1 in about 60 ms; cold start of 397 conversations of ~440K tokens in
14.6 min (176M tokens: 50.2K prefill tokens/s per GPU). The prebuilt package's notes
(the prebuilt DeepInfer package's notes) measured about 88K prefill tokens/s per GPU with
138K-token prompts.

Cost model of one rank (lockstep: every step of the group lasts as long as its slowest rank):

* prefill of ``n`` new tokens on a context that starts at ``c``:
  ``n / prefill_tokens_per_s + prefill_attn_s_per_token2 * n * (c + n / 2)``. A cold prompt of
  ``L`` tokens then averages ``1 / (1 / prefill_tokens_per_s + prefill_attn_s_per_token2 * L / 2)``
  tokens/s; the two published figures (88K/s at L = 138K, 50.2K/s at L = 440K) fix both terms:
  7.45 us per token (134K tokens/s) plus 5.67e-11 s per token per context token.
* decode step with ``B`` running sequences holding ``K`` context tokens:
  ``decode_base_s + decode_per_seq_s * B + decode_per_kv_token_s * K``. Each request emits its own
  tokens per step: DeepInfer decodes 1 + ``nextn`` (5) query tokens per sequence
  (``DEEPINFER_USE_NEXTN_DECODE``; variable-length MTP is off by default) and keeps the accepted
  drafts, so a request's speed depends on its content. ``decode_tokens_per_step`` is the mean,
  ``decode_accept_sigma`` the spread between requests (fitted, see below).
* DeepInfer's step-type vote (the ``deepinfer==0.1.0`` sdist, ``docs/deepinfer.md``; scheduler.hpp
  ``_schedule`` in the 0.1.0 sdist): a prompt step happens at ``decode_step % 70 == 0`` (0
  included, so right after a prompt step) if every rank wants one, or at ``decode_step % 100 == 0``
  (not 0) if any rank does; a rank wants one when its KV usage (every non-free block, cached ones
  included) is <= 0.9 and its waiting queue is not empty. A prompt step in which no rank could
  schedule anything becomes a decode step (the second vote). One chunked sequence per step ends
  the batch and goes back to the queue's head; its next chunk needs the next passing vote. With
  nothing decoding the group runs placeholder steps (``placeholder_step_s``) up to that point.
* decode growth with no free block preempts the longest output; DeepInfer's default
  ``stop_preempted_request`` fails that request ("insufficient_system_resource").
* tokenization before admission: the seed re-tokenizes the whole conversation per turn
  (``tokenize_tokens_per_s``); our protocol layer tokenizes only what is new.

Fitted (one set for every row, ``python -m bench.simulator seed-table``): the decode step
(``decode_base_s``, ``decode_per_seq_s``, ``decode_per_kv_token_s``), the acceptance
(``decode_tokens_per_step``, ``decode_accept_sigma``) and the seed's tokenize rate. Everything
else is a published or measured figure or a DeepInfer default.

Sessions are simulated at ``block_tokens`` per block (default: context / 256, e.g. 512 at 128K and
2048 at 500K-1M), which adds up to one block of replayed tokens per turn (<= 1% of the prompt).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from server.scheduling import SchedulingConfig


class EngineModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prefill_tokens_per_s: float = Field(134_000.0, gt=0, description="GEMM-bound rate (zero context)")
    prefill_attn_s_per_token2: float = Field(5.67e-11, ge=0, description="per new token per context token")
    decode_base_s: float = Field(0.0035, ge=0)
    decode_per_seq_s: float = Field(0.00146, ge=0)
    decode_per_kv_token_s: float = Field(1.17e-9, ge=0)
    decode_tokens_per_step: float = Field(3.5, ge=1,
                                          description="mean tokens a sequence emits per decode step")
    decode_accept_sigma: float = Field(
        0.4, ge=0,
        description="per-request spread of the speculative acceptance: a request's tokens per step "
        "is the mean x exp(sigma z - sigma^2 / 2), z ~ N(0, 1), clipped to 1..1 + nextn",
    )
    nextn: int = Field(5, ge=0, description="DEEPINFER_USE_NEXTN_DECODE: draft tokens per step (default 5)")
    prefill_all_interval_steps: int = Field(
        70, ge=1, description="DeepInfer DEEPINFER_PREFILL_ATTEMPT_INTERVAL: 'ALL' vote points (incl. step 0)"
    )
    prefill_any_interval_steps: int = Field(
        100, ge=1, description="DeepInfer DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL: 'ANY' vote points"
    )
    kv_watermark: float = Field(0.9, gt=0, le=1, description="a rank wants prefill only at KV usage <= this")
    stop_preempted_request: bool = Field(
        True,
        description="DeepInfer default: a sequence preempted in decode fails (insufficient_system_resource)"
    )
    prompt_step_overhead_s: float = Field(
        0.0, ge=0, description="sensitivity only: a fixed cost added to every prompt step a rank works in "
        "(unmeasured; 0 in the fit, whose prefill rates came from long prompts)")
    imports_at_boundary: bool = Field(
        False, description="L1 imports run on the rank's loop between steps and stall the group for "
        "their copy (DeepInfer through our adapter: rank/worker.py drains commands between steps), "
        "instead of beside the step (the reference engine's transfer thread)")
    exports_at_boundary: bool = Field(False, description="the same for L1 exports (writes)")
    imports_wait_decode_step: bool = Field(
        False, description="L1 imports beside the step, but each first waits for the GPU to finish the "
        "decode step in progress (DeepInfer through the transfer thread: its import's copy waits on the "
        "fence recorded after the previous step call, which under zero-overhead scheduling completes "
        "with the step the GPU is running; a prompt step syncs in place, so there the fence is already "
        "past: rank/deepinfer_transfers.py). No group stall. Ignored with imports_at_boundary")
    placeholder_step_s: float = Field(0.010, ge=0,
                                      description="a step with nothing scheduled (1-token forward)")
    max_num_seqs: int = Field(128, ge=1)
    max_num_batched_tokens: int = Field(16_384, ge=1)

    def prefill_s(self, num_tokens: int, context_start: int) -> float:
        return num_tokens / self.prefill_tokens_per_s + self.prefill_attn_s_per_token2 * num_tokens * (
            context_start + num_tokens / 2
        )

    def accepted_tokens(self, rng: np.random.Generator) -> float:
        """One request's tokens per decode step (see ``decode_accept_sigma``)."""
        mean, sigma = self.decode_tokens_per_step, self.decode_accept_sigma
        value = mean * math.exp(sigma * rng.standard_normal() - sigma * sigma / 2) if sigma > 0 else mean
        return min(1.0 + self.nextn, max(1.0, value))

    def decode_step_s(self, num_seqs: int, kv_tokens: int) -> float:
        if num_seqs == 0:
            return 0.0
        return self.decode_base_s + self.decode_per_seq_s * num_seqs + self.decode_per_kv_token_s * kv_tokens


class Deployment(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_ranks: int = Field(4, ge=1)
    gpu_kv_tokens_per_rank: int = Field(14_300_000, ge=1)
    l1_tokens_per_rank: int = Field(154_000_000, ge=0)
    block_tokens: int = Field(0, ge=0, description="simulated block size (DeepInfer: 128); 0 = context / 256")
    kv_bytes_per_token: int = Field(890, ge=1, description="~890 B/token (docs/cache.md)")
    restore_tokens_per_s: float = Field(16.7e6, gt=0, description="seed: ~60 ms per 1M-token session")
    tokenize_tokens_per_s: float = Field(
        500_000.0, gt=0,
        description="fitted: 2x the 0.25M tokens/s measured on one core of the loaded 2-core build VM "
        "(measured on the H200 host, ``docs/cache.md``); the seed's host is an idle server CPU",
    )

    def for_context(self, context_tokens: int) -> Deployment:
        """Resolve ``block_tokens=0``: the largest power of two <= context/256, within 128..2048."""
        if self.block_tokens:
            return self
        bs = 128
        while bs * 2 <= min(2048, context_tokens // 256):
            bs *= 2
        return self.model_copy(update={"block_tokens": bs})

    @property
    def num_blocks(self) -> int:
        return self.gpu_kv_tokens_per_rank // self.block_tokens + 1  # + scratch block 0

    @property
    def num_host_slots(self) -> int:
        return self.num_ranks * self.l1_tokens_per_rank // self.block_tokens


class SeedPolicy(BaseModel):
    """The seed's cache behaviour as its guide describes it (an assumption where it is silent)."""

    model_config = ConfigDict(extra="forbid")

    full_retokenize: bool = True
    strip_queued: Literal["always", "idle_rank"] = Field(
        "always",
        description="when L0 cannot free enough idle blocks, the prefixes of turns queued in the engine "
        "are dropped (the turn recomputes): 'always', or only when nothing runs on that rank "
        "('idle_rank'; running turns free blocks as they end). The guide is silent; the two bracket it",
    )


class Arrivals(BaseModel):
    """How a simulated load-test step's agents start and when their conversations restart."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    start_fraction: tuple[float, float] | None = Field(
        None, description="first conversation's size as a fraction of the target (uniform); "
        "None = the workload's start_fraction_min/max (0.4-0.6)",
    )
    steady: bool = Field(
        False, description="the first conversation joins at a uniform point of its life, between its start "
        "and the target (aiperf AgentX starts sessions at a uniform point of a trace, "
        "agent-workload.md [A1])",
    )
    prewarm: bool = Field(False,
                          description="each agent's first turn is prefilled at no cost (a cold start before)")
    subagents: Literal["off", "light", "heavy"] = Field(
        "off", description="subagent fan-outs when SimConfig.subagents is 'auto' "
        "(bench/loadgen/subagents.py)")
    compact_at_target: bool = Field(
        True, description="a conversation that would pass the target starts over as a new session (one cold "
        "turn); otherwise only one that would pass max_model_len does",
    )


ARRIVALS: dict[str, Arrivals] = {
    # The calibration's arrivals, from what the seed states about its test: its cold start ran 397
    # conversations of about 440K tokens (0.88 of 500K) and its Limits section counts the 500K
    # sessions as "about 120 sessions of 450K tokens" filling the 57M-token pool; its 98% hit at 128K
    # is what the per-turn new tokens alone leave (no compaction in the window); and its 4.4 s TTFT p95
    # at 500K x 50 rules out cold 250-475K-token turns in the window (docs/loadtest.md, section 2).
    # The seed's test sent no subagents.
    "seed": Arrivals(start_fraction=(0.8, 0.95), prewarm=True, compact_at_target=False),
    # Steady state of endless agents (the earlier default): sizes spread over a conversation's life.
    # Subagents as in the corpora AgentX replays (chosen for them: ~40% of requests off the main thread).
    "steady": Arrivals(steady=True, prewarm=True, subagents="heavy"),
    # The project's load generator (bench/loadgen): fresh 0.4-0.6 conversations, cold first turns.
    # Subagents as in the public Claude Code traces (3% of sessions).
    "fresh": Arrivals(subagents="light"),
}


class OursPolicy(BaseModel):
    """The backend's own levers on top of the real ``cache/`` code, with the
    service's defaults: late binding of sessions L1 can restore anywhere (``cache/router.py``
    rule 4, on), the vote filler (``rank/vote_filler.py``, on; modelled in ``SimGroup``) and the
    submit gate (``server/scheduling.py``, off; docs/loadtest.md, "Moving the tail").
    ``OURS_OFF`` is the cache code alone."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    scheduling: SchedulingConfig = SchedulingConfig()
    place_homeless: bool = True
    vote_filler: bool = True
    cache: dict[str, float | bool] = Field(default_factory=dict,
                                    description="other CacheConfig overrides (exploration)")


OURS_OFF = OursPolicy(scheduling=SchedulingConfig(enabled=False), place_homeless=False, vote_filler=False)


class SimConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    deployment: Deployment = Deployment()
    engine: EngineModel = EngineModel()
    seed_policy: SeedPolicy = SeedPolicy()
    arrivals: Arrivals = ARRIVALS["seed"]
    policy: Literal["seed", "ours"] = "seed"
    ours: OursPolicy = OursPolicy()
    pacing: Literal["constant", "lognormal"] = Field(
        "constant", description="between turns: 3 s (the seed's test) or the human think time "
        "(lognormal p50 9 s, p90 74 s, bench/loadgen/distributions.py [W3])",
    )
    duration_s: float = Field(600.0, gt=0)
    warmup_s: float = Field(300.0, ge=0)
    ramp_s: float = Field(60.0, ge=0)
    max_model_len: int = Field(1_064_960, ge=1, description="the seed's max_model_len: no prompt may pass it")
    reply_end: Literal["client", "length"] = Field(
        "client", description="how a reply ends, as the service tells the cache (server/service.py "
        "_stop_kind): 'client' = as the agent's turn says (tool_use, or end_turn for a new user "
        "prompt), what a real model's replies to an agent do; 'length' = every reply is cut at "
        "max_tokens (stop kind unknown: never protected from eviction), what the reference engine's "
        "replies to the load generator do (its max_tokens is the sampled reply size)",
    )
    shared_prefix_tokens: int = Field(
        0, ge=0, description="the first N tokens of every conversation are the same ids for every agent "
        "(the load generator's system prompt and tools, identical in every request: the cache holds "
        "them once per rank); 0 = every conversation's ids are its own",
    )
    subagents: Literal["auto", "off", "light", "heavy"] = Field(
        "auto", description="subagent fan-outs (bench/loadgen/subagents.py); auto: the arrivals' own")
    seed: int = 0

    def subagent_mix(self) -> str:
        return self.arrivals.subagents if self.subagents == "auto" else self.subagents

    def uses_vote_filler(self) -> bool:
        return self.policy == "ours" and self.ours.vote_filler

    def with_engine(self, **fields: Any) -> SimConfig:
        """This config with some ``EngineModel`` fields changed."""
        return self.model_copy(update={"engine": self.engine.model_copy(update=fields)})
