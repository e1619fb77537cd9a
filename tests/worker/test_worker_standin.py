"""The worker stand-in: the published archive run the way an InferenceKey worker runs it, with engine
``reference`` and engine ``deepinfer`` (DeepInfer's real package and compiled scheduler from the
DeepInfer venv, only the SM100 forward replaced). The check to run before every publish:

    bash scripts/worker_standin.sh                   # both engines (builds the DeepInfer venv once)
    bash scripts/worker_standin.sh -k reference      # one engine

Prints, per engine: seconds to ready, each check (PASS/FAIL with what it saw) and the shutdown.
How the worker is reproduced: ``standin_worker.py``; what is checked: ``standin_checks.py``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import tests.worker.standin_checks as checks
from tests.worker.standin_worker import (
    REPO,
    SDK_REQUIREMENT,
    STANDIN_CHANGES,
    Machine,
    Worker,
    changed_keys,
    free_port,
    log,
    standin_config,
)

pytestmark = [pytest.mark.worker_standin, pytest.mark.timeout(2700)]
READY_TIMEOUT_S = 900.0
EXIT_BOUND_S = 120.0  # the backend bounds its own cleanup at 60 s (+10 s hard exit); generous here


def _build_dir() -> Path:
    raw = os.environ.get("DEEPINFER_BUILD_DIR") or subprocess.run(
        ["bash", str(REPO / "scripts" / "build_deepinfer.sh"), "--print-dir"], capture_output=True, text=True,
        check=True).stdout.strip()
    path = Path(raw)
    if not (path / ".complete").is_file():
        pytest.fail(f"no finished DeepInfer build at {path}: run bash scripts/build_deepinfer.sh")
    return path


def _claude_bin() -> str:
    if os.environ.get("CLAUDE_BIN"):
        return os.environ["CLAUDE_BIN"]
    res = subprocess.run(["bash", str(REPO / "scripts" / "claude_cli.sh")], capture_output=True, text=True,
                         check=True)
    return res.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def machine() -> Iterator[Machine]:
    work = Path(tempfile.mkdtemp(prefix="worker-standin-"))
    try:
        m = Machine(work, _build_dir())
        for line in m.prepare():
            log("worker", line)
        yield m
    finally:
        if os.environ.get("STANDIN_KEEP"):
            log("worker", f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


class Report:
    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.failed: list[str] = []

    def check(self, name: str, fn: Callable[[], str]) -> None:
        started = time.monotonic()
        try:
            detail = fn()
        except Exception as exc:  # noqa: BLE001 - every check runs; the failures are listed at the end
            self.failed.append(name)
            log(self.engine, f"FAIL {name} ({time.monotonic() - started:.1f} s): {type(exc).__name__}: {exc}")
            return
        log(self.engine, f"PASS {name} ({time.monotonic() - started:.1f} s): {detail}")


@pytest.mark.parametrize("engine", ["reference", "deepinfer"])
def test_worker_standin(machine: Machine, engine: str) -> None:
    import deploy

    report = Report(engine)
    # The rendezvous port must be free: MASTER_PORT itself for the reference engine's group,
    # MASTER_PORT-50 for DeepInfer's.
    master_port = free_port() + (50 if engine == "deepinfer" else 0)
    config = standin_config(deploy.MEASURED_CONFIG, engine, machine, free_port(), master_port)
    changed = changed_keys(deploy.MEASURED_CONFIG, config)
    log(engine, f"config: deploy.MEASURED_CONFIG with {', '.join(f'{k}={_get(config, k)}' for k in changed)}")
    report.check("config changes only engine, paths, ports, sizes",
                 lambda: _only(changed, STANDIN_CHANGES))
    report.check("backend venv holds none of the DeepInfer venv's packages",
                 lambda: _no_runtime_packages(machine))
    report.check("backend venv is requirements.lock, version for version",
                 lambda: _venv_is_the_lock(machine))
    worker = Worker(engine, machine, config)
    try:
        ready_s = worker.start(READY_TIMEOUT_S)
        log(engine,
            f"ready in {ready_s:.1f} s (SDK /healthz 200 on :{worker.sdk_port}; native :{config['port']})")
        report.check("SDK /healthz and /meta", lambda: checks.sdk_healthz(worker.sdk_url))
        report.check("SDK /process", lambda: checks.sdk_process(worker.sdk_url))
        report.check("SDK /process: anthropic body (system kept, tools, turn 2 cached)",
                     lambda: checks.process_anthropic(worker.sdk_url))
        report.check("SDK /process: openai body (system kept, tools, turn 2 cached)",
                     lambda: checks.process_openai(worker.sdk_url))
        report.check("native /healthz", lambda: checks.native_healthz(worker.native_url))
        report.check("runtime packages from the DeepInfer venv",
                     lambda: checks.runtime_packages(worker.log_path.read_text(errors="replace"),
                                                     machine.deepinfer_venv))
        report.check("rank processes", lambda: checks.ranks(worker.ranks, machine.deepinfer_venv,
                                                            machine.backend_dir, engine, master_port))
        report.check("anthropic SDK /v1/messages (tools, stream and not)",
                     lambda: checks.anthropic_messages(worker.native_url))
        report.check("openai SDK /v1/chat/completions (tools, stream and not)",
                     lambda: checks.openai_chat(worker.native_url))
        report.check("prefix cache hit on a repeated prompt",
                     lambda: checks.prefix_cache_hit(worker.native_url))
        report.check("claude -p (pinned CLI)",
                     lambda: checks.claude_print(_claude_bin(), worker.native_url,
                                                 machine.work / f"claude-{engine}"))
        log(engine, f"/healthz warnings: {checks.healthz_warnings(worker.native_url)}")
    except Exception:
        log(engine, f"serve log tail:\n{worker.log_tail(60) if worker.log_path.exists() else '(none)'}")
        raise
    finally:
        if worker.proc is not None:
            code, seconds, left = worker.stop()
            worker.kill()
            log(engine, f"{'PASS' if code == 0 and not left else 'FAIL'} SIGTERM to the SDK serve process: "
                f"exit {code} in {seconds:.1f} s; left behind: "
                f"{left or 'no process, /dev/shm segment or temp file'}")
            if code != 0 or left:
                report.failed.append("clean shutdown")
    _exit_on_failure(machine, engine, config, report)
    assert not report.failed, f"{engine}: failed checks: {report.failed}\n{worker.log_tail(60)}"


def _exit_on_failure(machine: Machine, engine: str, config: dict[str, Any], report: Report) -> None:
    """The supervisor's view of a rank group that cannot come back: the SDK's serve exits non-zero
    with one line, leaves nothing behind, and the next serve on the same ``l2_dir`` has the session.

    Two more serves of the same archive and config, plus L2 (``l2_dir``, a path, and ``l2_gb``: with
    ``l2_gb`` 0 only the protocol state is kept, not the KV) and ``rank_max_restarts: 0`` (so one kill
    of the ranks spends the budget instead of six)."""
    failing = {**config, "l2_dir": str(machine.work / f"l2-{engine}"), "l2_gb": 0.5, "rank_max_restarts": 0}
    log(engine, f"exit on failure: the config above with l2_dir={failing['l2_dir']}, l2_gb=0.5, "
        "rank_max_restarts=0")
    first = Worker(engine, machine, failing, tag="-fail")
    second = Worker(engine, machine, failing, tag="-again")
    try:
        ready_s = first.start(READY_TIMEOUT_S)
        history, _, prompt = checks.process_session_turn(first.sdk_url, f"standin-exit-{engine}")
        log(engine, f"serve #2 ready in {ready_s:.1f} s; /process turn 1 of a session: {prompt} prompt "
            "tokens")
        time.sleep(2.0)  # the turn has answered; its write-through runs beside the next steps

        def exits() -> str:
            family = first.family()
            killed = first.kill_ranks()
            code, seconds, left = first.wait_exit(family, EXIT_BOUND_S)
            lines = first.log_path.read_text(errors="replace").strip().splitlines()
            last = lines[-1] if lines else ""
            checks.expect(code == 3, f"exit {code} after the rank kill (want 3):\n{first.log_tail(30)}")
            checks.expect("exiting with status 3" in last and "restart budget spent" in last,
                          f"last line: {last!r}")
            checks.expect(not left, f"left behind: {left}")
            return (f"SIGKILL of ranks {killed} -> exit {code} in {seconds:.1f} s, nothing left behind; "
                    f"last line: {last}")

        report.check("SDK serve exits non-zero when the rank group cannot come back", exits)

        def warm() -> str:
            again_s = second.start(READY_TIMEOUT_S)
            _, cached, total = checks.process_session_turn(second.sdk_url, f"standin-exit-{engine}", history)
            checks.expect(cached >= 0.9 * total, f"turn 2 cached {cached} of {total} ({cached / total:.1%})")
            return (f"new serve on the same l2_dir ready in {again_s:.1f} s; /process turn 2 cached "
                    f"{cached} of {total} ({cached / total:.1%})")

        report.check("the next SDK serve has the session warm (>= 90% cached)", warm)
    except Exception as exc:  # noqa: BLE001 - a failed start is one failed check, with the log
        report.failed.append("exit on failure")
        log(engine, f"FAIL exit on failure: {type(exc).__name__}: {exc}")
    finally:
        if second.proc is not None:
            code, seconds, left = second.stop()
            log(engine, f"{'PASS' if code == 0 and not left else 'FAIL'} SIGTERM to serve #3: exit {code} in "
                f"{seconds:.1f} s; left behind: {left or 'nothing'}")
            if code != 0 or left:
                report.failed.append("clean shutdown of serve #3")
        for worker in (first, second):
            worker.kill()


def _get(config: dict, dotted: str) -> object:
    value: object = config
    for part in dotted.split("."):
        value = value[part]  # type: ignore[index]
    return value


def _only(changed: list[str], allowed: tuple[str, ...]) -> str:
    extra = sorted(set(changed) - set(allowed))
    checks.expect(not extra, f"changed beyond engine/paths/ports/sizes: {extra}")
    return f"{len(changed)} keys: {', '.join(changed)}"


def _venv_is_the_lock(machine: Machine) -> str:
    from tests.server.test_requirements_lock import parse_lock

    pins, _ = parse_lock((REPO / "requirements.lock").read_text(encoding="utf-8"))
    have = machine.backend_venv_versions()
    sdk = SDK_REQUIREMENT.split("==")[0]
    extra = {k: v for k, v in have.items() if k not in pins and k not in (sdk, "pip", "setuptools")}
    differ = {k: (v, have.get(k)) for k, v in pins.items() if have.get(k) != v}
    checks.expect(not differ, f"lock vs installed (locked, installed): {differ}")
    checks.expect(not extra, f"installed but not locked: {extra}")
    return f"{len(pins)} locked packages installed at their locked versions (+ {sdk})"


def _no_runtime_packages(machine: Machine) -> str:
    have = machine.backend_venv_packages()
    clash = sorted(have & {"torch", "numpy", "orjson", "pyzmq", "tokenizers"})
    checks.expect(not clash,
                  f"requirements.txt pulled in {clash}: they would shadow the DeepInfer venv's pins")
    return f"{len(have)} distributions, none of torch/numpy/orjson/pyzmq/tokenizers"
