"""Tokenizer side: long pieces are encoded in exact chunks, the cheap lower bound
on the token count is a lower bound, and an over-long prompt is refused without encoding it all.

All on the real DeepSeek-V4 tokenizer. Work is measured in characters handed to the BPE encoder
(a counting proxy around the tokenizer), never in seconds.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import protocol.tokenize as T
from protocol.api import Protocol
from protocol.errors import PromptTooLong
from protocol.ledger import OutputLedger
from protocol.render import CLIENT, OURS
from protocol.tokenize import PromptTokenizer, min_tokens

MODEL = "deepseek-v4.1-flash"
# characters the pre-tokenizer treats specially: newlines, odd whitespace, marks, CJK, digits
ALPHABET = list("abcXYZ 019\n\n\t  .,;:!?()[]{}#\"'-_=+*/\\<>|&^%$@~`") + [
    "中", "文", "ア", "é", "\u0301", "\r\n", "  \n", "\u3000", "😀", "\x1c", "\x00", "\u2028", "\u0085",
    "\xa0", "\x0b", "\x0c", " the", " a", "def ", "\n    ", "Bar"]
texts = st.lists(st.sampled_from(ALPHABET), min_size=0, max_size=1500).map("".join)


class CountingEncoder:
    """Wraps a ``tokenizers.Tokenizer``: counts the characters it is asked to encode."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.num_chars = 0

    def encode(self, text: str, **kw: Any) -> Any:
        self.num_chars += len(text)
        return self.inner.encode(text, **kw)

    def encode_batch(self, texts: list[str], **kw: Any) -> Any:
        self.num_chars += sum(len(t) for t in texts)
        return self.inner.encode_batch(texts, **kw)

    def encode_batch_fast(self, texts: list[str], **kw: Any) -> Any:
        self.num_chars += sum(len(t) for t in texts)
        return self.inner.encode_batch_fast(texts, **kw)


def code_text(seed: int, num_chars: int) -> str:
    rng = random.Random(seed)
    words = ["def", "return", "self", "value", "import", "(", ")", ":", "=", "+", "42", "result"]
    lines, n = [], 0
    while n < num_chars:
        line = "    " * rng.randint(0, 3) + " ".join(rng.choice(words) for _ in range(rng.randint(3, 10)))
        lines.append(line)
        n += len(line) + 1
    return "\n".join(lines)


def dense_text(seed: int, num_chars: int) -> str:
    """Minified-JSON-like, no whitespace at all: the lower bound says ~nothing about it."""
    rng = random.Random(seed)
    out, n = [], 0
    while n < num_chars:
        part = f'"{rng.randint(0, 10**6):x}":[{rng.randint(0, 99999)},"k{rng.randint(0, 999)}"],'
        out.append(part)
        n += len(part)
    return "".join(out)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts)
def test_chunked_encoding_equals_the_single_call(tok: PromptTokenizer, text: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(T, "_CHUNK_CHARS", 64)  # a cut every 32-64 characters
    single = np.asarray(tok.plain.encode(text, add_special_tokens=False).ids, dtype=np.int32)
    assert np.array_equal(tok.encode_plain(text), single)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts)
def test_min_tokens_is_a_lower_bound(tok: PromptTokenizer, text: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(T, "_COUNT_CHARS", 7)  # slices that cut through runs
    bound = min_tokens(text)
    assert bound <= len(tok.encode_plain(text))
    assert bound == len(text.encode("utf-8", "surrogatepass").split())


def test_budget_stops_encoding_early_and_estimates_the_length(tok: PromptTokenizer) -> None:
    """Red before: encode_segments had no budget; the whole text was encoded, then compared."""
    for text in (code_text(1, 1_500_000), dense_text(2, 1_500_000)):
        counting = PromptTokenizer(tok.path, cache_bytes=0)
        counting.plain = CountingEncoder(counting.plain)  # type: ignore[assignment]
        segments = [(OURS, "<｜begin▁of▁sentence｜><｜User｜>"), (CLIENT, text), (OURS, "<｜Assistant｜>")]
        with pytest.raises(T.TokenBudgetExceeded) as err:
            counting.encode_segments(segments, max_tokens=20_000)
        true_count = len(tok.encode_plain(text))
        assert counting.plain.num_chars < len(text) // 5, "encoded most of the text before refusing"
        assert 20_000 < err.value.num_tokens and 0.5 < err.value.num_tokens / true_count < 2.0


def test_prompt_that_fits_is_encoded_whole_and_exactly(tok: PromptTokenizer) -> None:
    text = code_text(3, 400_000)  # several chunks
    segments = [(OURS, "<｜begin▁of▁sentence｜><｜User｜>"), (CLIENT, text), (OURS, "<｜Assistant｜>")]
    fresh = PromptTokenizer(tok.path, cache_bytes=0)
    ids = fresh.encode_segments(segments, max_tokens=10**7)
    assert np.array_equal(ids,
                          tok.encode_text("<｜begin▁of▁sentence｜><｜User｜>" + text + "<｜Assistant｜>"))
    with pytest.raises(T.TokenBudgetExceeded):
        fresh.encode_segments(segments, max_tokens=len(ids) - 1)
    assert np.array_equal(fresh.encode_segments(segments, max_tokens=len(ids)), ids)


@pytest.mark.parametrize("route", ["prepare_anthropic", "count_tokens_anthropic", "prepare_openai"])
def test_every_route_refuses_an_over_long_body_cheaply(tok: PromptTokenizer, route: str) -> None:
    proto = Protocol(PromptTokenizer(tok.path, cache_bytes=0), OutputLedger(key=b"k" * 32), [MODEL], 30_000)
    proto.tokenizer.plain = CountingEncoder(proto.tokenizer.plain)  # type: ignore[assignment]
    text = code_text(4, 2_000_000)
    if route == "prepare_openai":
        body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": text}]}]}
        if route == "prepare_anthropic":
            body["max_tokens"] = 100
    with pytest.raises(PromptTooLong) as err:
        getattr(proto, route)(body)
    assert err.value.max_prompt_tokens == 29_999 and err.value.num_prompt_tokens > 29_999
    assert proto.tokenizer.plain.num_chars <= 1 << 15  # the lower bound's sample, nothing more
