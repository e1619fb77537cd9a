"""Boundary side: sampling values a client may send either become values every
engine runs (``protocol/sampling.py``) or a 400 naming the field; never a sampler failure."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from protocol import sampling as S
from protocol.api import Protocol
from protocol.errors import InvalidRequest
from rank.engine import SamplingParams
from rank.sampler import make_generator, sample

MODEL = "deepseek-v4.1-flash"
MSG = [{"role": "user", "content": "hi"}]


def _openai(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MSG, **extra}


def _anthropic(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 64, "messages": MSG, **extra}


def _run_reference_sampler(temperature: float, top_p: float, top_k: int, seed: int | None) -> int:
    """One token from the reference engine's sampler over peaked logits (one token holds ~all mass)."""
    logits = torch.full((1, 1000), -30.0)
    logits[0, 7] = 30.0
    params = SamplingParams(max_tokens=8, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    gen = None if params.is_greedy else make_generator(seed or 0, torch.device("cpu"))
    return sample(logits, [params], [gen])[0]


finite = st.floats(allow_nan=False, allow_infinity=False)
wire_sampling = st.fixed_dictionaries({}, optional={
    "temperature": st.one_of(st.just(0.0), st.floats(0.0, S.TEMPERATURE_MAX), st.floats(0.0, 1e-4),
                             st.just(5e-324)),
    "top_p": st.one_of(st.just(0.0), st.just(1e-50), st.floats(0.0, 1.0), st.floats(0.0, 1e-5)),
    "top_k": st.one_of(st.integers(-1, 3), st.integers(-1, 200_000), st.just(2**31 - 1)),
    "seed": st.one_of(st.integers(S.SEED_WIRE_MIN, S.SEED_WIRE_MAX),
                      st.sampled_from([-5, 2**64 - 1, -(2**63)])),
})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=wire_sampling)
def test_every_accepted_openai_sampling_runs_in_the_sampler(proto: Protocol, values: dict[str, Any]) -> None:
    """Red before protocol/sampling.py: top_p 1e-50 reached torch.multinomial with nothing left to
    draw from (RuntimeError in the rank), top_k 2**31-1 and negative seeds passed unchecked."""
    prepared = proto.prepare_openai(_openai(**values))
    assert S.sampling_error(prepared.max_tokens, prepared.temperature, prepared.top_p, prepared.top_k,
                            prepared.seed, proto.table.size) is None
    assert _run_reference_sampler(prepared.temperature, prepared.top_p, prepared.top_k, prepared.seed) == 7


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=wire_sampling)
def test_every_accepted_anthropic_sampling_runs_in_the_sampler(proto: Protocol,
                                                               values: dict[str, Any]) -> None:
    values.pop("seed", None)  # not an Anthropic field
    if values.get("top_k", 0) < 0:
        values["top_k"] = 0
    prepared = proto.prepare_anthropic(_anthropic(**values))
    assert S.sampling_error(prepared.max_tokens, prepared.temperature, prepared.top_p, prepared.top_k,
                            prepared.seed, proto.table.size) is None
    assert _run_reference_sampler(prepared.temperature, prepared.top_p, prepared.top_k, prepared.seed) == 7


def test_tiny_values_mean_greedy_and_big_ones_no_filter(proto: Protocol) -> None:
    for extra in ({"top_p": 1e-50}, {"top_p": 0}, {"temperature": 1e-300}, {"temperature": 0}):
        p = proto.prepare_openai(_openai(**extra))
        assert (p.temperature, p.top_p, p.top_k) == (0.0, 1.0, -1), extra
    p = proto.prepare_openai(_openai(temperature=0.7, top_p=0.9, top_k=2**31 - 1, seed=-5))
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (0.7, 0.9, -1, 2**64 - 5)
    p = proto.prepare_anthropic(_anthropic(temperature=0.7, top_k=40))
    assert (p.temperature, p.top_k, p.seed) == (0.7, 40, None)


@pytest.mark.parametrize("extra, param", [
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -1e-9}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 5}, "top_logprobs"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop": "y" * (S.STOP_MAX_CHARS + 1)}, "stop"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_openai_out_of_range_is_a_400_naming_the_field(proto: Protocol, extra: dict[str, Any],
                                                       param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        proto.prepare_openai(_openai(**extra))
    assert err.value.param == param
    assert err.value.http_status == 400


@pytest.mark.parametrize("extra, param", [
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"stop_sequences": ["s"] * 65}, "stop_sequences"),
    ({"stop_sequences": ["z" * (S.STOP_MAX_CHARS + 1)]}, "stop_sequences"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_anthropic_out_of_range_is_a_400_naming_the_field(proto: Protocol, extra: dict[str, Any],
                                                          param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        proto.prepare_anthropic(_anthropic(**extra))
    assert err.value.param is not None and err.value.param.startswith(param)


@pytest.mark.parametrize("args, fragment", [
    ((0, 1.0, 1.0, -1, None), "max_tokens"),
    ((8, 1e-7, 1.0, -1, None), "temperature"),
    ((8, float("nan"), 1.0, -1, None), "temperature"),
    ((8, 2.01, 1.0, -1, None), "temperature"),
    ((8, 1.0, 0.0, -1, None), "top_p"),
    ((8, 1.0, 1e-50, -1, None), "top_p"),
    ((8, 1.0, 1.0, 0, None), "top_k"),
    ((8, 1.0, 1.0, 1000, None), "top_k"),
    ((8, 1.0, 1.0, -1, -5), "seed"),
    ((8, 1.0, 1.0, -1, 2**64), "seed"),
    ((8, True, 1.0, -1, None), "temperature"),
])
def test_sampling_error_names_what_an_engine_cannot_run(args: tuple[Any, ...], fragment: str) -> None:
    reason = S.sampling_error(*args, vocab_size=1000)
    assert reason is not None and reason.startswith(fragment)
    assert S.sampling_error(8, 0.0, 1.0, -1, None, 1000) is None
    assert S.sampling_error(8, 1e-5, 1e-6, 999, 2**64 - 1, 1000) is None
