"""Moved to bench/support/runtime_thread.py (bench never imports tests); re-exported for the tests."""

from bench.support.runtime_thread import RuntimeThread, cache_sizes, settle  # noqa: F401
