"""Shared fixtures for the protocol tests: the real DeepSeek-V4 tokenizer, loaded once."""

from __future__ import annotations

import pytest

from protocol.api import Protocol
from protocol.detokenize import TokenTable
from protocol.ledger import OutputLedger
from protocol.tokenize import PromptTokenizer

MODEL = "deepseek-v4.1-flash"


@pytest.fixture(scope="session")
def tok() -> PromptTokenizer:
    return PromptTokenizer.load(cache_bytes=64 << 20)


@pytest.fixture(scope="session")
def table(tok: PromptTokenizer) -> TokenTable:
    """The tokenizer's id -> bytes table, built once (it walks the whole vocabulary)."""
    return TokenTable(tok.full)


@pytest.fixture()
def proto(tok: PromptTokenizer, table: TokenTable) -> Protocol:
    """A fresh protocol per test (its ledger, response store and caches), sharing the table."""
    return Protocol(tok, OutputLedger(key=b"k" * 32), [MODEL, "default"], 1_064_960, table=table)
