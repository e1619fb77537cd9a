"""Chat request bodies for load and fault runs (both APIs), with prompts that span many blocks."""

from __future__ import annotations

from typing import Any

_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
          "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango")


def filler_text(seed: int, num_words: int) -> str:
    """Deterministic prose of ``num_words`` words, different for every ``seed``."""
    out = []
    x = seed * 2654435761 % (1 << 32) or 1
    for _ in range(num_words):
        x = (x * 1103515245 + 12345) % (1 << 31)
        out.append(_WORDS[x % len(_WORDS)])
    return " ".join(out)


def chat_body(api: str, text: str, *, max_tokens: int, stream: bool, model: str = "default",
              history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    messages = list(history or []) + [{"role": "user", "content": text}]
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": stream, "messages": messages}
    if api == "openai" and stream:
        body["stream_options"] = {"include_usage": True}
    return body


def path_of(api: str) -> str:
    return "/v1/messages" if api == "anthropic" else "/v1/chat/completions"
