"""Shared fixtures for the protocol tests: the real DeepSeek-V4 tokenizer, loaded once."""

from __future__ import annotations

import pytest

from protocol.api import Protocol
from protocol.ledger import OutputLedger
from protocol.tokenize import PromptTokenizer

MODEL = "deepseek-v4.1-flash"


@pytest.fixture(scope="session")
def tok() -> PromptTokenizer:
    return PromptTokenizer.load(cache_bytes=64 << 20)


@pytest.fixture()
def proto(tok: PromptTokenizer) -> Protocol:
    return Protocol(tok, OutputLedger(key=b"k" * 32), [MODEL, "default"], 1_064_960)
