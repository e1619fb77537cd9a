"""Incremental detokenizer: token ids -> text, never splitting a UTF-8 character.

Control tokens the parser acts on (``<think>``, ``</think>``, ``｜DSML｜``, EOS) decode to
sentinel characters from the Unicode noncharacter block U+FDD0..U+FDD3, so a tag is a tag only
when the model emitted the control *token*; the same characters spelled with ordinary BPE pieces
(or byte pieces) stay text. A noncharacter that the model itself spells in text is replaced by
U+FFFD so it cannot pose as a sentinel. Other special tokens (BOS, pad, placeholders) decode to
nothing; other added tokens decode to their text.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable

S_THINK = "\ufdd0"
S_END_THINK = "\ufdd1"
S_DSML = "\ufdd2"
S_EOS = "\ufdd3"
SENTINEL_TEXT = {S_THINK: "<think>", S_END_THINK: "</think>", S_DSML: "｜DSML｜", S_EOS: ""}
_NONCHAR_RE = re.compile("[\ufdd0-\ufdef]")


def _byte_level_table() -> dict[str, int]:
    """GPT-2 byte-level alphabet: printable char -> byte value."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


class TokenTable:
    """Per-id bytes (or sentinel) built once per tokenizer."""

    def __init__(self, tokenizer: object) -> None:
        from tokenizers import Tokenizer

        assert isinstance(tokenizer, Tokenizer)
        byte_of = _byte_level_table()
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        added = tokenizer.get_added_tokens_decoder()  # id -> AddedToken
        table: list[bytes] = [b""] * size
        for tok_str, tid in tokenizer.get_vocab(with_added_tokens=False).items():
            try:
                table[tid] = bytes(byte_of[c] for c in tok_str)
            except KeyError:
                table[tid] = tok_str.encode("utf-8")
        self.sentinel: dict[int, str] = {}
        by_content = {}
        for tid, at in added.items():
            by_content[at.content] = tid
            table[tid] = b"" if at.special else at.content.encode("utf-8")
        for text, sentinel in (("<think>", S_THINK), ("</think>", S_END_THINK), ("｜DSML｜", S_DSML),
                               ("<｜end▁of▁sentence｜>", S_EOS)):
            tid = by_content.get(text)
            if tid is not None:
                self.sentinel[tid] = sentinel
        self.bytes_of = table
        self.size = size
        self.eos_id = by_content.get("<｜end▁of▁sentence｜>", -1)
        self.think_id = by_content.get("<think>", -1)
        self.end_think_id = by_content.get("</think>", -1)
        self.dsml_id = by_content.get("｜DSML｜", -1)


class IncrementalDetokenizer:
    """Feed ids, get text (with sentinels). Holds incomplete UTF-8 sequences across feeds."""

    __slots__ = ("_table", "_sentinel", "_decoder", "_size", "_plain")

    def __init__(self, table: TokenTable) -> None:
        self._table = table.bytes_of
        self._sentinel = table.sentinel
        self._size = table.size
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._plain = self._sentinel.keys().isdisjoint  # True: no control token among the ids

    def feed(self, ids: Iterable[int]) -> str:
        if isinstance(ids, list) and ids and self._plain(ids) and min(ids) >= 0 and max(ids) < self._size:
            # The common batch (ordinary tokens only): one pass in C instead of one Python
            # iteration per id. Same result as the loop below.
            return self._decode(b"".join(map(self._table.__getitem__, ids)), final=False)
        table = self._table
        sentinel = self._sentinel
        size = self._size
        out: list[str] = []
        buf: list[bytes] = []
        for tid in ids:
            s = sentinel.get(tid)
            if s is None:
                if 0 <= tid < size:
                    buf.append(table[tid])
                continue
            if buf:
                out.append(self._decode(b"".join(buf), final=True))
                buf = []
            else:
                tail = self._decoder.decode(b"", final=True)
                if tail:
                    out.append(tail)
            out.append(s)
        if buf:
            out.append(self._decode(b"".join(buf), final=False))
        return "".join(out) if len(out) != 1 else out[0]

    def _decode(self, data: bytes, final: bool) -> str:
        text = self._decoder.decode(data, final)
        if final:
            self._decoder.reset()
        if _NONCHAR_RE.search(text) is not None:
            text = _NONCHAR_RE.sub("\ufffd", text)
        return text

    def flush(self) -> str:
        """Whatever is held at the end (an incomplete character becomes U+FFFD)."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text
