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
entry with its visible content, ``OutputLedger.screen``) is not a span boundary: a
conversation the ledger knows nothing of is tokenized in one call, as without a ledger.

Tokenizing span by span gives exactly the ids of one call: every span ends right after a
generation header (a control token), where the tokenizer starts a new piece anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from protocol.depth import check_json_text_depth
from protocol.ledger import OutputLedger
from protocol.render import AssistantSpan, Segment
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
                 end_think_id: int, eos_id: int) -> BoundPrompt:
    """The prompt ids of ``segments`` (at most ``limit``: else ``TokenBudgetExceeded`` with an
    estimate of the whole length), each span in ``spans`` replaced by its ledger ids where the
    ledger holds the turn under the binding of the ids before it."""
    hasher = ledger.prefix_hasher(scope) if ledger is not None else None
    parts: list[np.ndarray] = []
    num_ids = hits = 0
    divergences_before = ledger.stats.num_divergences if ledger is not None else 0
    pos = 0

    def encode_upto(end: int) -> None:
        nonlocal num_ids
        try:
            part = tokenizer.encode_segments(segments[pos:end], max_tokens=limit - num_ids)
        except TokenBudgetExceeded as exc:
            raise TokenBudgetExceeded(exc.num_tokens + num_ids, limit) from None
        if len(part):
            parts.append(part)
            num_ids += len(part)
            if hasher is not None:
                hasher.update(part.data)

    if ledger is not None and hasher is not None:
        for start, end, m, with_reasoning in spans:
            calls = [(c.name, _parse_args(c.arguments)) for c in m.tool_calls]
            possible, signature = ledger.screen(m.signature, m.text_parts, calls)
            if not possible:
                continue  # no entry could serve it: no need for the binding here
            encode_upto(start)
            pos = start
            entry = ledger.match(hasher.digest(), signature, m.reasoning, m.text_parts, calls, strict_parts)
            ids = entry.render_ids(with_reasoning, end_think_id, eos_id) if entry is not None else None
            if ids is None:
                continue  # the client's rendering stays, tokenized with the next span
            m.ledger_entry = entry
            hits += 1
            if num_ids + len(ids) > limit:
                raise TokenBudgetExceeded(num_ids + len(ids), limit)
            parts.append(ids)
            num_ids += len(ids)
            hasher.update(ids.data)
            pos = end
    encode_upto(len(segments))
    if not parts:
        ids_all = np.zeros(0, dtype=np.int32)
    elif len(parts) > 1:
        ids_all = np.concatenate(parts)
    else:  # the tokenizer's array is the caller's; ledger ids are the entry's own
        ids_all = parts[0] if hits == 0 else parts[0].copy()
    divergences = ledger.stats.num_divergences - divergences_before if ledger is not None else 0
    return BoundPrompt(ids_all, hasher.digest() if hasher is not None else b"", hits, max(0, divergences))
