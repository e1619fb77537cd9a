"""The InferenceKey custom backend (``deepinfer_backend:DeepInferBackend``) and its command line.

The worker runs ``python -m inferencekey.backend.serve --backend deepinfer_backend:DeepInferBackend``
and hands the workload config to ``setup()``. ``setup()`` validates it, puts the DeepInfer venv's
site-packages on ``sys.path``, runs the preflight checks, starts the rank group, the cache tiers and
the HTTP server (``/v1/messages``, ``/v1/chat/completions``) on a background event loop, and
returns only when the model is ready. ``process()`` answers the SDK's non-streaming jobs (an
Anthropic Messages or OpenAI chat body in, that API's answer out: ``server/process_jobs.py``);
``chat()`` streams OpenAI chunks for SDKs that stream.

Import order (the worker's two venvs): the backend runs in a venv made from ``requirements.txt``
and the SDK only. Until ``add_venv_site_packages`` has run, only this module and
``server.config`` (pydantic) may be imported; torch, numpy, orjson, pyzmq and tokenizers
(``RUNTIME_MODULES``) come from the DeepInfer venv, so ``server.runtime`` and everything under it
is imported after that point. ``tests/server/test_backend_import_order.py`` enforces it.

Outside the SDK the same runtime runs from the command line::

    python -m deepinfer_backend serve [--config FILE] [--engine reference|deepinfer|scripted]
        [--script FILE] [--host H] [--port P] [--ranks N] [--api-key-file FILE | --api-key KEY]
        [--header-timeout S] [--max-header-bytes N] [--max-connections N] [--keep-alive S]
    python -m deepinfer_backend preflight --config FILE [--json]
    python -m deepinfer_backend smoke --url URL [--key KEY] [--api anthropic|openai|both] [--process]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import importlib.util
import json
import logging
import os
import signal
import site
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from inferencekey.backend import BackendContext, CustomBackend, InvalidInput, Job, Result

from server.config import ConfigError, WorkloadConfig, load_config, load_worker_config

if TYPE_CHECKING:
    from server.background import LoopThread
    from server.preflight_checks.report import PreflightReport
    from server.runtime import Runtime

log = logging.getLogger("deepinfer.backend")

# What the backend process imports only once the DeepInfer venv is on sys.path (requirements.txt
# leaves them out: on the worker they are the DeepInfer venv's pinned builds).
RUNTIME_MODULES = ("torch", "numpy", "orjson", "zmq", "tokenizers")
PREFLIGHT_SKIP_ENV = "DIB_PREFLIGHT_SKIP"  # tests only (run_preflight)
PROCESS_WAIT_MARGIN_S = 30.0  # process(): past the job's own bound, a wedged loop still answers

_HERE = Path(__file__).resolve().parent
# Job input keys passed through to the OpenAI request (everything else is ignored, not an error:
# the platform may add envelope keys of its own).
_OPENAI_PASSTHROUGH = ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
                       "stop", "tools", "tool_choice", "reasoning_effort", "response_format",
                       "chat_template_kwargs", "thinking")


def _backend_version() -> str:
    """The version stamped by publish.py into BUILD_INFO.json, else pyproject's."""
    info = _HERE / "BUILD_INFO.json"
    if info.is_file():
        try:
            return str(json.loads(info.read_text(encoding="utf-8"))["version"])
        except (ValueError, KeyError, OSError):
            pass
    try:
        from importlib.metadata import version

        return version("deepinfer-backend")
    except Exception:  # noqa: BLE001 - metadata is optional (the worker does not pip-install us)
        return "0.0.0+unknown"


def add_venv_site_packages(venv: str | None) -> list[str]:
    """Add the DeepInfer venv's site-packages to ``sys.path``, after ours (our venv's versions win),
    as a site directory: its ``.pth`` files run, so an editable ``deepinfer`` resolves as it does in
    the venv's own interpreter."""
    if not venv:
        return []
    root = Path(venv)
    if not root.is_dir():
        raise ConfigError(f"config key 'deepinfer_venv': {venv} is not a directory")
    tag = f"python{sys.version_info.major}.{sys.version_info.minor}"
    added: list[str] = []
    for candidate in sorted(root.glob("lib*/python3*/site-packages")):
        if candidate.parent.name != tag:
            log.warning("deepinfer_venv site-packages %s is for %s, this process runs %s; skipping",
                        candidate, candidate.parent.name, tag)
            continue
        if str(candidate) not in sys.path:
            site.addsitedir(str(candidate))
            added.append(str(candidate))
    if not added:
        log.warning("deepinfer_venv %s has no site-packages for %s; rank processes still use its "
                    "interpreter", venv, tag)
    return added


def require_runtime_modules(venv: str | None) -> None:
    """Fail with one clear line when torch, numpy, orjson, pyzmq or tokenizers cannot be found."""
    missing = [name for name in RUNTIME_MODULES if importlib.util.find_spec(name) is None]
    if not missing:
        return
    where = (f"the DeepInfer venv {venv} does not provide them" if venv else
             "set deepinfer_venv to the DeepInfer venv (or install them next to the backend)")
    raise ConfigError(f"the backend needs {', '.join(missing)} at runtime; requirements.txt leaves them out "
                      f"because on the worker they come from the DeepInfer venv: {where}")


def describe_runtime_modules() -> str:
    """``name version (path)`` of each runtime module, for the log: which venv supplied it."""
    parts = []
    for name in RUNTIME_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            origin = str(Path(getattr(module, "__file__", "") or "?").parent.parent)
            parts.append(f"{name} {getattr(module, '__version__', '?')} ({origin})")
    return ", ".join(parts)


class SetupInterrupted(Exception):
    """SIGTERM while ``setup()`` was loading (a cancelled deploy): the runtime was stopped first."""


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """While the model loads, SIGTERM raises ``SetupInterrupted`` in setup() instead of killing the
    process outright (the SDK installs its own handler only after setup() returns), so the rank
    processes, the L1 /dev/shm pool and the temp directory are removed before it exits."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a repeat must not cut the cleanup short
        raise SetupInterrupted(f"signal {signum} while loading; the ranks were stopped")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_preflight(config: WorkloadConfig) -> PreflightReport:
    """Run the preflight checks; raise on a fatal finding.

    TESTS ONLY: ``DIB_PREFLIGHT_SKIP`` (comma-separated check names) skips checks that need the
    B200 machine itself; the worker stand-in sets it for engine 'deepinfer' on a CPU machine."""
    from server import preflight
    skip = frozenset(filter(None, os.environ.get(PREFLIGHT_SKIP_ENV, "").split(",")))
    if skip:
        log.warning("%s: TEST knob, preflight checks skipped: %s", PREFLIGHT_SKIP_ENV,
                    ", ".join(sorted(skip)))
    report = preflight.run_preflight(config, options=preflight.PreflightOptions(skip=skip))
    report.log(log)
    report.raise_if_fatal()  # PreflightError lists every fatal check and its fix
    return report


def job_to_openai_body(job: Job) -> dict[str, Any]:
    """The SDK job (``input.messages`` or ``input.prompt``) as an OpenAI chat request body."""
    data = job.input
    messages = data.get("messages")
    if messages is None:
        prompt = data.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise InvalidInput("job input needs 'messages' (a list) or 'prompt' (a non-empty string)")
        messages = [{"role": "user", "content": prompt}]
    if not isinstance(messages, list) or not messages:
        raise InvalidInput("job input 'messages' must be a non-empty list of chat messages")
    body: dict[str, Any] = {"model": data.get("model") or "default", "messages": messages, "stream": False}
    for key in _OPENAI_PASSTHROUGH:
        if key in data:
            body[key] = data[key]
    return body


def _request_to_body(request: object) -> dict[str, Any]:
    """Accept what a streaming SDK may hand ``chat()``: a dict, a Job, or a pydantic/dataclass."""
    if isinstance(request, Job):
        return job_to_openai_body(request)
    if isinstance(request, dict):
        body = dict(request)
    elif hasattr(request, "model_dump"):
        body = request.model_dump(exclude_none=True)
    elif hasattr(request, "to_wire"):
        body = request.to_wire()
    else:
        raise InvalidInput(f"unsupported chat request type {type(request).__name__}")
    if "messages" not in body and ("prompt" in body or "input" in body):
        return job_to_openai_body(Job(id="chat", input=body.get("input", body)))
    return body


class DeepInferBackend(CustomBackend):
    """DeepSeek-V4.1-Flash on DeepInfer (or the reference engine) behind native HTTP endpoints.

    Lifecycle invariant: ``self._runtime`` is set only while its loop thread runs; ``close()``
    (also registered with ``atexit``) stops the HTTP server, the cache and the rank processes.
    """

    name = "deepinfer-v41-flash"
    version = _backend_version()
    task_type = "text2text"
    requirements = "requirements.txt"
    requires_python = "3.12"
    api = "openai-chat"  # read by SDKs whose manifest has an ``api`` field

    def __init__(self) -> None:
        self._runtime: Runtime | None = None
        self._loop: LoopThread | None = None
        self._lock = threading.Lock()
        self.config: WorkloadConfig | None = None

    # -- SDK contract ----------------------------------------------------------------------------
    def setup(self, ctx: BackendContext) -> None:
        started_s = time.monotonic()
        _configure_logging()
        # ConfigError names the key and the allowed values; unknown keys are ignored with a warning.
        config, config_warnings = load_worker_config(ctx.config)
        config_warnings += config.transport_warnings(dict(os.environ))
        for warning in config_warnings:
            log.warning("setup: %s", warning)
        self.config = config
        if config.http_mode == "native" and config.port != 0 and config.port == ctx.port:
            raise ConfigError(f"config key 'port': {config.port} is the SDK server's own port (the worker "
                              "chose it); the native HTTP server needs another one (or 0 for a free one)")
        log.info("setup: engine=%s ranks=%d model=%s", config.engine, config.ep, config.model_name)
        log.info("setup: transport: %s", config.transport_line(ctx.port))
        # Nothing outside requirements.txt is imported above this line (module docstring).
        try:
            add_venv_site_packages(config.deepinfer_venv)
            require_runtime_modules(config.deepinfer_venv)
        except ConfigError:
            run_preflight(config)  # PreflightError names every fatal finding, this one among them
            raise
        from server.background import LoopThread
        from server.runtime import Runtime

        report = run_preflight(config)
        runtime = Runtime(config, preflight_report=report, config_warnings=config_warnings)
        loop = LoopThread()
        try:
            with _sigterm_interrupts():
                loop.start(runtime.start, timeout_s=config.ready_timeout_secs, abort=runtime.stop)
        except TimeoutError:
            raise RuntimeError(f"the model was not ready within ready_timeout_secs "
                               f"({config.ready_timeout_secs:g} s)") from None
        with self._lock:
            self._runtime, self._loop = runtime, loop
        atexit.register(self.close)
        from server.exit_on_failure import exit_process_when_failed

        exit_process_when_failed(runtime, loop)  # the SDK's /healthz cannot report a dead rank group
        log.info("setup: ready in %.1f s; %s; runtime packages: %s", time.monotonic() - started_s,
                 runtime.describe(), describe_runtime_modules())

    def process(self, job: Job) -> Result:
        """An Anthropic Messages or OpenAI chat body in, that API's non-streaming answer out
        (``server/process_jobs.py`` says how the shape is recognised and what comes back)."""
        runtime, loop = self._require_ready()
        from protocol.errors import ProtocolError
        from server import process_jobs

        api: process_jobs.ProcessApi = "openai"
        try:
            request = process_jobs.parse_input(job.input)
            api = request.api
            # The job bounds itself on the loop (request_timeout_secs); this wait only outlasts it.
            output = loop.call(process_jobs.run(runtime, request),
                               runtime.config.request_timeout_secs + PROCESS_WAIT_MARGIN_S)
        except ProtocolError as exc:  # 4xx: the SDK answers 400; the text is the API's error body
            text = process_jobs.error_text(exc, api)
            if exc.status(api) < 500:
                raise InvalidInput(text) from None
            raise RuntimeError(text) from None
        return Result(output=output)

    def chat(self, request: object, *_args: object, **_kwargs: object) -> Iterator[dict[str, Any]]:
        """Stream a chat request as OpenAI ``chat.completion.chunk`` dicts (``stream`` forced on).

        Extra arguments a future streaming SDK may pass (a context, options) are accepted and
        ignored, so a newer SDK's call shape does not break the published backend."""
        body = _request_to_body(request)
        body["stream"] = True
        runtime, loop = self._require_ready()
        from protocol.errors import ProtocolError

        try:
            # Validation happens on the first item; map 4xx to the SDK's InvalidInput.
            yield from loop.iterate(runtime.openai_chat_chunks(body))
        except ProtocolError as exc:
            if exc.http_status < 500:
                raise InvalidInput(exc.message) from None
            raise RuntimeError(exc.message) from None

    def close(self) -> None:
        with self._lock:
            runtime, loop = self._runtime, self._loop
            self._runtime = self._loop = None
        if runtime is not None and loop is not None:
            loop.stop(runtime.stop)

    # -- helpers ---------------------------------------------------------------------------------
    def _require_ready(self) -> tuple[Runtime, LoopThread]:
        with self._lock:
            if self._runtime is None or self._loop is None:
                raise RuntimeError("backend is not set up (setup() has not finished)")
            return self._runtime, self._loop


# -- command line ------------------------------------------------------------------------------------
def _configure_logging(level: int = logging.INFO) -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("deepinfer").setLevel(level)


def _add_config_venv(argv: list[str]) -> None:
    """Add the config's DeepInfer venv to ``sys.path`` when it exists. A missing venv is not an
    error here: the preflight reports it as one finding among all the others (it needs nothing
    beyond requirements.txt to run)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config")
    path = parser.parse_known_args(argv)[0].config
    venv = None
    if path and path != "-":
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return  # the preflight's own reading of --config reports it (exit 2)
        venv = raw.get("deepinfer_venv") if isinstance(raw, dict) else None
        venv = venv if isinstance(venv, str) else None
    if venv and Path(venv).is_dir():
        add_venv_site_packages(venv)


def _cli_config(args: argparse.Namespace) -> WorkloadConfig:
    raw: dict[str, Any] = {}
    if args.config:
        raw = json.loads(Path(args.config).read_text(encoding="utf-8"))
        if not isinstance(raw, dict):
            raise ConfigError(f"{args.config}: the workload config must be a JSON object")
    overrides = {"engine": args.engine, "script_file": args.script, "host": args.host, "port": args.port,
                 "ep": args.ranks, "api_key": args.api_key,
                 "api_key_file": getattr(args, "api_key_file", None),
                 "reference_model": args.reference_model,
                 "http_header_timeout_secs": getattr(args, "header_timeout", None),
                 "http_max_header_bytes": getattr(args, "max_header_bytes", None),
                 "http_max_connections": getattr(args, "max_connections", None),
                 "http_keep_alive_secs": getattr(args, "keep_alive", None)}
    raw.update({k: v for k, v in overrides.items() if v is not None})
    config = load_config(raw)
    config.resolved_api_key()  # an unreadable or empty api_key_file fails here, naming the key
    return config


async def _serve_forever(config: WorkloadConfig) -> int:
    """Serve until SIGINT/SIGTERM (returns 0) or until the rank group fails for good (stops the
    runtime, prints one line on stderr and returns ``EXIT_RANK_GROUP_FAILED``)."""
    from server.exit_on_failure import EXIT_RANK_GROUP_FAILED, failure_line, stop_after_failure
    from server.runtime import Runtime

    report = run_preflight(config)
    runtime = Runtime(config, preflight_report=report)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    reason = None
    try:
        await runtime.start(on_listening=lambda url: print(f"listening on {url}", flush=True))
        print(f"ready: {runtime.describe()}", flush=True)
        failed = asyncio.ensure_future(stop_after_failure(runtime))  # stops the runtime itself
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({failed, stopped}, return_when=asyncio.FIRST_COMPLETED)
        for task in (failed, stopped):
            if not task.done():
                task.cancel()
        if failed.done() and not failed.cancelled():
            reason = failed.result()
        else:
            print("shutting down", flush=True)
    finally:
        if reason is None:
            await runtime.stop()
    if reason is None:
        return 0
    print(failure_line(reason), file=sys.stderr, flush=True)
    return EXIT_RANK_GROUP_FAILED


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["preflight"]:  # the preflight helper owns its flags (--json, --skip, ...)
        _configure_logging()
        try:
            _add_config_venv(argv[1:])
        except (ConfigError, OSError, ValueError) as exc:
            print(f"preflight: {exc}", file=sys.stderr)
            return 2
        from server import preflight

        return int(preflight.main(argv[1:]))
    if argv[:1] == ["smoke"]:  # standard library only: runs without the DeepInfer venv
        from server import smoke

        return smoke.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m deepinfer_backend")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the backend's HTTP server outside the SDK")
    serve.add_argument("--config", help="workload config, JSON (the same keys as the SDK config)")
    serve.add_argument("--engine", choices=["reference", "deepinfer", "scripted"])
    serve.add_argument("--script", help="replies file for --engine scripted")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--ranks", type=int, help="number of rank processes (config key ep)")
    serve.add_argument("--api-key", help="require this key (x-api-key or Bearer); it shows in ps: prefer "
                       "--api-key-file or env DEEPINFER_API_KEY")
    serve.add_argument("--api-key-file", help="require the key this file holds (config key api_key_file)")
    serve.add_argument("--reference-model", choices=["null", "tiny", "small", "medium", "large"])
    serve.add_argument("--header-timeout", type=float, help="seconds to receive a request's headers "
                       "(config key http_header_timeout_secs, default 20, at most 30)")
    serve.add_argument("--max-header-bytes", type=int, help="request line + headers bound "
                       "(http_max_header_bytes, default 65536)")
    serve.add_argument("--max-connections", type=int, help="open client connections at most "
                       "(http_max_connections, default 2048)")
    serve.add_argument("--keep-alive", type=float,
                       help="idle keep-alive seconds (http_keep_alive_secs, default 75)")
    sub.add_parser("preflight", help="check the machine against a workload config "
                   "(--config FILE [--json] [--skip CHECK]); see server/preflight.py")
    sub.add_parser("smoke", help="check a running endpoint, one verdict line per check "
                   "(--url URL [--key KEY] [--api anthropic|openai|both] [--process]); see server/smoke.py")
    args = parser.parse_args(argv)

    _configure_logging()
    try:
        config = _cli_config(args)
        if config.http_mode != "native":
            raise ConfigError("serve runs the native HTTP server: env.IK_BACKEND_HTTP=sdk would leave "
                              "nothing to serve (that value is for the SDK's serve; drop it or set 'native')")
        add_venv_site_packages(config.deepinfer_venv)
        require_runtime_modules(config.deepinfer_venv)
    except (ConfigError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from server.background import new_event_loop

    loop = new_event_loop()
    try:
        status = loop.run_until_complete(_serve_forever(config))
    except Exception as exc:  # one line for the operator; details are in the log
        log.exception("serve failed")
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        loop.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
