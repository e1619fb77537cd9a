"""deploy.py and publish.py, each path, through the SDK's own clients against a local control plane.

The stand-in (``control_plane_standin.py``) speaks the SDK's control-plane API on 127.0.0.1. The
SDK's native readiness stream never ends on its own against it (the client reconnects whenever a
response ends), so the "stream ended without ready" paths go through the client's native seam
(``ManagementClient._native``): a wrapper whose first streams end after the scripted events and
which hands later calls to the real native client, i.e. to the stand-in.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import deploy
import publish
from tests.server.control_plane_standin import ControlPlaneStandin

TOKEN = "ik_sdk_standin"
PROJECT = "proj"
API_KEY = "sk-ant-api03-" + "k" * 32  # a config secret that must never be printed


@pytest.fixture()
def cp(monkeypatch: pytest.MonkeyPatch) -> Iterator[ControlPlaneStandin]:
    with ControlPlaneStandin(TOKEN) as standin:
        monkeypatch.setenv("INFERENCEKEY_BASE_URL", standin.base_url)
        monkeypatch.setenv("INFERENCEKEY_SDK_TOKEN", TOKEN)
        monkeypatch.setenv("INFERENCEKEY_PROJECT", PROJECT)
        monkeypatch.setenv("IK_TENANT_ID", "tenant-1")
        monkeypatch.setattr(deploy, "REPOLL_S", 0.05)
        monkeypatch.setattr(deploy, "wait_ready", _fast_repoll(deploy.wait_ready))
        yield standin


def _fast_repoll(wait_ready: Any) -> Any:
    def wrapped(mgmt: Any, slug: str, timeout_s: float, say: Any, repoll_s: float = 0.05) -> Any:
        return wait_ready(mgmt, slug, timeout_s, say, repoll_s=0.05)
    return wrapped


def ev(phase: str, message: str = "") -> dict[str, Any]:
    return {"phase": phase, "message": message or phase, "elapsed_ms": 0}


class EndingStreams:
    """The native client, except that its first readiness streams end after the given events."""

    def __init__(self, native: Any, streams: list[list[dict[str, Any]]], repeat_last: bool = False) -> None:
        self._native, self._streams, self._repeat = native, list(streams), repeat_last
        self.opened = 0

    def readiness_events(self, *args: Any) -> Any:
        self.opened += 1
        if self._streams:
            events = self._streams[0] if self._repeat and len(self._streams) == 1 else self._streams.pop(0)
            return iter([json.dumps(e) for e in events])
        return self._native.readiness_events(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._native, name)


def _with_streams(monkeypatch: pytest.MonkeyPatch, streams: list[list[dict[str, Any]]],
                  repeat_last: bool = False) -> list[EndingStreams]:
    made: list[EndingStreams] = []
    real = deploy.make_client

    def make() -> Any:
        client = real()
        client._native = EndingStreams(client._native, streams, repeat_last)
        made.append(client._native)
        return client

    monkeypatch.setattr(deploy, "make_client", make)
    return made


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = deploy.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _live(cp: ControlPlaneStandin, worker: str) -> dict[str, Any]:
    return cp.state.add_workload(PROJECT, name="DeepSeek-V4.1-Flash on DeepInfer", slug=deploy.SLUG,
                                 model_name=deploy.MODEL, backend=deploy.SLUG, worker_id=worker,
                                 execution_policy="fixed")


def test_new_workload_is_created_and_ready_only_on_a_ready_event(
    cp: ControlPlaneStandin, capsys: pytest.CaptureFixture[str]
) -> None:
    cp.state.readiness = [[ev("scheduling"), ev("bootstrapping"), ev("ready", "serving")]]
    code, out, err = _run(["--worker", "w-1"], capsys)
    assert code == deploy.EXIT_READY, err
    assert [c["slug"] for c in cp.state.created] == [deploy.SLUG] and cp.state.patches == []
    assert "phase: bootstrapping" in out and "ready: deepinfer-v41-flash" in out


def test_drift_with_the_default_fail_leaves_the_workload_and_says_what_reconcile_restarts(
    cp: ControlPlaneStandin, capsys: pytest.CaptureFixture[str]
) -> None:
    _live(cp, worker="w-old")
    code, out, err = _run(["--worker", "w-1"], capsys)
    assert code == deploy.EXIT_DRIFT
    assert cp.state.patches == [] and cp.state.created == [] and cp.state.readiness_connections == 0
    assert "differs from this spec in: worker_id" in err and "Left unchanged" in err
    assert "rank group" in err and "L0" in err and "L1" in err and "L2" in err
    assert "--on-drift reconcile" in err and "ready:" not in out


def test_drift_with_reconcile_patches_then_waits_for_ready(
    cp: ControlPlaneStandin, capsys: pytest.CaptureFixture[str]
) -> None:
    record = _live(cp, worker="w-old")
    cp.state.readiness = [[ev("bootstrapping"), ev("ready")]]
    code, out, err = _run(["--worker", "w-1", "--on-drift", "reconcile"], capsys)
    assert code == deploy.EXIT_READY, err
    assert cp.state.patches == [(record["id"], {"worker_id": "w-1"})]
    assert "Reconciling" in out and "rank group" in out and "ready: " in out


def test_same_spec_again_is_no_drift(cp: ControlPlaneStandin, capsys: pytest.CaptureFixture[str]) -> None:
    _live(cp, worker="w-1")
    code, _, err = _run(["--worker", "w-1"], capsys)
    assert code == deploy.EXIT_READY, err
    assert cp.state.patches == [] and cp.state.created == []


def test_stream_ends_without_ready_then_the_phase_asked_again_is_ready(
    cp: ControlPlaneStandin, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    made = _with_streams(monkeypatch, [[ev("scheduling"), ev("bootstrapping")]])
    cp.state.readiness = [[ev("ready", "serving")]]
    code, out, err = _run(["--worker", "w-1"], capsys)
    assert code == deploy.EXIT_READY, err
    assert made[0].opened == 2 and cp.state.readiness_connections == 1
    assert "ended without 'ready' (last phase: bootstrapping)" in out
    assert out.index("ended without") < out.index("ready: ")


def test_stream_ends_without_ready_and_never_becomes_ready(
    cp: ControlPlaneStandin, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    made = _with_streams(monkeypatch, [[ev("bootstrapping", "loading weights")]], repeat_last=True)
    code, out, err = _run(["--worker", "w-1", "--timeout-s", "1"], capsys)
    assert code == deploy.EXIT_NOT_READY
    assert made[0].opened >= 2  # asked again after each early end
    assert "not confirmed ready within 1 s (last phase: bootstrapping: loading weights)" in err
    assert "ready: " not in out


def test_error_phase_fails_the_deploy(cp: ControlPlaneStandin, capsys: pytest.CaptureFixture[str]) -> None:
    cp.state.readiness = [[ev("bootstrapping"), ev("error", "setup() raised: deepinfer_venv missing")]]
    code, out, err = _run(["--worker", "w-1"], capsys)
    assert code == deploy.EXIT_FAILED
    assert "deepinfer_venv missing" in err and "ready: " not in out


def test_a_silent_stream_times_out_on_our_deadline(
    cp: ControlPlaneStandin, capsys: pytest.CaptureFixture[str]
) -> None:
    # Each connection ends with no event: the SDK reconnects and its own timeout is never checked.
    cp.state.readiness = [[]]
    code, out, err = _run(["--worker", "w-1", "--timeout-s", "1"], capsys)
    assert code == deploy.EXIT_NOT_READY
    assert "not confirmed ready within 1 s (last phase: none reported)" in err
    assert "ready: " not in out


def test_secrets_are_masked_in_everything_printed(
    cp: ControlPlaneStandin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = {**deploy.MEASURED_CONFIG, "api_key": API_KEY,
           "env": {**deploy.MEASURED_CONFIG["env"], "HF_TOKEN": "hf_" + "h" * 34,
                   "OTHER": "ik_live_" + "x" * 20}}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    code, out, err = _run(["--config", str(path), "--dry-run", "--worker", "w-1"], capsys)
    assert code == 0
    printed = json.loads(out[:out.rindex("}") + 1])
    assert printed["config"]["api_key"] == "***" and printed["config"]["env"]["HF_TOKEN"] == "***"
    assert printed["config"]["env"]["OTHER"] == "***"
    assert printed["config"]["max_num_batched_tokens"] == 16384  # a count, not a secret
    # The control plane refuses the workload and echoes its body in the error: still masked.
    cp.state.reject_create = True
    code, out2, err2 = _run(["--config", str(path), "--worker", "w-1"], capsys)
    assert code == deploy.EXIT_FAILED and "deploy failed" in err2
    for text in (out, err, out2, err2):
        assert API_KEY not in text and "hf_hhhh" not in text and "ik_live_xxxx" not in text
    # A bad config's error (it names the value) is masked too.
    path.write_text(json.dumps({**cfg, "api_key": 12345678, "bogus_key": API_KEY}))
    code, out3, err3 = _run(["--config", str(path), "--dry-run"], capsys)
    assert code == deploy.EXIT_USAGE and API_KEY not in out3 + err3


def test_mask_secrets_keeps_non_secrets() -> None:
    masked = deploy.mask_secrets({"api_key_file": "/run/key", "prompt": "x",
                                  "nested": [{"client_secret": "s"}], "slug": "a", "empty_token": ""})
    assert masked == {"api_key_file": "***", "prompt": "x", "nested": [{"client_secret": "***"}], "slug": "a",
                      "empty_token": ""}


def test_this_sdk_does_not_send_the_config_and_deploy_says_so(
    cp: ControlPlaneStandin, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(["--worker", "w-1"], capsys)
    assert code == deploy.EXIT_READY
    sent = cp.state.created[0]
    assert "ep" not in (sent.get("config") or {})  # what inferencekey 0.260725.739 sends
    assert "does not send WorkloadSpec.config" in err


# -- publish: an identical republish ------------------------------------------------------------------
def test_republishing_the_same_archive_is_reported_as_already_published(
    cp: ControlPlaneStandin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = str(tmp_path / "dist")
    assert publish.main(["--version", "9.9.5", "--out-dir", out_dir]) == 0
    first = capsys.readouterr().out
    archive = str(Path(out_dir) / "deepinfer-v41-flash-9.9.5.tar.gz")
    cp.state.conflict_reports_sha256 = True
    assert publish.main(["--archive", archive]) == 0
    again = capsys.readouterr().out
    sha = first.split("sha256 ")[1].split()[0]
    assert f"already published: the control plane holds this very archive (sha256 {sha})" in again
    # A rebuild of the same version is other bytes: a conflict, with both sha256s.
    assert publish.main(["--version", "9.9.5", "--out-dir", str(tmp_path / "d2")]) == publish.EXIT_CONFLICT
    err = capsys.readouterr().err
    assert "different archive" in err and sha in err and "bump the version" in err


def test_republish_without_a_sha256_in_the_answer_says_both_cases(
    cp: ControlPlaneStandin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = str(tmp_path / "dist")
    assert publish.main(["--version", "9.9.6", "--out-dir", out_dir]) == 0
    capsys.readouterr()
    archive = str(Path(out_dir) / "deepinfer-v41-flash-9.9.6.tar.gz")
    assert publish.main(["--archive", archive]) == publish.EXIT_CONFLICT
    err = capsys.readouterr().err
    assert "did not say which archive" in err and "lost its response" in err and "bump the version" in err
