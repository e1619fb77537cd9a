"""Rendered segments -> prompt ids, with the output ledger consulted turn by turn under a binding.

An assistant turn may be replaced by the exact ids the model generated for it (the output
ledger) only inside the conversation that produced it: the ledger entry must have been made from
exactly the prompt ids in front of the turn, under the same caller scope (``protocol/ledger.py``).
So the ids are produced in order: tokenize up to an assistant turn, take the binding of
everything so far, ask the ledger, splice its ids or keep the client's rendering, go on. The
binding is one streaming xxh3-128 over the prompt's int32 ids, fed once per span: the whole
prompt is hashed once (tens of microseconds for 100K tokens), and no second walk over the
conversation is made. The last digest, over the whole prompt, is what the reply's own ledger
entry records.

A turn no entry could serve (the ledger holds neither the entry its signature names nor any
entry with its visible content, ``OutputLedger.screen``) is not matched: no binding is taken.

The prompt is cut into chunks right after the generation header of every assistant turn, and
right after the EOS of every turn the ledger replaces (both control tokens, where the tokenizer
starts a new piece anyway), so the ids of the chunks joined are exactly the ids of one call.
Each chunk rendered from client text is compared with the chunk at the same place of the
session's earlier prompt (``ChunkCache``, ``protocol/prompt_chunks.py``) and its ids reused
when equal: a turn of a long session tokenizes only its new part, and the history costs a
compare of its text. The ledger is asked about every turn anew; only tokenizer output is reused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from protocol.depth import check_json_text_depth
from protocol.ledger import OutputLedger
from protocol.prompt_chunks import ChunkCache
from protocol.render import IDS, AssistantSpan, Segment
from protocol.tokenize import PromptTokenizer, TokenBudgetExceeded


@dataclass(slots=True)
class BoundPrompt:
    ids: np.ndarray
    binding: bytes  # of the whole prompt: the reply's ledger entry is bound to it
    num_hits: int  # assistant turns whose ids came from the ledger
    num_divergences: int  # turns whose entry was found but whose client view differed


def _parse_args(arguments: Any) -> Any:
    if isinstance(arguments, str):
        check_json_text_depth(arguments, "arguments")
        try:
            return orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments
    return arguments


def encode_bound(tokenizer: PromptTokenizer, ledger: OutputLedger | None, segments: list[Segment],
                 spans: Sequence[AssistantSpan], scope: bytes, limit: int, strict_parts: bool,
                 end_think_id: int, eos_id: int, chunks: ChunkCache | None = None) -> BoundPrompt:
    """The prompt ids of ``segments`` (at most ``limit``: else ``TokenBudgetExceeded`` with an
    estimate of the whole length), each span in ``spans`` replaced by its ledger ids where the
    ledger holds the turn under the binding of the ids before it. ``chunks``: the ids of the
    chunks between spans, and of spans rendered from the client's view, by their segments
    (``protocol/prompt_chunks.py``)."""
    hasher = ledger.prefix_hasher(scope) if ledger is not None else None
    parts: list[np.ndarray] = []
    num_ids = num_chars = hits = 0
    divergences_before = ledger.stats.num_divergences if ledger is not None else 0
    refusal_checked = False  # the cheap refusal bound ran over the rest of the prompt

    head_end = spans[0][0] if spans else len(segments)
    view = chunks.view(segments, head_end, scope) if chunks is not None else None

    def encode_chunk(start: int, end: int) -> None:
        nonlocal num_ids, num_chars, refusal_checked
        if start >= end:
            return
        found = view.get(segments, start, end) if view is not None else None
        if found is not None:
            part, part_chars = found.ids, found.num_chars
            if num_ids + len(part) > limit:
                raise _over_budget(segments, end, num_ids + len(part), num_chars + part_chars, limit)
        else:
            if not refusal_checked:  # once, at the first chunk not reused: the new part on
                refusal_checked = True
                _refuse_rest(tokenizer, segments, spans, start, num_ids, limit)
            chunk = segments[start:end]
            try:
                part = tokenizer.encode_segments(chunk, max_tokens=limit - num_ids)
            except TokenBudgetExceeded as exc:
                raise TokenBudgetExceeded(exc.num_tokens + num_ids, limit) from None
            part_chars = sum(len(p) for kind, p in chunk if kind != IDS)
            if view is not None:
                view.put(segments, start, end, part, part_chars)
        if len(part):
            parts.append(part)
            num_ids += len(part)
            num_chars += part_chars
            if hasher is not None:
                hasher.update(part.data)

    complete = False
    try:
        pos = 0
        for start, end, m, with_reasoning in spans:
            encode_chunk(pos, start)
            pos = start
            if ledger is not None and hasher is not None:
                calls = [(c.name, _parse_args(c.arguments)) for c in m.tool_calls]
                possible, signature = ledger.screen(m.signature, m.text_parts, calls)
                entry = ledger.match(hasher.digest(), signature, m.reasoning, m.text_parts, calls,
                                     strict_parts) if possible else None
                ids = entry.render_ids(with_reasoning, end_think_id, eos_id) if entry is not None else None
                if entry is not None and ids is not None:
                    hits += 1
                    if num_ids + len(ids) > limit:
                        raise TokenBudgetExceeded(num_ids + len(ids), limit)
                    parts.append(ids)
                    num_ids += len(ids)
                    hasher.update(ids.data)
                    pos = end
                    continue
            # the client's rendering of the turn stays: tokenized with the chunk after it
        encode_chunk(pos, len(segments))
        complete = True
    finally:
        if view is not None:
            view.finish(keep=complete)
    # a new array: chunk ids are the cache's, ledger ids the entry's
    ids_all = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    divergences = ledger.stats.num_divergences - divergences_before if ledger is not None else 0
    return BoundPrompt(ids_all, hasher.digest() if hasher is not None else b"", hits, max(0, divergences))


def _refuse_rest(tokenizer: PromptTokenizer, segments: list[Segment], spans: Sequence[AssistantSpan],
                 start: int, num_ids: int, limit: int) -> None:
    """The tokenizer's cheap refusal over the segments from ``start`` on (``num_ids`` ids before
    them), the assistant turns left out: the ledger may stand in for those with fewer ids than
    their client text has runs, and a bound must stay below the prompt's length whatever the
    ledger does (each chunk's own encoding bounds a turn's text by the budget anyway)."""
    rest: list[Segment] = []
    pos = start
    for span_start, span_end, _, _ in spans:
        if span_end <= pos:
            continue
        rest.extend(segments[pos:span_start])
        pos = span_end
    rest.extend(segments[pos:])
    try:
        tokenizer.refuse_if_surely_over(rest, limit - num_ids)
    except TokenBudgetExceeded as exc:
        raise TokenBudgetExceeded(exc.num_tokens + num_ids, limit) from None


def _over_budget(segments: list[Segment], end: int, num_ids: int, num_chars: int,
                 limit: int) -> TokenBudgetExceeded:
    """``num_ids`` (over ``limit``) ids from ``num_chars`` characters so far: the error, with the
    text after ``end`` estimated at the same ratio."""
    rest = sum(len(p) for kind, p in segments[end:] if kind != IDS)
    estimate = num_ids + (rest * num_ids // num_chars if num_chars else 0)
    return TokenBudgetExceeded(max(estimate, limit + 1), limit)
