"""Build and run everything from one ``WorkloadConfig``: tokenizer, protocol, rank group, cache,
service, HTTP app and server.

Start order (``start``): metrics and the app first, then the HTTP server binds (so ``/healthz``
answers ``loading`` while the model loads), then the tokenizer (in a thread), the rank group
(bounded by ``load_timeout_seconds``), the cache manager and the service; the routes start
serving chat only once ``AppState.protocol`` and ``AppState.service`` are set. Stop order is the
reverse: HTTP (stop accepting, let streams finish for a grace period), the cache (with L2 on,
``CacheManager.close`` flushes idle sessions to disk), the rank group, the L2 store.

Rank modes: ``process`` (``RankGroup``, one process per rank, the production path) or ``local``
(``LocalRankGroup``, engines in this process: tests and the simulator).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import orjson
import uvicorn

from protocol.errors import InternalError, ProtocolError
from rank.client import GroupState
from rank.ids import Rank
from server.app import AppState, HealthReport, HealthStatus, create_app
from server.config import WorkloadConfig
from server.metrics import ServerMetrics, StateSnapshot
from server.service import ChatService

if TYPE_CHECKING:
    from cache.l2_store import L2Store
    from cache.l3_store import L3Store
    from cache.manager import CacheManager
    from protocol.api import Protocol
    from protocol.api_types import ApiName
    from rank.client import RankClient
    from server.http_limits import HttpLimits
    from server.persist import SegmentLog
    from server.preflight_checks.report import PreflightReport

log = logging.getLogger("deepinfer.runtime")

HTTP_GRACE_S = 5.0
FAILURE_POLL_S = 0.5  # how often wait_failed looks at the rank group's state


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handling: the runtime's owner decides when to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _http_impl(limits: HttpLimits) -> str | type[asyncio.Protocol]:
    """Our bounded httptools protocol (server/http_limits.py); uvicorn's h11 when httptools is
    missing (requirements.txt has it): that bounds headers but has no header timeout or cap."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        log.warning("httptools is not installed: no HTTP header timeout and no connection cap")
        return "h11"
    from server.http_limits import protocol_class

    return protocol_class(limits)


class Runtime:
    """Owns every long-lived piece of one backend instance.

    Invariant: ``health()`` is ``loading`` until ``start`` completed, and the chat routes answer
    503 until then; after ``stop`` nothing of the runtime (rank processes, sockets) is left.
    """

    def __init__(self, config: WorkloadConfig, *, preflight_report: PreflightReport | None = None,
                 rank_mode: str = "process", metrics: ServerMetrics | None = None,
                 config_warnings: list[str] | None = None) -> None:
        if rank_mode not in ("process", "local"):
            raise ValueError(f"rank_mode must be 'process' or 'local', got {rank_mode!r}")
        self.config = config
        self.rank_mode = rank_mode
        self.metrics = metrics or ServerMetrics()
        self.metrics.attach_state(self._snapshot)
        from server.symptoms import RuntimeSymptoms

        self.symptoms = RuntimeSymptoms.from_config(config, self.metrics.registry)
        self.state = AppState(config=config, metrics=self.metrics, health=self.health,
                              symptoms=self.symptoms)
        self.app = create_app(self.state)
        self.group: RankClient | None = None
        self.cache: CacheManager | None = None
        self.l2: L2Store | None = None  # the L2 store (server/kv_disk.py), when l2_dir and l2_gb are set
        self.l3: L3Store | None = None  # the shared store (server/kv_disk.py), when l3 is set
        self.protocol: Protocol | None = None
        self.service: ChatService | None = None
        self._preflight = preflight_report
        self._config_warnings = list(config_warnings or ())  # e.g. unknown keys setup() ignored
        self._server: _EmbeddedServer | None = None
        self._server_task: asyncio.Task[None] | None = None
        self._socket: socket.socket | None = None
        self._ready = False
        self._failed: str | None = None
        self._stopping: asyncio.Future[None] | None = None
        self._persisted: list[SegmentLog] = []  # protocol state logs under l2_dir (closed at stop)

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self, on_listening: Callable[[str], None] | None = None) -> None:
        cfg = self.config
        started_s = time.monotonic()
        try:
            if cfg.http_mode == "native":
                await self._start_http()
                log.info("HTTP listening on %s (loading)", self.url)
                if on_listening is not None:
                    on_listening(self.url)
            self.protocol = await asyncio.to_thread(self._build_protocol)
            log.info("tokenizer and protocol ready (%.1f s)", time.monotonic() - started_s)
            self.group = self._build_group()
            await asyncio.wait_for(self.group.start(), cfg.load_timeout_seconds)
            log.info("rank group ready: %d %s rank(s), %d blocks of %d tokens each (%.1f s)",
                     self.group.num_ranks, cfg.engine, self.group.num_blocks, self.group.block_size,
                     time.monotonic() - started_s)
            self.cache = await self._build_cache(self.group)
            self.service = ChatService(self.protocol, self.cache, self.group, self.metrics, cfg,
                                       self.symptoms)
            self.state.protocol, self.state.service = self.protocol, self.service
            self._ready = True
        except asyncio.TimeoutError:
            self._failed = f"ranks did not load within load_timeout_seconds ({cfg.load_timeout_seconds:g} s)"
            await self.stop()
            raise TimeoutError(self._failed) from None
        except BaseException as exc:
            self._failed = f"start failed: {type(exc).__name__}: {exc}"
            await self.stop()
            raise

    async def stop(self) -> None:
        """Stop everything; concurrent and repeated calls share one stop, which a cancelled
        caller does not interrupt (a half-run stop would leave ranks, /dev/shm or sockets)."""
        if self._stopping is None or self._stopping.done():
            self._stopping = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        self._ready = False
        self.state.protocol = self.state.service = None
        self.state.preparer.close()
        if self._server is not None:
            self._server.should_exit = True
            if self._server_task is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(self._server_task, HTTP_GRACE_S + 5)
            self._server = self._server_task = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self.cache is not None:  # a graceful stop flushes idle sessions to L2 (bounded inside)
            try:
                await self.cache.close()
            except Exception:  # the stop goes on; the sessions recompute next time
                log.exception("stop: flushing idle sessions to L2 failed")
        if self.group is not None:
            await self.group.close()
            self.group = None
        if self.l2 is not None:
            self.l2.close()
            self.l2 = None
        if self.l3 is not None:
            self.l3.close()
            self.l3 = None
        for persisted in self._persisted:
            persisted.close()
        self._persisted = []

    async def wait_failed(self) -> str:
        """Return, with the reason, once the rank group can no longer come back (``FAILED``: its
        restart budget is spent, ``rank/restart_budget.py``). The owner then stops the runtime and
        exits non-zero (``server/exit_on_failure.py``)."""
        while True:
            group = self.group
            if group is not None and group.state == GroupState.FAILED:
                return f"the rank group cannot come back: {group.health().get('last_failure')}"
            await asyncio.sleep(FAILURE_POLL_S)

    # -- construction -----------------------------------------------------------------------------
    def _build_protocol(self) -> Protocol:
        from protocol.api import Protocol
        from protocol.ledger import OutputLedger
        from protocol.tokenize import PromptTokenizer

        cfg = self.config
        model_dir = cfg.resolved_model_dir()
        tokenizer = PromptTokenizer.load(str(model_dir) if model_dir else None)
        ledger = OutputLedger()
        if cfg.l2_dir:
            from server.persist import open_protocol_state

            ledger, self._persisted = open_protocol_state(cfg.l2_dir, cfg.model_name, tokenizer)
        return Protocol(tokenizer, ledger, cfg.served_model_names, cfg.max_model_len)

    def _build_group(self) -> RankClient:
        if self.rank_mode == "local":
            from rank.local_group import LocalRankGroup

            cfg = self.config
            # Tests size the pool with l1_host_gb directly (per rank, as in the seed guide).
            pool_bytes = int(cfg.l1_host_gb * (1 << 30)) * cfg.ep if cfg.l1_cache else 0
            return LocalRankGroup.from_config(cfg.rank_config(), host_pool_bytes=pool_bytes,
                                              name=f"rt-{id(self):x}")
        from rank.group import RankGroup
        from rank.restart_budget import RestartBudget

        cfg = self.config
        budget = RestartBudget(max_start_failures=3, max_restarts=cfg.rank_max_restarts,
                               window_s=cfg.rank_restart_window_secs)
        return RankGroup(cfg.rank_config(), budget=budget)

    async def _build_cache(self, group: RankClient) -> CacheManager:
        from cache.manager import CacheManager
        from cache.metrics import CacheMetrics
        from server.kv_disk import open_l2, open_l3, tier_below_l1

        config = self.config.cache_config()
        self.l2 = await open_l2(self.config, group, config.hash_salt)
        self.l3 = await open_l3(self.config, group, config.hash_salt)
        below_l1 = tier_below_l1(self.l2, self.l3)
        return CacheManager(group, config, CacheMetrics(self.metrics.registry), l2=below_l1)

    async def _start_http(self) -> None:
        cfg = self.config
        sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((cfg.host, cfg.port))
        except OSError as exc:
            sock.close()
            raise OSError(f"cannot bind the HTTP server to {cfg.host}:{cfg.port} (config keys host/port): "
                          f"{exc.strerror}") from None
        sock.listen(2048)
        sock.setblocking(False)
        self._socket = sock
        from server.http_gate import RequestGate, allowed_hosts
        from server.http_limits import HttpLimits

        gate = RequestGate(allowed_hosts(cfg.host, cfg.http_allowed_hosts), cfg.http_allowed_origins,
                           cfg.resolved_api_key(), cfg.max_body_bytes)
        limits = HttpLimits(header_timeout_s=cfg.http_header_timeout_secs,
                            max_header_bytes=cfg.http_max_header_bytes,
                            max_connections=cfg.http_max_connections, keep_alive_s=cfg.http_keep_alive_secs,
                            body_timeout_s=cfg.http_body_timeout_secs,
                            body_min_rate=cfg.http_body_min_bytes_per_sec,
                            max_buffered_body_bytes=cfg.http_max_buffered_body_bytes,
                            write_stall_s=cfg.http_write_stall_secs,
                            max_per_address=cfg.http_max_connections_per_address, gate=gate)
        uv_config = uvicorn.Config(
            self.app, http=_http_impl(limits), loop="none", lifespan="off", access_log=False,
            # uvicorn's annotations say int; it takes float seconds (asyncio timeouts)
            log_level="warning", timeout_graceful_shutdown=HTTP_GRACE_S, backlog=2048,  # type: ignore[arg-type]
            timeout_keep_alive=limits.keep_alive_s, h11_max_incomplete_event_size=limits.max_header_bytes,  # type: ignore[arg-type]
            server_header=False,
        )
        self._server = _EmbeddedServer(uv_config)
        self._server_task = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._server_task.done():
                self._server_task.result()  # raises what uvicorn raised
                raise RuntimeError("HTTP server exited during start-up")
            await asyncio.sleep(0.01)

    # -- state ------------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return self._socket.getsockname()[1] if self._socket is not None else 0

    @property
    def url(self) -> str:
        host = self.config.host
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else (f"[{host}]" if ":" in host else host)
        return f"http://{shown}:{self.port}"

    def describe(self) -> str:
        cfg = self.config
        where = self.url if self._socket is not None else "no HTTP (IK_BACKEND_HTTP=sdk)"
        return (f"{cfg.model_name} on {cfg.engine} ({cfg.ep} rank(s), {self.rank_mode}); {where}; "
                f"health {self.health().status}")

    def health(self) -> HealthReport:
        warnings = list(self._config_warnings)
        warnings += self._preflight.warnings() if self._preflight is not None else []
        warnings += self.symptoms.active_warnings()
        if self._failed:
            return HealthReport("failed", [self._failed], warnings)
        if not self._ready or self.group is None:
            return HealthReport("loading", ["model loading"], warnings)
        state = self.group.state.value
        reasons: list[str] = []
        if state != "ready":
            reasons.append(f"rank group {state}")
            status: HealthStatus = "failed" if state in ("failed", "stopped") else "loading"
            return HealthReport(status, reasons, warnings, {"rank_group": state})
        cfg = self.config
        if not cfg.prefix_cache:
            reasons.append("prefix cache off (config prefix_cache: false)")
        elif not self.group.prefix_cache_supported:
            reasons.append(f"prefix cache off: {self.group.prefix_cache_reason or 'not supported'}")
        if not cfg.l1_cache:
            reasons.append("L1 host cache off (config l1_cache: false)")
        elif self.cache is not None and not self.cache.l1_enabled:
            reasons.append(f"L1 host cache off ({self.cache.l1_off_reason})")
        details: dict[str, Any] = {"engine": cfg.engine, "rank_group": state, "epoch": self.group.epoch,
                                   "num_ranks": self.group.num_ranks}
        details["ranks"] = self.group.health()
        return HealthReport("degraded" if reasons else "ready", reasons, warnings, details)

    def _snapshot(self) -> StateSnapshot:
        if self.group is None:
            return StateSnapshot("loading")
        stats: list[dict[str, float]] = []
        for rank in range(self.group.num_ranks):
            with contextlib.suppress(Exception):
                s = self.group.stats(Rank(rank))
                stats.append({k: float(getattr(s, k)) for k in s.__slots__})
        cache_stats: dict[str, float] = {}  # the cache's own gauges are cache.metrics.CacheMetrics
        if self.l2 is not None:
            from server.kv_disk import l2_gauges

            cache_stats.update(l2_gauges(self.l2))
        if self.l3 is not None:
            from server.kv_disk import l3_gauges

            cache_stats.update(l3_gauges(self.l3))
        return StateSnapshot(self.group.state.value, stats, cache_stats)

    # -- in-process API (the SDK's process()/chat()) ----------------------------------------------
    def _ready_parts(self) -> tuple[Protocol, ChatService]:
        if self.service is None or self.protocol is None:
            from protocol.errors import Overloaded

            raise Overloaded("the model is still loading", retry_after_s=5)
        return self.protocol, self.service

    async def complete(self, api: ApiName, body: dict[str, Any],
                       headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        """A non-streaming answer in ``api``'s own shape, in process (no HTTP): the same prepare,
        session hint and turn as the native route for that API."""
        protocol, service = self._ready_parts()
        prepare = protocol.prepare_anthropic if api == "anthropic" else protocol.prepare_openai
        prepared = await self.state.preparer.run(prepare, orjson.dumps({**body, "stream": False}),
                                                 headers or {})
        return await service.complete(prepared, self.state.request_ids(), time.perf_counter())

    async def count_tokens(self, body: dict[str, Any], headers: Mapping[str, str] | None = None) -> int:
        """An Anthropic count_tokens body's prompt length, as ``/v1/messages/count_tokens``."""
        protocol, _ = self._ready_parts()
        return int(await self.state.preparer.run(protocol.count_tokens_anthropic, orjson.dumps(body),
                                                 headers or {}))

    async def openai_chat_chunks(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """OpenAI ``chat.completion.chunk`` dicts of one streamed completion, in process."""
        protocol, service = self._ready_parts()
        prepared = await self.state.preparer.run(protocol.prepare_openai,
                                                 orjson.dumps({**body, "stream": True}), {})
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()

        async def write(data: bytes) -> None:
            queue.put_nowait(data)

        async def run() -> None:
            try:
                await service.stream(prepared, self.state.request_ids(), write, time.perf_counter())
            finally:
                queue.put_nowait(None)

        task = asyncio.ensure_future(run())
        try:
            while True:
                data = await queue.get()
                if data is None:
                    break
                for chunk in _sse_json(data):
                    if "error" in chunk and "choices" not in chunk:
                        raise InternalError(str(chunk["error"].get("message", "stream failed")))
                    yield chunk
            await task  # raises a ProtocolError from before the first chunk
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task


def _sse_json(data: bytes) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for line in data.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            try:
                out.append(orjson.loads(line[6:]))
            except orjson.JSONDecodeError as exc:
                raise ProtocolError(f"malformed stream frame: {exc}") from None
    return out
