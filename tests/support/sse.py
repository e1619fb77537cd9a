"""Moved to bench/support/sse.py (bench never imports tests); re-exported for the tests."""

from bench.support.sse import (  # noqa: F401
    SseEvent,
    SseParser,
    api_of_path,
    error_body_problem,
    is_content_event,
    is_done_event,
    is_error_event,
)
