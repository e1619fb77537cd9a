"""``ChatService``: one chat request end to end, from a prepared prompt to SSE bytes.

    prepared request -> CacheManager.turn -> SubmitGate.hold (server/scheduling.py: the order
      admitted turns reach each rank's engine queue) -> RankClient.submit(EngineRequest with
      prefix blocks) -> RequestOutputs -> ResponseStream.feed -> write(SSE bytes) -> finish

Invariants (what the tests check):

* Every admitted turn is settled exactly once: ``turn.finish`` when the engine finished the
  request normally (its kept blocks are indexed for the next turn), an abort on every other path
  (stop sequence, engine error, rank failure, timeout, client disconnect). ``async with
  cache.turn(...)`` guarantees it; the ``finally`` in ``_generate`` hands a turn whose engine
  stream is still running to a background drain (``_close_turn``) instead.
* An engine request that is still running when we stop listening (stop sequence, disconnect,
  timeout, error) is aborted in the engine.
* Before the first byte is written, errors propagate as ``ProtocolError`` (the app answers with
  an HTTP error in the caller's shape); after it, they are written as the stream's own error
  event and the stream ends cleanly.

Hot path: per engine step, one wake-up per request; every output already buffered for the
request is taken at once (``drain_nowait``) and fed as one batch, so a stream that fell behind
catches up with one ``feed`` and one write, not one per token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from cache.sessions import SessionHint, StopKind
from cache.turns import Turn
from protocol.api_types import ApiName, TurnFinish
from protocol.errors import (
    InternalError,
    Overloaded,
    ProtocolError,
    RequestTimeout,
    error_from_exception,
    with_request_id,
)
from rank.client import GroupState, RequestStream
from rank.engine import EngineMisuse, FinishReason, RequestOutput, SamplingParams
from rank.errors import RankFailed, RankUnavailable
from server.agent_hints import with_body_class
from server.config import WorkloadConfig
from server.metrics import ServerMetrics
from server.scheduling import SubmitGate

if TYPE_CHECKING:
    from cache.manager import CacheManager
    from cache.turns import AdmissionView
    from protocol.api import Protocol
    from protocol.api_types import PreparedRequest
    from protocol.stream import ResponseStream
    from rank.client import RankClient
    from server.symptoms import RuntimeSymptoms

log = logging.getLogger("deepinfer.service")

Write = Callable[[bytes], Awaitable[None]]

RESTART_RETRY_AFTER_S = 10.0
_NORMAL_FINISH = (FinishReason.STOP, FinishReason.LENGTH)


class _Flight:
    """Per-request bookkeeping shared by the generate loop and its error paths."""

    __slots__ = (
        "api",
        "arrival_s",
        "finish_reason",
        "first_token_s",
        "last_write_s",
        "num_cached_tokens",
        "num_output_tokens",
        "num_prompt_tokens",
        "rank",
        "request_id",
        "session",
        "started",
    )

    def __init__(self, request_id: str, api: ApiName, arrival_s: float) -> None:
        self.request_id = request_id
        self.api = api
        self.arrival_s = arrival_s
        self.started = False  # bytes were written to the client
        self.first_token_s = 0.0
        self.last_write_s = 0.0
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.rank = -1  # the rank it ran on (-1: never admitted)
        self.session = ""  # the cache's session (routing unit) id
        self.finish_reason = "error"


class ChatService:
    def __init__(self, protocol: Protocol, cache: CacheManager, client: RankClient, metrics: ServerMetrics,
                 config: WorkloadConfig, symptoms: RuntimeSymptoms | None = None) -> None:
        self._protocol = protocol
        self._symptoms = symptoms  # server.symptoms.RuntimeSymptoms (optional)
        self._cache = cache
        self._client = client
        self._metrics = metrics
        self._timeout_s = config.request_timeout_secs
        self._keep_blocks = config.prefix_cache
        self._salt_per_caller = config.prefix_cache_per_caller
        # Between admission and submit: which admitted turn reaches the engine's queue when.
        self._gate = SubmitGate(config.scheduling_config(), clock=time.perf_counter)
        self._late: set[asyncio.Task[None]] = set()  # admissions waiting for an aborted request's end

    # -- public API --------------------------------------------------------------------------------
    async def stream(self, prepared: PreparedRequest, request_id: str, write: Write,
                     arrival_s: float, hint: SessionHint | None = None) -> None:
        """Stream one request as SSE through ``write``. Raises ProtocolError only before the
        first write; afterwards every failure becomes the stream's own error event."""
        flight = _Flight(request_id, prepared.api, arrival_s)
        flight.num_prompt_tokens = prepared.num_prompt_tokens
        rs = self._protocol.new_stream(prepared, request_id)
        self._metrics.in_flight.inc()
        try:
            await self._bounded(self._generate(prepared, rs, flight, write, hint))
        except asyncio.CancelledError:
            flight.finish_reason = "cancelled"  # the client went away; _generate cleaned up
            raise
        except Exception as exc:  # noqa: BLE001 - surfaced in the caller's format below
            perr = self._as_protocol_error(exc, flight)
            if not flight.started:
                raise perr from None
            await write(rs.error(with_request_id(perr, request_id)))
        finally:
            self._record(flight)

    async def complete(self, prepared: PreparedRequest, request_id: str, arrival_s: float,
                       hint: SessionHint | None = None) -> dict[str, Any]:
        """Run one request to the end and return the non-streaming response body."""
        flight = _Flight(request_id, prepared.api, arrival_s)
        flight.num_prompt_tokens = prepared.num_prompt_tokens
        rs = self._protocol.new_stream(prepared, request_id)
        self._metrics.in_flight.inc()
        try:
            await self._bounded(self._generate(prepared, rs, flight, None, hint))
        except asyncio.CancelledError:
            flight.finish_reason = "cancelled"
            raise
        except Exception as exc:  # noqa: BLE001
            raise self._as_protocol_error(exc, flight) from None
        finally:
            self._record(flight)
        return rs.response_body()

    def prefetch(self, session_hint: SessionHint | str | None) -> None:
        """Start an L1 restore for a known session before its prompt is tokenized."""
        if session_hint:
            self._cache.prefetch(session_hint)

    # -- the request ---------------------------------------------------------------------------------
    async def _bounded(self, coro: Awaitable[None]) -> None:
        try:
            await asyncio.wait_for(coro, self._timeout_s)
        except asyncio.TimeoutError:
            self._metrics.timeouts.inc()
            raise RequestTimeout(
                f"request exceeded request_timeout_secs ({self._timeout_s:g} s)"
            ) from None

    async def _generate(self, prepared: PreparedRequest, rs: ResponseStream, flight: _Flight,
                        write: Write | None, hint: SessionHint | None) -> None:
        client = self._client
        if client.state is not GroupState.READY:
            raise Overloaded(f"rank group is {client.state.value}; retry shortly",
                             retry_after_s=RESTART_RETRY_AFTER_S)
        # the agent headers (server/agent_hints.py) with the protocol layer's session key
        session_hint = with_body_class(replace(hint or SessionHint(), key=prepared.session_key),
                                       prepared.one_off)
        salt = prepared.caller_scope if self._salt_per_caller else b""
        async with self._cache.turn(prepared.prompt_ids, session_hint, prepared.max_tokens,
                                    max_tokens_is_default=prepared.max_tokens_is_default,
                                    caller_salt=salt) as turn:
            await self._run_turn(turn, prepared, rs, flight, write)

    async def _run_turn(self, turn: Turn, prepared: PreparedRequest, rs: ResponseStream,
                        flight: _Flight, write: Write | None) -> None:
        admission = turn.admission
        engine_stream: RequestStream | None = None
        symptoms = self._symptoms
        if symptoms is not None:
            symptoms.observe_request_start(prepared.session_key)
            symptoms.observe_turn(prepared.session_key, prepared.num_prompt_tokens,
                                  admission.num_cached_tokens)
        try:
            self._count_admission(admission, flight)
            # max_output_tokens: max_tokens, or the KV room left when max_tokens was a default
            sampling = SamplingParams(max_tokens=admission.max_output_tokens,
                                      temperature=prepared.temperature,
                                      top_p=prepared.top_p, top_k=prepared.top_k, seed=prepared.seed)
            request = turn.engine_request(flight.request_id, sampling)
            # Its prompt work counts as queued in the engine until its first output (_pump).
            await self._gate.hold(turn.rank, flight.request_id,
                                  turn.num_prompt_tokens - admission.num_cached_tokens, flight.arrival_s)
            try:
                engine_stream = self._client.submit(turn.rank, request)
            except RankUnavailable as exc:
                log.info("request %s: rank group unavailable: %s", flight.request_id, exc)
                raise Overloaded("the engine is restarting; retry shortly",
                                 retry_after_s=RESTART_RETRY_AFTER_S) from None
            await turn.settle_fold()  # the cached count is final from here (a fold may fail)
            admission = turn.admission
            self._count_cached(admission, flight)
            if write is not None:
                flight.started = True  # from here on, errors go out as the stream's error event
                await write(rs.start(admission.num_cached_tokens))
            last = await self._pump(engine_stream, rs, flight, write, turn)
            stop_hit = rs.stop_hit
            if stop_hit:
                reason = "stop"
            elif last is not None and last.finish_reason in _NORMAL_FINISH:
                reason = last.finish_reason.value
            else:
                turn.abort()
                raise _engine_failure(last, flight.request_id)
            # rs.finish() first: it records the ledger entry and decides the API's stop reason.
            tail = rs.finish(reason, prepared.num_prompt_tokens, admission.num_cached_tokens,
                             turn.num_output_tokens)
            if stop_hit:
                self._close_turn(turn, engine_stream)
            else:
                turn.finish(_stop_kind(rs))
            flight.finish_reason = "stop_sequence" if stop_hit else reason
            if write is not None and tail:
                await write(tail)
        finally:
            self._gate.done(turn.rank, flight.request_id)
            if not turn.settled:
                self._close_turn(turn, engine_stream)
            if symptoms is not None:
                symptoms.observe_request_end(prepared.session_key)

    def _close_turn(self, turn: Turn, engine_stream: RequestStream | None) -> None:
        """Settle a turn we stopped listening for (stop sequence, client gone, timeout).

        An abort travels to the rank while the rank keeps stepping, so the request may finish
        there first and hand its blocks to the cache (``kept_blocks``); filing them is the only
        way they are ever released. So an engine stream that has not ended is aborted and
        drained in the background, and the turn is settled by its terminal output."""
        if engine_stream is not None:
            for out in engine_stream.drain_nowait():  # delivered but not consumed yet
                turn.keep(out)
            if not engine_stream.done:
                engine_stream.abort()
                turn.hand_off()
                task = asyncio.get_running_loop().create_task(self._settle_when_ended(turn, engine_stream))
                self._late.add(task)
                task.add_done_callback(self._late.discard)
                return
        turn.settle()

    async def _settle_when_ended(self, turn: Turn, engine_stream: RequestStream) -> None:
        try:
            async for out in engine_stream:
                turn.keep(out)
        except Exception:  # noqa: BLE001 - the group failed: the epoch's blocks are gone anyway
            turn.abort()
        finally:
            turn.settle()

    async def _pump(self, engine_stream: RequestStream, rs: ResponseStream, flight: _Flight,
                    write: Write | None, turn: Turn) -> RequestOutput | None:
        """Feed engine outputs to the response stream until finished or a stop sequence; as
        they arrive, the turn keeps them and the cache grows its KV room ahead of its decode
        (``Turn.feed``/``feed_batch``)."""
        feed = turn.feed
        feed_batch = turn.feed_batch
        last: RequestOutput | None = None
        metrics = self._metrics
        inter_token = metrics.inter_token
        output_tokens = metrics.output_tokens
        anext = engine_stream.__anext__
        drain = engine_stream.drain_nowait
        try:
            first = await anext()
        except StopAsyncIteration:
            return None
        finally:
            self._gate.started(turn.rank, flight.request_id)  # its prefill left the engine's queue
        while True:
            batch = drain()
            if batch:
                batch.insert(0, first)
                tokens = feed_batch(batch)
                last = batch[-1]
            else:
                feed(first)
                tokens = first.token_ids
                last = first
            if tokens:
                flight.num_output_tokens += len(tokens)
                output_tokens.inc(len(tokens))  # per batch, so /metrics shows live throughput
                data = rs.feed(tokens)
                if data and write is not None:
                    await write(data)
                    now = time.perf_counter()
                    if flight.first_token_s:
                        inter_token.observe(now - flight.last_write_s)
                    else:
                        flight.first_token_s = now
                        metrics.ttft.labels(flight.api).observe(now - flight.arrival_s)
                    flight.last_write_s = now
                elif not flight.first_token_s:
                    flight.first_token_s = time.perf_counter()
                if rs.stop_hit:
                    break
            if last.finished:
                break
            try:
                first = await anext()
            except StopAsyncIteration:
                break
        return last

    # -- helpers -------------------------------------------------------------------------------
    def _count_admission(self, admission: AdmissionView, flight: _Flight) -> None:
        flight.rank = admission.rank
        flight.session = admission.session_id
        self._metrics.queue_time.observe(admission.queue_time_s)

    def _count_cached(self, admission: AdmissionView, flight: _Flight) -> None:
        """What was cached, once final (``Turn.settle_fold``)."""
        flight.num_cached_tokens = admission.num_cached_tokens
        for tier, num_tokens in admission.cached_tokens_by_tier.items():
            if num_tokens:
                self._metrics.cached_tokens.labels(tier.value).inc(num_tokens)

    def _as_protocol_error(self, exc: BaseException, flight: _Flight) -> ProtocolError:
        """The client's error: what happened and what to do, never the internals (addresses,
        engine messages, tracebacks); those go to the log under the request id."""
        if isinstance(exc, RankFailed):
            log.warning("request %s: rank group failed: %s", flight.request_id, exc)
            return Overloaded("the engine restarted while serving this request; retry",
                              retry_after_s=RESTART_RETRY_AFTER_S)
        if isinstance(exc, RankUnavailable):
            log.info("request %s: rank group unavailable: %s", flight.request_id, exc)
            return Overloaded("the engine is restarting; retry shortly", retry_after_s=RESTART_RETRY_AFTER_S)
        if isinstance(exc, EngineMisuse):
            log.error("request %s: engine rejected the request: %s", flight.request_id, exc)
            return InternalError("the engine rejected the request")
        if not isinstance(exc, ProtocolError):
            log.error("request %s failed", flight.request_id, exc_info=exc)
        return error_from_exception(exc)

    def _record(self, flight: _Flight) -> None:
        now = time.perf_counter()
        metrics = self._metrics
        metrics.in_flight.dec()
        metrics.prompt_tokens.inc(flight.num_prompt_tokens)
        metrics.finished.labels(flight.finish_reason).inc()
        metrics.request_seconds.labels(flight.api).observe(now - flight.arrival_s)
        ttft_ms = (flight.first_token_s - flight.arrival_s) * 1e3 if flight.first_token_s else -1.0
        # Never the prompt or the output: sizes, timings and where it ran only.
        log.info("request %s api=%s finish=%s rank=%d prompt=%d cached=%d output=%d ttft_ms=%.1f "
                 "total_ms=%.1f session=%s", flight.request_id, flight.api, flight.finish_reason, flight.rank,
                 flight.num_prompt_tokens, flight.num_cached_tokens, flight.num_output_tokens, ttft_ms,
                 (now - flight.arrival_s) * 1e3, flight.session)


def _stop_kind(rs: ResponseStream) -> StopKind:
    """How the turn ended, for the cache's eviction value (a tool call returns in seconds)."""
    reason = rs.finish_reason
    if reason is TurnFinish.TOOL_CALLS:
        return StopKind.TOOL_USE
    if reason is TurnFinish.STOP:
        return StopKind.END_TURN
    return StopKind.UNKNOWN


def _engine_failure(last: RequestOutput | None, request_id: str) -> ProtocolError:
    if last is None:
        return InternalError("the engine ended the request without output")
    if last.finish_reason is FinishReason.ERROR:
        # The engine could not run it (e.g. no KV capacity); retrying later can succeed.
        log.warning("request %s: the engine could not run it: %s", request_id, last.error)
        return Overloaded("the engine could not run the request; retry later",
                          retry_after_s=RESTART_RETRY_AFTER_S)
    return Overloaded("the request was aborted by the engine", retry_after_s=RESTART_RETRY_AFTER_S)
