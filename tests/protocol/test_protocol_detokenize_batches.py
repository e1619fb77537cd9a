"""The detokenizer's batch path (a list of ordinary ids, decoded in one pass) gives exactly what its
id-by-id loop gives, for any ids (control tokens, byte pieces, out of range) and any split."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from protocol.detokenize import IncrementalDetokenizer, TokenTable
from protocol.tokenize import PromptTokenizer


@pytest.fixture(scope="module")
def ids_strategy(tok: PromptTokenizer, table: TokenTable) -> st.SearchStrategy[list[int]]:
    """Any id (negative, out of range), control tokens, and text with multi-byte characters."""
    text = [int(x) for x in tok.encode_plain("héllo wörld 你好世界 🙂🚀 def f(x): return x")]
    return st.lists(st.one_of(st.integers(-3, table.size + 3), st.sampled_from(sorted(table.sentinel)),
                              st.sampled_from(text)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_batches_decode_like_the_loop(table: TokenTable, ids_strategy: st.SearchStrategy[list[int]],
                                      data: st.DataObject) -> None:
    ids = data.draw(ids_strategy)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=8)))
    fast, slow = IncrementalDetokenizer(table), IncrementalDetokenizer(table)
    got, want = [], []
    start = 0
    for end in [*cuts, len(ids)]:
        got.append(fast.feed(list(ids[start:end])))  # a list: the batch path when it applies
        want.append(slow.feed(iter(ids[start:end])))  # an iterator: always the loop
        start = end
    got.append(fast.flush())
    want.append(slow.flush())
    assert got == want
