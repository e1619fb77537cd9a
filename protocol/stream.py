"""ResponseStream: one request's token ids -> parser events -> SSE bytes, plus the ledger record.

Pipeline per ``feed``: detokenize (incremental, sentinels for control tokens) -> parse ->
stop-sequence check on content text -> emit (batched: one call produces all frames for the
ids given). Stop sequences apply to content text only (not reasoning, not tool arguments):
the matched text and everything after it is withheld and ``stop_hit`` is set, so the caller
aborts the engine request.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from protocol.api_types import PreparedRequest, TurnFinish
from protocol.detokenize import IncrementalDetokenizer, TokenTable
from protocol.emit_anthropic import STOP_REASONS, AnthropicEmitter, anthropic_body, anthropic_usage
from protocol.emit_openai import FINISH_REASONS, OpenAIEmitter, openai_body, openai_usage
from protocol.errors import error_from_exception
from protocol.ledger import LedgerEntry, OutputLedger
from protocol.parser import (
    REASONING,
    TEXT,
    TOOL,
    TOOL_ARGS,
    TOOL_START,
    Event,
    EventKind,
    ParsedCall,
    StreamParser,
)
from protocol.responses_emit import ResponsesEmitter, responses_usage


class StopMatcher:
    """Finds the first stop sequence in streamed text, holding back possible partial matches."""

    __slots__ = ("_max_hold", "_pending", "matched", "stops")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._pending = ""
        self.matched: str | None = None
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, text: str) -> str:
        """Text safe to emit now; sets ``matched`` when a stop sequence completes."""
        if self.matched is not None:
            return ""
        buf = self._pending + text
        best = -1
        for s in self.stops:
            k = buf.find(s)
            if k >= 0 and (best < 0 or k < best):
                best, self.matched = k, s
        if best >= 0:
            self._pending = ""
            return buf[:best]
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:n]):
                    hold = n
                    break
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold] if hold else buf

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


class ResponseStream:
    """See protocol.api for the contract. Not thread-safe."""

    def __init__(self, prepared: PreparedRequest, request_id: str, table: TokenTable,
                 ledger: OutputLedger | None) -> None:
        self.prepared = prepared
        self.request_id = request_id
        self.api = prepared.api
        self._table = table
        self._ledger = ledger
        self._detok = IncrementalDetokenizer(table)
        tools_enabled = bool(prepared.tool_names) and prepared.tool_choice != "none"
        self._parser = StreamParser(prepared.thinking, prepared.tool_params, tools_enabled)
        self._stops = StopMatcher(prepared.stop) if prepared.stop else None
        self.output_ids: list[int] = []
        self.stop_hit = False
        self._started = False
        self._finished = False
        self._reasoning: list[str] = []
        # (TEXT, [str, ...]) | (TOOL, ParsedCall), in order. A text block keeps its pieces, joined
        # when read (``_text_blocks``): re-concatenating it per delivery is quadratic in its length.
        self._blocks: list[tuple[EventKind, Any]] = []
        self._calls: list[ParsedCall] = []
        self._call_ids: list[str] = []
        self._finish_reason = TurnFinish.STOP
        self._usage: dict[str, Any] = {}
        self._entry_id = ledger.new_entry_id() if ledger is not None else os.urandom(16)
        self.signature = ledger.signature(self._entry_id) if ledger is not None else ""
        self.created = int(time.time())
        self._r: ResponsesEmitter | None = None
        self._a: AnthropicEmitter | None = None
        self._o: OpenAIEmitter | None = None
        if self.api == "anthropic":
            self.message_id = "msg_" + request_id
            self._a = AnthropicEmitter(self.message_id, prepared.model, self.signature,
                                       prepared.show_reasoning)
        elif self.api == "responses":  # the Responses API (protocol/responses_*.py)
            self.message_id = "resp_" + request_id
            assert prepared.responses is not None, "a Responses API request carries its options"
            self._r = ResponsesEmitter(self.message_id, prepared.model, prepared.responses,
                                       "rs_" + self._entry_id.hex(), self.signature, prepared.stream)
        else:
            self.message_id = "chatcmpl-" + request_id
            self._o = OpenAIEmitter(self.message_id, prepared.model, self.created)

    # --- streaming -------------------------------------------------------------------------------
    def start(self, num_cached_tokens: int = 0) -> bytes:
        if self._started:
            return b""
        self._started = True
        if not self.prepared.stream:
            return b""
        if self._a is not None:
            return self._a.start(self.prepared.num_prompt_tokens, num_cached_tokens)
        if self._r is not None:
            return self._r.start()
        return self._o.start()  # type: ignore[union-attr]

    def feed(self, token_ids: list[int]) -> bytes:
        head = b"" if self._started else self.start()
        if self._finished or self.stop_hit or not token_ids:
            return head
        self.output_ids.extend(token_ids)
        events = self._parser.feed(self._detok.feed(token_ids))
        return head + self._consume(events) if events else head

    def _consume(self, events: list[Event], apply_stops: bool = True) -> bytes:
        if self._stops is not None and apply_stops:
            events = self._apply_stops(events)
        for kind, payload in events:
            if kind == REASONING:
                self._reasoning.append(payload)
            elif kind == TEXT:
                if self._blocks and self._blocks[-1][0] == TEXT:
                    self._blocks[-1][1].append(payload)
                else:
                    self._blocks.append((TEXT, [payload]))
            elif kind == TOOL_START:
                prefix = "toolu_" if self.api == "anthropic" else "call_"
                self._call_ids.append(prefix + os.urandom(12).hex())
            elif kind == TOOL:
                self._calls.append(payload)
                self._blocks.append((TOOL, payload))
        if self._r is not None:  # builds its output items in both modes
            return self._r.emit(events, self._call_ids) if events else b""
        if not self.prepared.stream or not events:
            return b""
        if self._a is not None:
            return self._a.emit(events, self._call_ids)
        return self._o.emit(events, self._call_ids)  # type: ignore[union-attr]

    def _apply_stops(self, events: list[Event]) -> list[Event]:
        stops = self._stops
        assert stops is not None
        out: list[Event] = []
        for kind, payload in events:
            if kind != TEXT:
                pending = stops.flush()  # a partial match followed by a non-text event is no match
                if pending:
                    out.append((TEXT, pending))
                out.append((kind, payload))
                continue
            safe = stops.feed(payload)
            if safe:
                out.append((TEXT, safe))
            if stops.matched is not None:
                self.stop_hit = True
                break
        return out

    def finish(self, finish_reason: str, num_prompt_tokens: int, num_cached_tokens: int,
               num_output_tokens: int) -> bytes:
        if self._finished:
            return b""
        head = b"" if self._started else self.start(num_cached_tokens)
        self._finished = True
        body = b""
        if not self.stop_hit:
            tail_events = self._parser.feed(self._detok.flush()) + self._parser.finish()
            if tail_events:
                body = self._consume(self._merge(tail_events))
            if self._stops is not None and not self.stop_hit:
                pending = self._stops.flush()  # released at the end: no stop matched
                if pending:
                    body += self._consume([(TEXT, pending)], apply_stops=False)
        reason = self._reason(finish_reason)
        self._finish_reason = reason
        self._record(finish_reason)
        if self._r is not None:
            think = self._think_end() if self.prepared.thinking else 0
            usage_r = responses_usage(num_prompt_tokens, num_cached_tokens, num_output_tokens, max(0, think))
            self._usage = usage_r
            tail = self._r.finish(reason, usage_r)
            return head + body + tail if self.prepared.stream else head + body
        if self._a is not None:
            usage = anthropic_usage(num_prompt_tokens, num_cached_tokens, num_output_tokens)
            self._usage = usage
            stop_seq = self._stops.matched if self._stops is not None and self.stop_hit else None
            if not self.prepared.stream:
                return head + body
            return head + body + self._a.finish(STOP_REASONS[reason], stop_seq, usage)
        assert self._o is not None  # one emitter per api, built in __init__
        usage_o = openai_usage(num_prompt_tokens, num_cached_tokens, num_output_tokens)
        self._usage = usage_o
        if not self.prepared.stream:
            return head + body
        tail = self._o.finish(FINISH_REASONS[reason], usage_o if self.prepared.include_usage else None)
        return head + body + tail

    @staticmethod
    def _merge(events: list[Event]) -> list[Event]:
        out: list[Event] = []
        for kind, payload in events:
            if out and kind in (REASONING, TEXT, TOOL_ARGS) and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + payload)
            else:
                out.append((kind, payload))
        return out

    @property
    def finish_reason(self) -> TurnFinish:
        """How the response ended (``STOP`` until ``finish`` decided it)."""
        return self._finish_reason

    def _reason(self, engine_reason: str) -> TurnFinish:
        if self.stop_hit:
            return TurnFinish.STOP_SEQUENCE
        if engine_reason == "length":
            return TurnFinish.LENGTH  # cut: said so even when complete calls came before the cut
        if self._calls:
            return TurnFinish.TOOL_CALLS
        return TurnFinish.STOP

    def _record(self, engine_reason: str) -> None:
        if (self._ledger is None or self.stop_hit or engine_reason not in ("stop", "length")
                or not self.output_ids or not self.prepared.ledger_binding):
            return
        opts = self.prepared.responses
        # a Responses reply with store: false never reaches the disk (memory only, see docs/responses.md)
        persist = opts is None or opts.store is not None
        ids = np.asarray(self.output_ids, dtype=np.int32)
        think_end = self._think_end() if self.prepared.thinking else -1
        entry = LedgerEntry(
            entry_id=self._entry_id,
            output_ids=ids,
            thinking=self.prepared.thinking,
            think_end=think_end,
            reasoning=self._reasoning_view() or "",
            text_parts=tuple(p for k, p in self._text_blocks() if k == TEXT),
            calls=tuple((c.name, c.arguments) for c in self._calls),
            binding=self.prepared.ledger_binding,
            persist=persist,
        )
        self._ledger.record(entry)

    def _think_end(self) -> int:
        """Index of the first ``</think>`` in the output (= reasoning tokens), -1 if none."""
        hits = np.flatnonzero(np.asarray(self.output_ids, dtype=np.int32) == self._table.end_think_id)
        return int(hits[0]) if len(hits) else -1

    def _reasoning_view(self) -> str | None:
        """The thinking text the client was sent; None when it got no thinking block."""
        reasoning = "".join(self._reasoning)
        if not reasoning:
            return None
        return reasoning if self.prepared.show_reasoning else ""

    def error(self, exc: BaseException) -> bytes:
        err = error_from_exception(exc)
        self._finished = True
        if self._r is not None:
            return self._r.failed(err.code or err.openai_type, err.message)
        return err.sse(self.api)

    # --- non-streaming ------------------------------------------------------------------------------
    def response_body(self) -> dict[str, Any]:
        reason = self._finish_reason
        if self._r is not None:
            return self._r.body
        if self._a is not None:
            stop_seq = self._stops.matched if self._stops is not None and self.stop_hit else None
            return anthropic_body(
                self.message_id,
                self.prepared.model,
                self._reasoning_view(),
                self.signature,
                self._text_blocks(),
                self._call_ids,
                STOP_REASONS[reason],
                stop_seq,
                self._usage,
            )
        text = self.text
        return openai_body(
            self.message_id,
            self.prepared.model,
            self.created,
            "".join(self._reasoning),
            text,
            self._calls,
            self._call_ids,
            FINISH_REASONS[reason],
            self._usage,
        )

    @property
    def text(self) -> str:
        return "".join(piece for k, p in self._blocks if k == TEXT for piece in p)

    def _text_blocks(self) -> list[Event]:
        """The blocks with each text block joined: (TEXT, str) | (TOOL, ParsedCall), in order."""
        return [(k, "".join(p) if k == TEXT else p) for k, p in self._blocks]

    @property
    def calls(self) -> list[ParsedCall]:
        return list(self._calls)
