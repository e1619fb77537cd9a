"""The modelled deployment: pool sizes, engine cost model, and the knobs the calibration fitted.

Published figures of the seed deployment (``/work/shared/seeds/000_44346cd874f649af.txt``, 4x B200,
DeepSeek-V4.1-Flash on DeepInfer, ep 4): 14.3M tokens of GPU KV pool and 154M tokens of L1 per rank,
``max_num_seqs`` 128 and ``max_num_batched_tokens`` 16384 per rank; a 1M-token session restores from
L1 in about 60 ms; cold start 397 x ~440K tokens in 14.6 min (~50K prefill tokens/s per GPU
including attention over the growing context; the issue quotes ~88K/s for the GEMM-bound part).

Cost model of one rank (lockstep: every step of the group lasts as long as its slowest rank):

* prefill chunk of ``n`` new tokens on a context that starts at ``c``:
  ``n / prefill_tokens_per_s + prefill_attn_s_per_token2 * n * (c + n / 2)``. The attention term is
  set so that a cold 440K prefill averages ~50K tokens/s (the cold-start figure).
* decode step with ``B`` running sequences holding ``K`` context tokens:
  ``decode_base_s + decode_per_seq_s * B + decode_per_kv_token_s * K``; each step emits
  ``decode_tokens_per_step`` tokens per sequence (DSpark speculative decoding accepts several).
* DeepInfer's step-type vote (``reference/deepinfer-engine.md`` section 1): a prompt step happens at
  ``decode_step % 70 == 0`` (0 included, so right after a prompt step) if every rank wants one,
  or at ``decode_step % 100 == 0`` (not 0) if any rank does; a rank wants one when its KV usage
  (every non-free block, cached ones included) is <= 0.9 and its waiting head can be allocated.
  One chunked sequence per step ends the batch; its next chunk needs the next passing vote. With
  nothing decoding the group runs placeholder steps (``placeholder_step_s``) up to that point.
* decode growth with no free block preempts the longest output; DeepInfer's default
  ``stop_preempted_request`` fails that request ("insufficient_system_resource").
* tokenization before admission: the seed re-tokenizes the whole conversation per turn
  (``tokenize_tokens_per_s``, measured 0.25M tokens/s on one core, ``reference/measurements.md``);
  our protocol layer tokenizes only what is new.

The free parameters (decode costs and the tokenize rate) were fitted to the seed's four published
rows; ``python -m bench.simulator seed-table`` shows the fit.
Sessions are simulated at ``block_tokens`` per block (default: context / 256, e.g. 512 at 128K and
2048 at 500K-1M), which adds up to one block of replayed tokens per turn (<= 1% of the prompt).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class EngineModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prefill_tokens_per_s: float = Field(88_000.0, gt=0)
    prefill_attn_s_per_token2: float = Field(3.9e-11, ge=0)
    decode_base_s: float = Field(0.010, ge=0)
    decode_per_seq_s: float = Field(0.0009, ge=0)
    decode_per_kv_token_s: float = Field(2.0e-9, ge=0)
    decode_tokens_per_step: float = Field(2.5, gt=0)
    prefill_all_interval_steps: int = Field(
        70, ge=1, description="DeepInfer DEEPINFER_PREFILL_ATTEMPT_INTERVAL: 'ALL' vote points (incl. step 0)"
    )
    prefill_any_interval_steps: int = Field(
        100, ge=1, description="DeepInfer DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL: 'ANY' vote points"
    )
    kv_watermark: float = Field(0.9, gt=0, le=1, description="a rank wants prefill only at KV usage <= this")
    stop_preempted_request: bool = Field(
        True, description="DeepInfer default: a sequence preempted in decode fails (insufficient_system_resource)"
    )
    placeholder_step_s: float = Field(0.010, ge=0, description="a step with nothing scheduled (1-token forward)")
    max_num_seqs: int = Field(128, ge=1)
    max_num_batched_tokens: int = Field(16_384, ge=1)

    def prefill_s(self, num_tokens: int, context_start: int) -> float:
        return num_tokens / self.prefill_tokens_per_s + self.prefill_attn_s_per_token2 * num_tokens * (
            context_start + num_tokens / 2
        )

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
    kv_bytes_per_token: int = Field(890, ge=1, description="~890 B/token (reference/measurements.md)")
    restore_tokens_per_s: float = Field(16.7e6, gt=0, description="seed: ~60 ms per 1M-token session")
    tokenize_tokens_per_s: float = Field(
        500_000.0, gt=0,
        description="fitted (the one free TTFT parameter): 2x the 0.25M tokens/s measured on one core of "
        "the loaded 2-core build VM (reference/measurements.md); the seed's host is an idle server CPU",
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


class SimConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    deployment: Deployment = Deployment()
    engine: EngineModel = EngineModel()
    seed_policy: SeedPolicy = SeedPolicy()
    policy: Literal["seed", "ours"] = "seed"
    duration_s: float = Field(900.0, gt=0)
    warmup_s: float = Field(300.0, ge=0)
    ramp_s: float = Field(60.0, ge=0)
    seed: int = 0
    steady_start: bool = Field(
        True,
        description="each agent's first conversation starts at a uniform point of a conversation's "
        "life (between its initial context and the target), so the measured window sees the "
        "steady-state mix of context sizes, as a load test that has run for a while does (aiperf "
        "AgentX starts each session at a uniform point of its trace, agent-workload.md [A1])",
    )
