"""Moved to bench/support/bodies.py (bench never imports tests); re-exported for the tests."""

from bench.support.bodies import chat_body, filler_text, path_of  # noqa: F401
