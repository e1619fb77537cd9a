"""The disconnect storm (``python -m bench.reliability.storm``); its runtime thread, SSE parser and
request bodies live in ``tests/support`` (shared with the tests)."""
