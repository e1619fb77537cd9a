"""Loopback by default, the API key (constant-time, never logged), no prompts or
outputs in info logs, rank processes without secrets, and publish.py packaging nothing but code."""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import publish
from protocol.errors import AuthenticationError
from server import auth as auth_module
from server.auth import ApiKeyCheck
from server.config import WorkloadConfig, load_config
from tests.support.runtime_thread import RuntimeThread

REPO = Path(__file__).resolve().parents[2]
KEY = "sk-reliability-SECRET-7f3a9c1e55d04b2a"
WRONG_KEY = "sk-reliability-WRONG-0000111122223333"
PROMPT_MARK = "PROMPTMARK-4b1d9e"
REPLY_MARK = "REPLYMARK-c0ffee"


# ------------------------------------------------------------------ loopback by default

def test_default_bind_is_loopback() -> None:
    assert WorkloadConfig().host == "127.0.0.1"
    from deepinfer_backend import _cli_config

    args = argparse.Namespace(config=None, engine=None, script=None, host=None, port=None, ranks=None,
                              api_key=None, reference_model=None)
    assert _cli_config(args).host == "127.0.0.1"


# ------------------------------------------------------------------ one server for the log checks

@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RuntimeThread]:
    script = tmp_path_factory.mktemp("sec") / "script.json"
    script.write_text(json.dumps({"description": "sec", "replies": [
        {"name": "mark", "reasoning": f"thinking {REPLY_MARK}", "text": f"answer {REPLY_MARK}"}]}))
    config = {"engine": "scripted", "script_file": str(script), "ep": 1, "block_size": 16,
              "reference_num_blocks": 256, "max_model_len": 4096, "l1_cache": False, "port": 0,
              "api_key": KEY}
    with RuntimeThread(config, rank_mode="local") as rt:
        yield rt


def test_server_socket_is_bound_to_loopback(server: RuntimeThread) -> None:
    sock = server.runtime._socket
    assert sock is not None and sock.getsockname()[0] == "127.0.0.1"


def test_api_key_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth_module.hmac, "compare_digest", spy)
    check = ApiKeyCheck(KEY)
    check.check(KEY, None)
    check.check(None, f"Bearer {KEY}")
    with pytest.raises(AuthenticationError):
        check.check(WRONG_KEY, None)
    assert len(calls) == 3 and all(KEY.encode() in pair for pair in calls)


def _exercise(url: str) -> list[int]:
    """Requests that pass and fail auth, streaming and not, on every authenticated route."""
    statuses = []
    chat = {"model": "default", "max_tokens": 32,
            "messages": [{"role": "user", "content": f"hello {PROMPT_MARK}"}]}
    oai = {"model": "default", "max_tokens": 32,
           "messages": [{"role": "user", "content": f"hello {PROMPT_MARK}"}]}
    with httpx.Client(base_url=url, timeout=60) as c:
        for headers in ({"x-api-key": KEY}, {"authorization": f"Bearer {KEY}"}, {"x-api-key": WRONG_KEY},
                        {"authorization": f"Bearer {WRONG_KEY}"},
                        {"x-api-key": KEY, "authorization": f"Bearer {WRONG_KEY}"},
                        {"authorization": f"Basic {KEY}"}, {}):
            statuses.append(c.post("/v1/messages", json=chat, headers=headers).status_code)
            statuses.append(c.post("/v1/messages", json={**chat, "stream": True},
                                   headers=headers).status_code)
            statuses.append(c.post("/v1/chat/completions", json={**oai, "stream": True},
                                   headers=headers).status_code)
            statuses.append(c.post("/v1/messages/count_tokens",
                                   json={"model": "default", "messages": chat["messages"]},
                                   headers=headers).status_code)
            statuses.append(c.get("/v1/models", headers=headers).status_code)
        for path in ("/healthz", "/metrics", "/"):
            body = c.get(path).text
            assert KEY not in body and PROMPT_MARK not in body and REPLY_MARK not in body
    return statuses


def _all_log_text(records: list[logging.LogRecord]) -> str:
    parts = []
    for r in records:
        parts.append(r.getMessage())
        parts.append(repr(r.args))
        if r.exc_info:
            parts.append(logging.Formatter().formatException(r.exc_info))
    return "\n".join(parts)


def test_api_key_never_logged_even_at_debug(server: RuntimeThread, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    statuses = _exercise(server.url)
    assert statuses.count(200) >= 8 and statuses.count(401) >= 10, statuses
    text = _all_log_text(caplog.records)
    assert len(caplog.records) > 0
    assert KEY not in text
    assert WRONG_KEY not in text  # a wrong key may be someone's real key elsewhere
    print(f"\n{len(caplog.records)} log records at DEBUG+, none holds a key")


def test_prompts_and_outputs_never_logged_at_info(server: RuntimeThread,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    _exercise(server.url)
    info = [r for r in caplog.records if r.levelno >= logging.INFO]
    text = _all_log_text(info)
    assert info, "no info records: the test would prove nothing"
    assert PROMPT_MARK not in text and REPLY_MARK not in text
    print(f"\n{len(info)} log records at INFO+, no prompt or output text in them")


# ------------------------------------------------------------------ the environment of a rank process

SECRETS = {
    "INFERENCEKEY_SDK_TOKEN": "ik_sdk_SECRETSECRETSECRET0123456789",
    "ANTHROPIC_API_KEY": "sk-ant-api03-SECRETSECRET-0123456789",
    "ANTHROPIC_AUTH_TOKEN": "SECRET-auth-token-0123456789",
    "OPENAI_API_KEY": "sk-SECRETSECRETSECRET0123456789",
    "HF_TOKEN": "hf_SECRETSECRETSECRET0123456789",
    "AWS_SECRET_ACCESS_KEY": "SECRET/aws/0123456789",
    "IK_TENANT_ID": "tenant-SECRET-0123456789",
    "api_key": "SECRET-lowercase-0123456789",
}


@pytest.mark.timeout(600)
def test_rank_processes_get_only_what_they_need(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    from rank.group import RankGroup

    config = load_config({"engine": "reference", "reference_model": "null", "ep": 2, "block_size": 16,
                          "reference_num_blocks": 64, "l1_cache": False, "api_key": KEY,
                          "max_model_len": 1024})

    async def run() -> tuple[list[dict[str, str]], list[str], list[str]]:
        group = RankGroup(config.rank_config())
        await group.start()
        try:
            envs, cmdlines, files = [], [], []
            for pid in group.pids():
                raw = Path(f"/proc/{pid}/environ").read_bytes()
                envs.append(dict(kv.split("=", 1) for kv in raw.decode().split("\0") if "=" in kv))
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
                cmdlines.append(" ".join(cmd))
                conf = cmd[cmd.index("--config") + 1]
                assert os.stat(conf).st_mode & 0o077 == 0, "rank config readable by others"
                files.append(Path(conf).read_text())
            return envs, cmdlines, files
        finally:
            await group.close()

    envs, cmdlines, files = asyncio.run(run())
    assert len(envs) == 2
    for env, cmdline, conf in zip(envs, cmdlines, files):
        print(f"\nrank env keys: {sorted(env)}")
        for name, value in SECRETS.items():
            assert name not in env, f"{name} reached a rank process"
            assert value not in "\n".join(env.values()) and value not in cmdline
        assert KEY not in "\n".join(env.values()) and KEY not in cmdline and KEY not in conf
        assert "api_key" not in json.loads(conf)  # RankConfig has no such field


# ------------------------------------------------------------------ publish.py

def _copy_backend(dst: Path) -> None:
    for name in ("deepinfer_backend.py", "requirements.txt", "requirements.lock", "pyproject.toml"):
        shutil.copy2(REPO / name, dst / name)
    for package in publish.CODE_PACKAGES:
        shutil.copytree(REPO / package, dst / package, ignore=shutil.ignore_patterns("__pycache__"))


def _seed_secret_files(root: Path) -> list[str]:
    seeded = {
        ".env": "INFERENCEKEY_SDK_TOKEN=ik_sdk_" + "A" * 32,
        "server/.env": "ANTHROPIC_API_KEY=x",
        "server/.env.production": "X=1",
        "rank/token.txt": "tok",
        "cache/secrets.json": "{}",
        "protocol/api_key.txt": "k",
        "server/credentials.json": "{}",
        "rank/id_rsa": "-----BEGIN OPENSSH PRIVATE KEY-----",
        "rank/key.pem": "-----BEGIN PRIVATE KEY-----",
        "server/tests/test_leak.py": "x = 1",
        "server/conftest.py": "x = 1",
        "rank/weights.safetensors": "xx",
        "cache/.git/config": "[core]",
        "tests/test_top.py": "x = 1",
        "bench/tool.py": "x = 1",
        "docs/notes.md": "notes",
        ".venv/lib/site.py": "x = 1",
        "dist/old.tar.gz": "x",
    }
    for rel, text in seeded.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return sorted(seeded)


def _build(root: Path, out: Path) -> list[str]:
    _, names = publish.build_package("0.0.1", "reliability-test", str(out), "3.12", root=root)
    return names


def test_publish_packages_only_backend_code(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    root.mkdir()
    _copy_backend(root)
    seeded = _seed_secret_files(root)
    out = tmp_path / "dist"
    names = _build(root, out)
    archives = list(out.glob("*.tar.gz"))
    assert len(archives) == 1
    with tarfile.open(archives[0]) as tar:
        members = tar.getnames()
        blob = b"".join(tar.extractfile(m).read() for m in tar.getmembers() if m.isfile())
    print(f"\narchive: {len(members)} files")
    allowed_top = {"deepinfer_backend.py", "requirements.txt", "manifest.json", publish.BUILD_INFO_NAME}
    for name in members:
        parts = Path(name).parts
        assert name in allowed_top or (parts[0] in publish.CODE_PACKAGES
                                       and Path(name).suffix in publish.CODE_SUFFIXES), name
        assert not any(p.startswith(".") or p in ("tests", "__pycache__") for p in parts), name
    for rel in seeded:
        assert rel not in members, f"{rel} was packaged"
    assert b"ik_sdk_" + b"A" * 32 not in blob and b"PRIVATE KEY" not in blob
    assert set(names) == set(members)


@pytest.mark.parametrize("where,secret", [
    ("server/settings.json", '{"token": "ik_sdk_' + "B" * 32 + '"}'),
    ("rank/defaults.py", 'KEY = "sk-' + "C" * 40 + '"'),
    ("cache/notes.md", "ANTHROPIC_API_KEY=sk-ant-api03-" + "D" * 40 + "-" + "E" * 20 + "AA"),
    ("protocol/hub.txt", "hf_" + "F" * 34),
])
def test_publish_refuses_code_files_holding_credentials(tmp_path: Path, where: str, secret: str) -> None:
    root = tmp_path / "tree"
    root.mkdir()
    _copy_backend(root)
    (root / where).write_text(secret)
    with pytest.raises(publish.PublishError, match="credential"):
        _build(root, tmp_path / "dist")
