"""End-to-end harness: the backend as a subprocess on the scripted stand-in model, and the real
Claude Code CLI run non-interactively against it.

Used by ``test_claude_cli.py`` (marked ``claude_cli``) and ``test_openai_flows.py``. Everything
runs on 127.0.0.1 with a fresh HOME and project directory per CLI run; nothing leaves the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
SCENARIOS = HERE / "scenarios"
PROJECTS = HERE / "projects"
CLI_CACHE = Path(os.environ.get("CLAUDE_CLI_CACHE", REPO / ".cache" / "claude-cli"))
VERSION_PINS = REPO / "scripts" / "claude-versions.txt"
MODEL = "deepseek-v4.1-flash"
API_KEY = "test-key-0123456789"


def pinned_versions() -> dict[str, str]:
    """``scripts/claude-versions.txt`` as {role: version} (oldest, newest)."""
    pins = {}
    for line in VERSION_PINS.read_text().splitlines():
        words = line.split()
        if len(words) >= 2 and not words[0].startswith("#"):
            pins[words[0]] = words[1]
    return pins


def find_claude() -> Path | None:
    """The Claude Code native binary: $CLAUDE_BIN (``scripts/claude_e2e.sh`` sets it for each
    version of the matrix), else the newest pinned version installed in the cache, else
    ``claude`` on PATH.

    npm >= 11 does not run the package's postinstall (which copies the native binary over the
    ``bin/claude.exe`` placeholder) unless scripts are allowed, so the platform package's binary
    is used directly.
    """
    if os.environ.get("CLAUDE_BIN"):
        return Path(os.environ["CLAUDE_BIN"]).resolve()  # the CLI runs with cwd = the project
    for version in reversed(list(pinned_versions().values())):
        scoped = CLI_CACHE / version / "node_modules" / "@anthropic-ai"
        for candidate in sorted(scoped.glob("claude-code-*/claude")):
            if os.access(candidate, os.X_OK):
                return candidate.resolve()
    found = shutil.which("claude")
    return Path(found) if found else None


# ---- backend ----------------------------------------------------------------------------------


@dataclass
class Backend:
    """``python -m deepinfer_backend serve --engine scripted --script FILE`` as a subprocess."""

    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path
    workdir: Path

    @classmethod
    def start(
        cls,
        script: Path,
        *,
        ranks: int = 2,
        config: dict[str, Any] | None = None,
        timeout_s: float = 180,
    ) -> Backend:
        workdir = Path(tempfile.mkdtemp(prefix="e2e-backend-"))
        raw = {
            "engine": "scripted",
            "script_file": str(script),
            "ep": ranks,
            "port": 0,
            "api_key": API_KEY,
            "l1_host_gb": 0.25,
            "reference_num_blocks": 1024,
            "max_num_batched_tokens": 8192,
        }
        raw.update(config or {})
        config_path = workdir / "config.json"
        config_path.write_text(json.dumps(raw, indent=2))
        log_path = workdir / "backend.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
        log_file = log_path.open("wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "deepinfer_backend", "serve", "--config", str(config_path)],
            cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
        )
        log_file.close()
        backend = cls(proc, "", log_path, workdir)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = backend.log_text()
            m = re.search(r"listening on (http://\S+)", text)
            if m and "ready:" in text:
                backend.base_url = m.group(1).rstrip("/")
                break
            if proc.poll() is not None:
                raise RuntimeError(f"backend exited with {proc.returncode}:\n{text[-4000:]}")
            time.sleep(0.2)
        else:
            backend.stop()
            raise RuntimeError(f"backend not ready after {timeout_s} s:\n{backend.log_text()[-4000:]}")
        backend.wait_ready(timeout_s)
        return backend

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def health(self) -> dict[str, Any]:
        """``/healthz`` with the API key: without it the backend answers ``{"status"}`` alone, and the
        rank details the tests read (``epoch``, ``ranks`` with each rank's pid) are missing."""
        r = httpx.get(f"{self.base_url}/healthz", headers={"x-api-key": API_KEY}, timeout=10)
        return r.json()

    def wait_ready(self, timeout_s: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                last = self.health()
                if last.get("status") == "ready":
                    return last
            time.sleep(0.2)
        raise RuntimeError(f"backend not ready: {last}")

    def metrics(self) -> dict[str, float]:
        """Prometheus samples as ``name{label="v",...}`` -> value (labels sorted)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def metric_sum(self, name: str) -> float:
        """Sum of every sample of ``name`` over all label values."""
        return sum(v for k, v in self.metrics().items() if k == name or k.startswith(name + "{"))

    def messages_requests(self, status: int) -> float:
        """``/v1/messages`` requests answered with ``status`` so far."""
        return self.metrics().get(f'deepinfer_requests_total{{route="messages",status="{status}"}}', 0.0)

    def busy_rank_pid(self) -> int | None:
        """pid (from /healthz) of a rank that reports a running request, else None."""
        busy = [int(m.group(1)) for k, v in self.metrics().items()
                if v >= 1 and (m := re.match(r'deepinfer_rank_num_running\{rank="(\d+)"\}', k))]
        if not busy:
            return None
        for info in self.health().get("ranks", {}).get("ranks", []):
            if info.get("rank") == busy[0] and info.get("pid"):
                return int(info["pid"])
        return None

    def rank_pids(self) -> list[int]:
        """Rank processes: the backend's descendants running ``rank.worker`` (or any python child)."""
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        ranks = []
        for child in children:
            with contextlib.suppress(psutil.Error):
                if "rank" in " ".join(child.cmdline()):
                    ranks.append(child.pid)
        return ranks

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


@contextlib.contextmanager
def running_backend(script: str | Path, **kw: Any) -> Iterator[Backend]:
    path = Path(script)
    if not path.is_absolute():
        path = SCENARIOS / path
    backend = Backend.start(path, **kw)
    try:
        yield backend
    finally:
        backend.stop()
        if os.environ.get("E2E_KEEP_LOGS"):
            print(f"backend log kept at {backend.log_path}")
        else:
            shutil.rmtree(backend.workdir, ignore_errors=True)


# ---- Claude Code ------------------------------------------------------------------------------


@dataclass
class ClaudeRun:
    rc: int
    stdout: str
    stderr: str
    wall_s: float
    home: Path
    project: Path
    result: dict[str, Any] = field(default_factory=dict)  # the final {"type": "result", ...}
    events: list[dict[str, Any]] = field(default_factory=list)  # stream-json lines

    def assistant_usages(self) -> list[dict[str, Any]]:
        """Per model request: the usage of each distinct assistant message (stream-json only)."""
        seen: dict[str, dict[str, Any]] = {}
        for ev in self.events:
            if ev.get("type") == "assistant":
                msg = ev.get("message", {})
                seen.setdefault(msg.get("id", str(len(seen))), msg.get("usage", {}))
        return list(seen.values())

    def tool_uses(self) -> list[dict[str, Any]]:
        out = []
        for ev in self.events:
            if ev.get("type") == "assistant":
                out += [b for b in ev.get("message", {}).get("content", []) if b.get("type") == "tool_use"]
        return out

    def describe(self) -> str:
        return (f"rc={self.rc} wall={self.wall_s:.1f}s\nresult={json.dumps(self.result)[:3000]}\n"
                f"stderr={self.stderr[-2000:]}")


def assert_success(run: ClaudeRun, num_turns: int | None = None) -> None:
    """rc 0, a success result, and no reply from the script's default (an unmatched prompt)."""
    assert run.rc == 0, run.describe()
    assert run.result.get("subtype") == "success" and run.result.get("is_error") is False, run.describe()
    assert "SCRIPT-DEFAULT" not in run.result.get("result", ""), run.describe()
    if num_turns is not None:
        assert run.result.get("num_turns") == num_turns, run.describe()


def claude_env(base_url: str, home: Path, *, model: str = MODEL,
               extra: dict[str, str] | None = None) -> dict[str, str]:
    """A clean environment: only what the CLI needs (no inherited ANTHROPIC_* or proxies).
    ``extra`` adds variables; one given as "" is left out (``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC``
    for the auxiliary requests, ``test_claude_auxiliary.py``)."""
    env = {
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "TMPDIR": str(home / "tmp"),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": API_KEY,
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "IS_SANDBOX": "1",  # we run as root; this lets --dangerously-skip-permissions through
    }
    env.update(extra or {})
    return {k: v for k, v in env.items() if v != ""}


def make_project(root: Path, files: dict[str, str] | None = None, copy_from: str | None = None) -> Path:
    project = root / "project"
    if copy_from:
        shutil.copytree(PROJECTS / copy_from, project)
    else:
        project.mkdir(parents=True)
    for name, content in (files or {}).items():
        (project / name).write_text(content, encoding="utf-8")
    return project


def start_claude(
    binary: Path, prompt: str | None, project: Path, base_url: str, *,
    stream_json: bool = False, model: str = MODEL, extra_env: dict[str, str] | None = None,
    args: tuple[str, ...] = (),
) -> tuple[subprocess.Popen[str], Path, float]:
    """``claude -p [PROMPT] ARGS``; without a prompt (``--input-format stream-json``) stdin is a
    pipe for the caller to write prompts to."""
    home = project.parent / "home"
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    fmt = ["--output-format", "stream-json", "--verbose"] if stream_json else ["--output-format", "json"]
    proc = subprocess.Popen(
        [str(binary), "-p", *([prompt] if prompt is not None else []), *fmt, *args,
         "--dangerously-skip-permissions"],
        cwd=project, env=claude_env(base_url, home, model=model, extra=extra_env),
        stdin=subprocess.DEVNULL if prompt is not None else subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    return proc, home, time.monotonic()


def finish_claude(proc: subprocess.Popen[str], home: Path, project: Path, t0: float,
                  timeout_s: float) -> ClaudeRun:
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\n[harness] killed after {timeout_s} s"
    return parsed_run(proc.returncode, stdout, stderr, time.monotonic() - t0, home, project)


def parsed_run(rc: int, stdout: str, stderr: str, wall_s: float, home: Path, project: Path) -> ClaudeRun:
    """A ClaudeRun with the JSON lines of ``stdout`` as events (the last result as ``result``)."""
    run = ClaudeRun(rc, stdout, stderr, wall_s, home, project)
    for line in stdout.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        with contextlib.suppress(ValueError):
            obj = json.loads(line)
            run.events.append(obj)
            if obj.get("type") == "result":
                run.result = obj
    return run


def run_claude(binary: Path, prompt: str, project: Path, base_url: str, *, timeout_s: float = 300,
               **kw: Any) -> ClaudeRun:
    proc, home, t0 = start_claude(binary, prompt, project, base_url, **kw)
    return finish_claude(proc, home, project, t0, timeout_s)


def transcript_tool_uses(home: Path) -> list[dict[str, Any]]:
    """tool_use blocks recorded in the session transcripts under ``$HOME/.claude/projects``."""
    uses = []
    for path in (home / ".claude" / "projects").rglob("*.jsonl"):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                obj = json.loads(line)
                content = (obj.get("message") or {}).get("content")
                if isinstance(content, list):
                    uses += [b for b in content if isinstance(b, dict) and b.get("type") == "tool_use"]
    return uses


class Poller(threading.Thread):
    """Calls ``fn`` every ``interval_s`` until it returns True or ``stop()``; keeps the first error."""

    def __init__(self, fn: Any, interval_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self._fn, self._interval_s = fn, interval_s
        self._stop_event = threading.Event()
        self.fired = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                if self._fn():
                    self.fired.set()
                    return
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.error = exc
                return
            time.sleep(self._interval_s)

    def stop(self) -> None:
        self._stop_event.set()
