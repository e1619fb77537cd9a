"""publish.py and deploy.py against a local stand-in of the control plane (no network)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

import deploy
import publish
from tests.server.control_plane_standin import ControlPlaneStandin

TOKEN = "ik_sdk_standin"


@pytest.fixture()
def standin(monkeypatch: pytest.MonkeyPatch) -> ControlPlaneStandin:
    with ControlPlaneStandin(TOKEN) as cp:
        monkeypatch.setenv("INFERENCEKEY_BASE_URL", cp.base_url)
        monkeypatch.setenv("INFERENCEKEY_SDK_TOKEN", TOKEN)
        monkeypatch.setenv("IK_TENANT_ID", "tenant-1")
        yield cp


def _members(archive: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        return sorted(m.name for m in tar.getmembers())


def test_publish_uploads_code_only_then_409_on_same_version(
    standin: ControlPlaneStandin, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "dist")
    assert publish.main(["--version", "9.9.1", "--out-dir", out]) == 0
    printed = capsys.readouterr().out
    assert "published deepinfer-v41-flash 9.9.1" in printed
    names = _members(standin.state.published[("deepinfer-v41-flash", "9.9.1")])
    assert "deepinfer_backend.py" in names and "server/app.py" in names
    assert "manifest.json" in names and "BUILD_INFO.json" in names
    for name in names:
        assert not name.startswith(("tests/", "bench/", ".venv", "dist/", "docs/")), name
        assert "__pycache__" not in name and not name.endswith((".pyc", ".safetensors"))
    with tarfile.open(Path(out) / "deepinfer-v41-flash-9.9.1.tar.gz") as tar:
        manifest = json.load(tar.extractfile("manifest.json"))  # type: ignore[arg-type]
    assert manifest["entrypoint"] == "deepinfer_backend:DeepInferBackend"
    assert manifest["version"] == "9.9.1"

    assert publish.main(["--version", "9.9.1", "--out-dir", out]) == publish.EXIT_CONFLICT
    err = capsys.readouterr().err
    assert "409" in err and "already published" in err and "bump the version" in err


def test_publish_reports_bad_token_and_server_error(
    standin: ControlPlaneStandin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = str(tmp_path / "dist")
    monkeypatch.setenv("INFERENCEKEY_SDK_TOKEN", "ik_sdk_wrong")
    assert publish.main(["--version", "9.9.2", "--out-dir", out]) == publish.EXIT_AUTH
    assert "refused the SDK token" in capsys.readouterr().err
    monkeypatch.setenv("INFERENCEKEY_SDK_TOKEN", TOKEN)
    standin.state.fail_next = True
    assert publish.main(["--version", "9.9.2", "--out-dir", out]) == publish.EXIT_FAILED
    assert "500" in capsys.readouterr().err
    assert standin.state.published == {}
    # After the failure the same version still publishes (nothing half-registered).
    assert publish.main(["--version", "9.9.2", "--out-dir", out]) == 0


def test_publish_version_defaults_to_pyproject(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert publish.main(["--dry-run", "--out-dir", str(tmp_path)]) == 0
    assert f"packaged deepinfer-v41-flash {publish.project_version()}:" in capsys.readouterr().out


def test_publish_refuses_archive_with_secrets(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tar.gz"
    with tarfile.open(bad, "w:gz") as tar:
        for name, data in [("deepinfer_backend.py", b"x = 1\n"),
                           ("server/x.py", b"K='ik_live_" + b"a" * 24 + b"'")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        info = tarfile.TarInfo("tests/test_x.py")
        info.size = 0
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(publish.PublishError) as exc:
        publish.check_archive(str(bad))
    assert "server/x.py (contains a credential-like string)" in str(exc.value)
    assert "tests/test_x.py" in str(exc.value)


def test_deploy_validates_config_before_sending(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({**deploy.MEASURED_CONFIG, "l1_host_gib": 64}))
    assert deploy.main(["--config", str(cfg), "--dry-run"]) == 2
    assert "unknown config key 'l1_host_gib'" in capsys.readouterr().err
    assert deploy.main(["--dry-run", "--worker", "w-1"]) == 0
    spec = capsys.readouterr().out
    assert '"backend": "deepinfer-v41-flash"' in spec and '"worker_id": "w-1"' in spec


def test_deploy_reports_auth_failure_from_control_plane(
    standin: ControlPlaneStandin, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("INFERENCEKEY_SDK_TOKEN", "ik_sdk_wrong")
    monkeypatch.setenv("INFERENCEKEY_PROJECT", "proj")
    assert deploy.main(["--worker", "w-1"]) == 1
    err = capsys.readouterr().err
    assert "deploy failed" in err and "authentication failed" in err
    assert standin.state.requests and standin.state.requests[0].startswith("GET /api/projects/proj/")
