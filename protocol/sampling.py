"""Sampling limits: what every engine (reference and DeepInfer) can run, defined once.

The boundary (``protocol/api.py`` and the wire schemas) refuses client values outside the wire
ranges with a 400 and maps accepted values to engine values with ``engine_sampling``; the rank
layer checks engine values again with ``sampling_error`` (defence in depth), so a request that
slipped past the boundary fails alone instead of failing a sampler inside a rank step. Only the
standard library is imported: the rank processes (DeepInfer's venv) import this module too.

Wire ranges (a client may send; anything else is a 400 naming the field):

==================  ===============================  ==========================================
field               range                            note
==================  ===============================  ==========================================
temperature         [0, 2]                           both APIs
top_p               [0, 1]                           both APIs
top_k               OpenAI >= -1, Anthropic >= 0     -1/0 = no filter; >= vocabulary = no filter
seed (OpenAI)       [-2**63, 2**64 - 1]              int64 or uint64, taken modulo 2**64
presence/frequency  [-2, 2]                          accepted and ignored (no engine has them)
n                   1                                one choice per request
logprobs            false / top_logprobs 0           neither engine returns log-probabilities
stop                1..STOP_MAX_CHARS chars each     at most 16 (OpenAI) / 64 (Anthropic)
max_tokens          >= 1                             clamped to the room left in max_model_len
==================  ===============================  ==========================================

Engine values (what ``engine_sampling`` returns and ``sampling_error`` accepts):

* ``temperature`` 0 (greedy) or in ``[GREEDY_TEMPERATURE, TEMPERATURE_MAX]``. Below
  ``GREEDY_TEMPERATURE`` DeepInfer samples greedily and forces top_p 1, top_k -1
  (``deepinfer-engine.md`` section 2, sampling_params.py:47-83); the boundary does the same, so
  ``logits / temperature`` never overflows in either engine.
* ``top_p`` in ``[TOP_P_MIN, 1]``. A smaller top_p keeps only the most likely token whatever the
  logits (the top token's probability is at least 1/vocabulary > TOP_P_MIN for vocabularies up to
  a million ids), so it *is* greedy, and the boundary sends it as greedy. This removes the case
  where a tiny top_p rounds to 0 in the sampler's float dtype and every token is filtered out.
* ``top_k`` -1 (no filter) or in ``[1, vocab_size)``: a top_k at or above the vocabulary keeps
  every id, which is no filter, and is sent as -1 (``torch.topk`` with k > vocabulary raises).
* ``seed`` None (engine-chosen) or in ``[0, 2**64)``: DeepInfer's ``seq_seed`` is a u64.
* ``max_tokens`` in ``[1, MAX_TOKENS_MAX]`` (the boundary clamps it to max_model_len).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

TEMPERATURE_MAX = 2.0
GREEDY_TEMPERATURE = 1e-5
TOP_P_MIN = 1e-6
TOP_K_MIN_OPENAI = -1
TOP_K_MIN_ANTHROPIC = 0
SEED_WIRE_MIN = -(2**63)
SEED_WIRE_MAX = 2**64 - 1
SEED_MODULUS = 2**64
PENALTY_MIN = -2.0
PENALTY_MAX = 2.0
MAX_STOP_SEQUENCES_OPENAI = 16
MAX_STOP_SEQUENCES_ANTHROPIC = 64
STOP_MAX_CHARS = 512  # the stop matcher's work per token grows with the longest stop sequence
MAX_TOKENS_MAX = 2**31 - 1  # int32 in DeepInfer's scheduler


@dataclass(frozen=True, slots=True)
class EngineSampling:
    """Sampling values both engines run as given (see the module docstring)."""

    temperature: float
    top_p: float
    top_k: int
    seed: int | None


def engine_sampling(temperature: float | None, top_p: float | None, top_k: int | None,
                    seed: int | None, vocab_size: int) -> EngineSampling:
    """Map client values (already inside the wire ranges) to engine values.

    ``None`` means "not sent": temperature 1, top_p 1, no top_k, engine-chosen seed.
    """
    t = 1.0 if temperature is None else float(temperature)
    p = 1.0 if top_p is None else float(top_p)
    k = -1 if top_k is None or top_k <= 0 or top_k >= vocab_size else int(top_k)
    s = None if seed is None else int(seed) % SEED_MODULUS
    if t < GREEDY_TEMPERATURE or p < TOP_P_MIN:
        return EngineSampling(0.0, 1.0, -1, s)
    return EngineSampling(t, p, k, s)


def sampling_error(max_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None,
                   vocab_size: int | None = None) -> str | None:
    """Why an engine cannot run these values, or None when it can. Never raises."""
    if not _is_int(max_tokens) or not 1 <= max_tokens <= MAX_TOKENS_MAX:
        return f"max_tokens must be an int in [1, {MAX_TOKENS_MAX}], got {max_tokens!r}"
    if not _is_number(temperature) or not (
        temperature == 0 or GREEDY_TEMPERATURE <= temperature <= TEMPERATURE_MAX
    ):
        return f"temperature must be 0 or in [{GREEDY_TEMPERATURE}, {TEMPERATURE_MAX}], got {temperature!r}"
    if not _is_number(top_p) or not TOP_P_MIN <= top_p <= 1.0:
        return f"top_p must be in [{TOP_P_MIN}, 1], got {top_p!r}"
    top_k_max = vocab_size - 1 if vocab_size else MAX_TOKENS_MAX
    if not _is_int(top_k) or not (top_k == -1 or 1 <= top_k <= top_k_max):
        return f"top_k must be -1 or in [1, {top_k_max}], got {top_k!r}"
    if seed is not None and (not _is_int(seed) or not 0 <= seed < SEED_MODULUS):
        return f"seed must be None or an int in [0, 2**64), got {seed!r}"
    return None


def check_stop_sequences(stops: list[str], max_count: int) -> None:
    """Raise ValueError (a 400 at the boundary) unless 0..max_count non-empty, short strings."""
    if len(stops) > max_count:
        raise ValueError(f"at most {max_count} stop sequences")
    for stop in stops:
        if not stop:
            raise ValueError("stop sequences must not be empty strings")
        if len(stop) > STOP_MAX_CHARS:
            raise ValueError(f"stop sequences must be at most {STOP_MAX_CHARS} characters")


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
