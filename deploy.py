"""Pin the DeepInfer workload to a 4x B200 worker and wait until the control plane says it is ready.

    python deploy.py                          # the measured configuration of the deployment guide
    python deploy.py --config my.json         # a workload config of your own (JSON object)
    python deploy.py --on-drift reconcile     # apply a changed spec to the live workload (restarts it)
    python deploy.py --dry-run                # validate and print the spec; contact no control plane

Environment: ``INFERENCEKEY_SDK_TOKEN`` (``ik_sdk_``, workload:read + workload:write),
``INFERENCEKEY_PROJECT`` (project slug) and ``IK_WORKER_ID`` (the 4x B200 worker);
``INFERENCEKEY_BASE_URL`` overrides the control plane.

The config is validated with the backend's own ``WorkloadConfig`` before anything is sent, so a
misspelt key fails here, naming the key, instead of 90 minutes later in the worker's ``setup()``.
Publish the backend first (``python publish.py``); ``backend`` below is its slug.

What it does, in order (docs/backend.md, "Publishing and deploying"):

1. ``ensure(spec, on_drift=fail)``. A new workload is created. A live workload whose spec differs
   is left alone unless ``--on-drift reconcile`` is given: the message names the fields that
   differ and what a reconcile restarts (``RESTART_EFFECTS``); with ``reconcile`` the same
   message is printed and then ``ensure(spec, on_drift=reconcile)`` applies the spec.
2. Readiness from the control plane's own word: ``ready`` is printed only after a ``ready``
   event. The SDK's ``wait_until_ready`` also returns when its event stream ends without one
   and does not bound a stream that sends nothing, so the wait runs in a thread under our own
   deadline and, when the stream ends early, the workload's phase is asked again (the SDK has no
   status call besides the readiness stream) until ``ready``, ``error`` or the deadline.
3. Nothing printed carries a secret: ``api_key`` and every key/token/secret/password field of the
   spec are masked, and so is any credential-shaped value, in the spec and in error messages.

Exit status: 0 ready; 1 the control plane refused or the workload reported ``error``; 2 bad
command line or config; 3 the live workload differs and ``--on-drift fail`` left it alone;
4 not confirmed ready within the wait.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.config import ConfigError, load_config

SLUG = "deepinfer-v41-flash"
MODEL = "deepseek-v4.1-flash"
EXIT_READY, EXIT_FAILED, EXIT_USAGE, EXIT_DRIFT, EXIT_NOT_READY = 0, 1, 2, 3, 4
# How long to wait before asking for the phase again after a readiness stream ended early.
REPOLL_S = 5.0

# The JIT kernel caches the prebuilt DeepInfer package unpacks (deployment guide, step 1 and
# "Kernel caches"): with these set the kernels are loaded instead of compiled on first use.
JIT_CACHE_ENV = {
    "DG_JIT_CACHE_DIR": "/workspace/jit-cache/deep_gemm",
    "EP_JIT_CACHE_DIR": "/workspace/jit-cache/deep_ep",
    "TILELANG_CACHE_DIR": "/workspace/jit-cache/tilelang",
    "TRITON_CACHE_DIR": "/workspace/jit-cache/triton",
}

# The workload configuration of the measured runs (seed deployment guide, step 4), plus the JIT
# kernel cache variables of its "Kernel caches" note.
MEASURED_CONFIG: dict[str, Any] = {
    "engine": "deepinfer",
    "env": {
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        "DEEPINFER_HF_MODEL_DIR": "/workspace/v41flash",
        "IK_BACKEND_HTTP": "native",
        **JIT_CACHE_ENV,
    },
    "ep": 4,
    "deepinfer_venv": "/workspace/di-venv",
    "eplb": False,
    "extra_experts": 0,
    "max_model_len": 1064960,
    "max_num_seqs": 128,
    "max_num_batched_tokens": 16384,
    "gpu_memory_utilization": 0.90,
    "load_timeout_seconds": 3600,
    "l1_cache": True,
    "l1_host_gb": 128,
    "deepinfer_env": {
        "DEEPINFER_ENGRAM_LOCAL": "1",
        "EP_DISABLE_GIN": "1",
        "NCCL_IB_DISABLE": "1",
        "MASTER_PORT": "29511",
        "DEEPINFER_NCCL_NVLS_ENABLE": "0",
        "NCCL_NVLS_ENABLE": "0",
    },
    "ready_timeout_secs": 5400,
    "request_timeout_secs": 1800,
}

# What applying a changed spec to the live workload costs (the backend process is replaced).
RESTART_EFFECTS = (
    "A reconcile restarts the backend on the worker: the rank group stops and loads the weights again "
    "(minutes on B200), requests in flight fail, L0 (the GPU prefix cache) is lost and so is L1 (the "
    "/dev/shm host pool, removed when the rank group stops). A graceful stop writes idle sessions to L2 "
    "first, so with l2_dir set on the same machine they come back warm; without l2_dir, or on another "
    "worker, every session starts cold."
)

# Config keys whose values are secrets: a word of the key (split at _ - . and case changes) is one of
# these, e.g. api_key, api_key_file, HF_TOKEN, client_secret, DB_PASSWORD. Plural "tokens" is a count
# (max_num_batched_tokens), not a secret.
SECRET_WORDS = frozenset({"key", "apikey", "token", "secret", "secrets", "password", "passwd", "passphrase",
                          "credential", "credentials", "auth", "authorization", "bearer"})
# Values shaped like credentials whatever their key (same shapes publish.py refuses in an archive).
SECRET_VALUE_RE = re.compile(
    r"(ik_(sdk|live)_[A-Za-z0-9]{8,})|(sk-[A-Za-z0-9][A-Za-z0-9_-]{19,})|(hf_[A-Za-z0-9]{30,})"
    r"|(gh[pousr]_[A-Za-z0-9]{36,})|(AKIA[0-9A-Z]{16})"
)
MASK = "***"


def is_secret_key(key: str) -> bool:
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key).lower()
    return any(word in SECRET_WORDS for word in re.split(r"[_\-.\s]+", words))


def mask_secrets(value: Any) -> Any:
    """A copy of ``value`` with every secret-named field's value and every credential-shaped
    string replaced by ``***`` (dicts and lists at any depth)."""
    if isinstance(value, dict):
        return {k: (MASK if is_secret_key(str(k)) and v not in (None, "") else mask_secrets(v))
                for k, v in value.items()}
    if isinstance(value, list):
        return [mask_secrets(v) for v in value]
    if isinstance(value, str):
        return SECRET_VALUE_RE.sub(MASK, value)
    return value


def secret_values(value: Any) -> set[str]:
    """The secret strings in ``value`` (to scrub them from free text such as error messages)."""
    found: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            if is_secret_key(str(k)) and isinstance(v, str) and v:
                found.add(v)
            else:
                found |= secret_values(v)
    elif isinstance(value, list):
        for v in value:
            found |= secret_values(v)
    return found


def scrub(text: str, secrets: set[str]) -> str:
    """``text`` with the known secret values and credential-shaped strings masked."""
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return SECRET_VALUE_RE.sub(MASK, text)


def read_config(path: str | None) -> dict[str, Any]:
    if path is None:
        return json.loads(json.dumps(MEASURED_CONFIG))  # a deep copy
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the workload config must be a JSON object")
    return raw


def build_spec(config: dict[str, Any], worker_id: str | None, backend_slug: str) -> Any:
    from inferencekey import ExecutionPolicy, WorkloadSpec

    cfg = load_config(config)  # raises ConfigError naming the key
    return WorkloadSpec(
        name="DeepSeek-V4.1-Flash on DeepInfer",
        slug=cfg.slug,
        model=cfg.model_name,
        backend=backend_slug,
        task_type="text2text",
        worker_id=worker_id,
        execution_policy=ExecutionPolicy.FIXED,  # one always-on replica pinned to the worker
        config=config,
    )


# -- what the installed SDK sends --------------------------------------------------------------------
CONFIG_NOT_SENT = (
    "the installed inferencekey SDK does not send WorkloadSpec.config: its ensure() request carries "
    "{kept} of it, so the workload config above does not reach the platform from here, and a "
    "config edit is neither drift nor applied. Check the workload's config on the platform (Workloads "
    "page) or use an SDK that sends it."
)


def config_keys_sent(spec: Any, timeout_s: float = 5.0) -> set[str] | None:
    """The config keys the installed SDK puts in its create request for ``spec``, read by sending
    it to a throwaway server on 127.0.0.1 (None when that could not be observed)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from inferencekey import ManagementClient

    seen: list[dict[str, Any]] = []

    class Capture(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            return

        def _reply(self, payload: Any) -> None:
            body = json.dumps(payload).encode()
            self.send_response(200 if self.command == "GET" else 201)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._reply([])

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = json.loads(raw or b"{}")
            seen.append(body)
            self._reply({**body, "id": "probe", "project_id": "probe", "created_at": "", "updated_at": ""})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Capture)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    result: list[set[str]] = []

    def call() -> None:
        try:
            client = ManagementClient(base_url=f"http://127.0.0.1:{server.server_address[1]}",
                                      sdk_token="ik_sdk_probe", project="probe")
            client.ensure(spec)
        except Exception:  # noqa: BLE001 - unobservable: the caller says nothing
            return
        if seen:
            result.append(set((seen[-1].get("config") or {}).keys()))

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(timeout_s)
    server.shutdown()
    server.server_close()
    return result[0] if result else None


def config_warning(spec: Any) -> str | None:
    """A warning when the SDK would drop keys of ``spec.config`` (None when all are sent or unknown)."""
    sent = config_keys_sent(spec)
    wanted = set((spec.config or {}).keys())
    if sent is None or wanted <= sent:
        return None
    return CONFIG_NOT_SENT.format(kept=("only " + ", ".join(sorted(sent))) if sent else "none")


# -- drift -------------------------------------------------------------------------------------------
DRIFT_PREFIX = "workload drifted from spec:"


def drift_fields(exc: Exception) -> list[str] | None:
    """The fields named by the SDK's drift error (``workload drifted from spec: a, b``), else None."""
    text = str(exc)
    if DRIFT_PREFIX not in text:
        return None
    tail = text.split(DRIFT_PREFIX, 1)[1]
    return [f.strip() for f in tail.split(",") if f.strip()] or ["(unnamed)"]


def drift_message(slug: str, fields: list[str], on_drift: str) -> str:
    head = f"the live workload {slug} differs from this spec in: {', '.join(fields)}."
    if on_drift == "fail":
        return (f"{head} Left unchanged (--on-drift fail, the default). {RESTART_EFFECTS} "
                "To apply the spec anyway, run again with --on-drift reconcile.")
    return f"{head} Reconciling (--on-drift reconcile). {RESTART_EFFECTS}"


def ensure_workload(mgmt: Any, spec: Any, on_drift: str, say: Callable[[str], None]) -> Any:
    """``ensure`` with drift refused first; returns the EndpointRef or raises ``DriftRefused``."""
    from inferencekey import OnDrift
    from inferencekey.errors import ApiError

    try:
        return mgmt.ensure(spec, on_drift=OnDrift.FAIL)
    except ApiError as exc:
        fields = drift_fields(exc)
        if fields is None:
            raise
    if on_drift == "fail":
        raise DriftRefused(drift_message(spec.slug, fields, on_drift))
    say(drift_message(spec.slug, fields, on_drift))
    return mgmt.ensure(spec, on_drift=OnDrift.RECONCILE)


class DriftRefused(Exception):
    """The live workload differs from the spec and ``--on-drift fail`` left it alone."""


# -- readiness ---------------------------------------------------------------------------------------
@dataclass
class Readiness:
    """What the control plane said while we waited: ``ready`` only from an explicit event."""

    ready: bool = False
    error: str | None = None
    phase: str | None = None
    message: str = ""
    streams: int = 0


def _one_stream(mgmt: Any, slug: str, timeout_s: float, state: Readiness, done: threading.Event,
                say: Callable[[str], None]) -> None:
    def record(event: Any) -> None:
        state.phase, state.message = event.phase, event.message
        if event.phase == "ready":
            state.ready = True
        say(f"  phase: {event.phase}: {event.message}")

    try:
        mgmt.wait_until_ready(slug, timeout=max(1.0, timeout_s), on_progress=record)
    except TimeoutError:
        pass  # the SDK's own limit (only checked between events); our deadline decides
    except Exception as exc:  # noqa: BLE001 - an error phase or a refused call: reported, no traceback
        state.error = f"{type(exc).__name__}: {exc}"
    finally:
        done.set()


def wait_ready(mgmt: Any, slug: str, timeout_s: float, say: Callable[[str], None],
               repoll_s: float = REPOLL_S) -> Readiness:
    """Follow the readiness stream until ``ready``, ``error`` or ``timeout_s``; when a stream ends
    without either, ask again after ``repoll_s``. Each stream runs in a daemon thread so that a
    stream sending nothing cannot hold us past the deadline."""
    state = Readiness()
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return state
        done = threading.Event()
        state.streams += 1
        worker = threading.Thread(target=_one_stream, args=(mgmt, slug, remaining, state, done, say),
                                  name="deploy-readiness", daemon=True)
        worker.start()
        if not done.wait(max(0.0, deadline - time.monotonic())):
            return state  # the stream is still open past our deadline (the thread is left behind)
        if state.ready or state.error is not None:
            return state
        if time.monotonic() + repoll_s >= deadline:
            time.sleep(max(0.0, deadline - time.monotonic()))
            return state
        say(f"  the readiness stream ended without 'ready' (last phase: {state.phase or 'none'}); "
            f"asking the control plane again in {repoll_s:g} s")
        time.sleep(repoll_s)


def make_client() -> Any:
    """The SDK's control-plane client (tests replace this to reach their stand-in's seams)."""
    from inferencekey import ManagementClient

    return ManagementClient.from_env()


# -- command line ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python deploy.py", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=None, help="workload config JSON (default: measured)")
    parser.add_argument("--backend", default=SLUG, help="published custom backend slug")
    parser.add_argument("--worker", default=os.environ.get("IK_WORKER_ID"))
    parser.add_argument("--on-drift", choices=("fail", "reconcile"), default="fail",
                        help="when the live workload differs from this spec: leave it and exit 3 (fail, the "
                        "default) or apply the spec, which restarts the backend and its caches (reconcile)")
    parser.add_argument("--timeout-s", type=float, default=None,
                        help="wait limit (default: the config's ready_timeout_secs)")
    parser.add_argument("--dry-run", action="store_true", help="validate and print; send nothing")
    args = parser.parse_args(argv)

    secrets: set[str] = set()
    try:
        config = read_config(args.config)
        secrets = secret_values(config)
        spec = build_spec(config, args.worker, args.backend)
    except (ConfigError, OSError, json.JSONDecodeError) as exc:
        print(f"deploy failed: {scrub(str(exc), secrets)}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(mask_secrets(spec.to_wire()), indent=2))
    warning = config_warning(spec)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    if args.dry_run:
        print("dry run: config valid, nothing sent")
        return EXIT_READY
    if not args.worker:
        print("deploy failed: set IK_WORKER_ID (or --worker) to the 4x B200 worker", file=sys.stderr)
        return EXIT_USAGE

    from inferencekey.errors import InferenceKeyError

    cfg = load_config(config)
    timeout_s = args.timeout_s or float(cfg.ready_timeout_secs)
    try:
        mgmt = make_client()
        ref = ensure_workload(mgmt, spec, args.on_drift, print)
    except DriftRefused as exc:
        print(f"deploy stopped: {scrub(str(exc), secrets)}", file=sys.stderr)
        return EXIT_DRIFT
    except InferenceKeyError as exc:
        print(f"deploy failed: {type(exc).__name__}: {scrub(str(exc), secrets)}", file=sys.stderr)
        return EXIT_FAILED
    print(f"ensured workload {ref.project_slug}/{ref.workload_slug}; waiting up to {timeout_s:.0f} s "
          "for the control plane to report it ready")
    state = wait_ready(mgmt, ref.workload_slug, timeout_s, print)
    if state.error is not None:
        print(f"deploy failed: {scrub(state.error, secrets)}", file=sys.stderr)
        return EXIT_FAILED
    if not state.ready:
        print(f"deploy failed: {ref.workload_slug} not confirmed ready within {timeout_s:.0f} s (last phase: "
              f"{state.phase or 'none reported'}{': ' + state.message if state.message else ''}); the "
              "workload is left as it is: look at the worker's log, then run deploy.py again to keep "
              "waiting", file=sys.stderr)
        return EXIT_NOT_READY
    print(f"ready: {ref.workload_slug} (the control plane reported phase 'ready')")
    print("next: raise the worker's Concurrent requests for this workload to "
          f"{cfg.ep * cfg.max_num_seqs} (Workloads page)")
    return EXIT_READY


if __name__ == "__main__":
    sys.exit(main())
