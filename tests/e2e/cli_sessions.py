"""Claude Code's other ways of running, for the end-to-end tests: several prompts in one process
(``--input-format stream-json``) and the interactive TUI (driven through tmux).

Both use the harness's clean environment, HOME and project layout (``e2e_harness``).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from tests.e2e.e2e_harness import API_KEY, ClaudeRun, claude_env, parsed_run, start_claude


class StreamJsonSession:
    """``claude -p --input-format stream-json --output-format stream-json``: prompts written to
    stdin one at a time, each answered by a ``result`` event. Stdin stays open while the CLI works
    (it exits without a word on EOF, Claude Code's captured traffic, ``docs/claude-code.md``)."""

    def __init__(self, binary: Path, project: Path, base_url: str) -> None:
        self.project = project
        self.proc, self.home, self.t0 = start_claude(binary, None, project, base_url, stream_json=True,
                                                     args=("--input-format", "stream-json"))
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stdout: list[str] = []
        self._stderr: list[str] = []
        self._readers = [threading.Thread(target=self._pump, args=(self.proc.stdout, self._stdout, True),
                                          daemon=True),
                         threading.Thread(target=self._pump, args=(self.proc.stderr, self._stderr, False),
                                          daemon=True)]
        for reader in self._readers:
            reader.start()

    def _pump(self, stream: Any, sink: list[str], forward: bool) -> None:
        for line in stream:
            sink.append(line)
            if forward:
                self._lines.put(line)
        if forward:
            self._lines.put(None)

    def ask(self, prompt: str, timeout_s: float = 180) -> dict[str, Any]:
        """Send one user message; the ``result`` event that answers it."""
        message = {"type": "user", "message": {"role": "user", "content": prompt}}
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no result within {timeout_s} s for "
                                     f"{prompt!r}:\n{''.join(self._stderr)[-2000:]}") from None
            if line is None:
                raise AssertionError("claude exited before answering "
                                     f"{prompt!r}:\n{''.join(self._stderr)[-2000:]}")
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("type") == "result":
                    return event

    def close(self, timeout_s: float = 60) -> ClaudeRun:
        """End the input, wait for the process; every event of the session."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for reader in self._readers:
            reader.join(timeout=10)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        return parsed_run(self.proc.returncode, "".join(self._stdout), "".join(self._stderr),
                          time.monotonic() - self.t0, self.home, self.project)


class TuiSession:
    """The interactive CLI in a detached tmux session on a private tmux server (``-L``), read with
    ``capture-pane`` and typed into with ``send-keys``.

    A fresh HOME gets the ``~/.claude.json`` the TUI needs offline (reference section 0):
    onboarding done, the API key approved, the project trusted."""

    def __init__(self, binary: Path, project: Path, base_url: str, name: str,
                 extra_env: dict[str, str] | None = None) -> None:
        if shutil.which("tmux") is None:
            raise RuntimeError("tmux is not installed")
        self.name = name
        self.socket = f"e2e-{os.getpid()}-{name}"
        home = project.parent / "home"
        (home / "tmp").mkdir(parents=True, exist_ok=True)
        (home / ".claude.json").write_text(json.dumps({
            "hasCompletedOnboarding": True,
            "customApiKeyResponses": {"approved": [API_KEY[-20:]], "rejected": []},
            "projects": {str(project): {"hasTrustDialogAccepted": True,
                                        "hasCompletedProjectOnboarding": True}},
        }))
        env = claude_env(base_url, home, extra={"TERM": "xterm-256color", **(extra_env or {})})
        command = "env -i " + " ".join(shlex.quote(f"{k}={v}")
                                       for k, v in env.items()) + " " + shlex.quote(str(binary))
        self._tmux("new-session", "-d", "-s", name, "-x", "160", "-y", "50", "-c", str(project), command)

    def _tmux(self, *args: str) -> str:
        out = subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=30,
                             check=False)
        if out.returncode != 0:
            raise RuntimeError(f"tmux {' '.join(args[:2])} failed: {out.stderr.strip()}")
        return out.stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", self.name)

    def wait_for(self, pattern: str, timeout_s: float = 90) -> re.Match[str]:
        """The first match of ``pattern`` (a regex) on the screen, polled until it shows."""
        deadline = time.monotonic() + timeout_s
        screen = ""
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError):
                screen = self.screen()
                m = re.search(pattern, screen)
                if m:
                    return m
            time.sleep(0.3)
        raise AssertionError(f"{pattern!r} did not show within {timeout_s} s; the screen:\n{screen}")

    def type_line(self, text: str) -> None:
        """Type ``text`` literally, then Enter (after a pause: a slash command opens a menu)."""
        self._tmux("send-keys", "-t", self.name, "-l", text)
        time.sleep(1.0)
        self._tmux("send-keys", "-t", self.name, "Enter")

    def close(self) -> None:
        """Stop the tmux server and remove its socket file (tmux leaves it behind)."""
        socket_path = ""
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            socket_path = self._tmux("display-message", "-p", "#{socket_path}").strip()
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self._tmux("kill-server")
        if socket_path:
            Path(socket_path).unlink(missing_ok=True)
