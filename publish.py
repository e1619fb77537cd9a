"""Package the backend (code only) and publish it to InferenceKey as a custom backend.

    python publish.py                       # version from pyproject.toml, publish
    python publish.py --version 0.2.0       # explicit version
    python publish.py --dry-run             # package and list the archive, upload nothing
    python publish.py --archive dist/deepinfer-v41-flash-0.2.0.tar.gz   # upload a built archive again

Environment: ``IK_TENANT_ID`` and ``INFERENCEKEY_SDK_TOKEN`` (``ik_sdk_`` with workload:write);
``INFERENCEKEY_BASE_URL`` overrides the control plane (tests point it at a local stand-in).

The archive holds only the backend's code: ``deepinfer_backend.py``, the ``server``, ``protocol``,
``cache`` and ``rank`` packages, ``requirements.txt`` and a ``BUILD_INFO.json`` stamp. The
archive's ``requirements.txt`` is ``requirements.lock``: every package of the worker's venv at
the exact version the worker stand-in installs (the SDK's worker builds the venv from that one
file; ``requirements.txt`` in the repository keeps the ranges, ``scripts/lock_requirements.sh``
regenerates the lock). Tests, the
test stand-ins (``standins/``: the fake DeepInfer forward, the scripted model), benchmarks,
caches, weights, virtual environments, ``.env`` files and anything token-like are excluded, and
the finished archive is listed and checked again before anything is uploaded.

A version is published once: the control plane answers a second publish of the same slug and
version with 409. Where its answer names the stored archive's sha256 and it is this archive's
(the same file sent again, e.g. with ``--archive`` after a lost response), that is reported as
already published and exits 0; a different sha256 means other code holds the version (bump
``--version`` or pyproject's version); without a sha256 the message says both and prints ours.
Archives are not byte-reproducible (the SDK's gzip and tar headers carry the build time), so
re-sending the same upload means ``--archive`` with the file from ``dist/``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent
DEFAULT_NAME = "deepinfer-v41-flash"
ENTRYPOINT = "deepinfer_backend:DeepInferBackend"
CODE_MODULES = ("deepinfer_backend.py",)
CODE_PACKAGES = ("server", "protocol", "cache", "rank")
# Development-only packages next to the product: never in an archive (checked on the archive too).
NON_PRODUCT_PACKAGES = ("standins", "bench", "tests")
# Data files a package may legitimately carry next to its code.
CODE_SUFFIXES = frozenset({".py", ".json", ".txt", ".jinja", ".md"})
EXCLUDED_DIR_NAMES = frozenset(
    {"tests", "test", "__pycache__", ".venv", "venv", ".git", "dist", "build", ".cache",
     ".pytest_cache", ".hypothesis", "node_modules", "weights", "checkpoints"}
)
# Names that must never reach an archive: env files, weights, compiled files, tests.
FORBIDDEN_NAME_RE = re.compile(
    r"(^\.env)|(\.(safetensors|bin|pt|pth|gguf|ckpt|npy|npz|pyc|so)$)"
    r"|(^test_.*\.py$)|(_test\.py$)|(^conftest\.py$)",
    re.IGNORECASE,
)
# Data (non-.py) files whose names suggest a secret.
SECRET_NAME_RE = re.compile(r"token|secret|credential|password|api[_-]?key", re.IGNORECASE)
# Content that looks like a real InferenceKey or API credential (placeholders like ik_live_... pass):
# InferenceKey tokens, OpenAI (sk-, sk-proj-) and Anthropic (sk-ant-api03-) keys, Hugging Face and
# GitHub tokens, AWS access key ids, PEM private keys.
SECRET_CONTENT_RE = re.compile(
    rb"(ik_(sdk|live)_[A-Za-z0-9]{16,})|(sk-[A-Za-z0-9][A-Za-z0-9_-]{19,})|(hf_[A-Za-z0-9]{30,})"
    rb"|(gh[pousr]_[A-Za-z0-9]{36,})|(AKIA[0-9A-Z]{16})|(-----BEGIN [A-Z ]*PRIVATE KEY-----)"
)
BUILD_INFO_NAME = "BUILD_INFO.json"
LOCK_NAME = "requirements.lock"
SHA256_RE = re.compile(r"\b[0-9a-f]{64}\b")
EXIT_CONFLICT = 3
EXIT_AUTH = 4
EXIT_FAILED = 5


class PublishError(RuntimeError):
    """A problem that stops the publish, with a message meant for the operator."""


@dataclass(frozen=True, slots=True)
class StagedFile:
    source: Path
    arcname: str


def project_version(pyproject: Path = REPO_ROOT / "pyproject.toml") -> str:
    """``[project].version`` of pyproject.toml (tomllib on 3.11+, a strict regex on 3.10)."""
    text = pyproject.read_text(encoding="utf-8")
    try:
        import tomllib

        return str(tomllib.loads(text)["project"]["version"])
    except ModuleNotFoundError:  # Python 3.10
        match = re.search(r'^\[project\][^\[]*?^version\s*=\s*"([^"]+)"', text, re.MULTILINE | re.DOTALL)
        if not match:
            raise PublishError(f"no [project].version in {pyproject}") from None
        return match.group(1)


def is_code_file(rel: Path) -> bool:
    if any(part in EXCLUDED_DIR_NAMES or part.startswith(".") for part in rel.parts[:-1]):
        return False
    name = rel.name
    if rel.suffix != ".py" and SECRET_NAME_RE.search(name):
        return False
    return rel.suffix in CODE_SUFFIXES and not FORBIDDEN_NAME_RE.search(name)


def collect_code(root: Path = REPO_ROOT) -> list[StagedFile]:
    """The files that make up the backend at runtime, in a deterministic order."""
    files = [StagedFile(root / name, name) for name in CODE_MODULES]
    for package in CODE_PACKAGES:
        for path in sorted((root / package).rglob("*")):
            rel = path.relative_to(root)
            if path.is_file() and is_code_file(rel):
                files.append(StagedFile(path, rel.as_posix()))
    missing = [f.arcname for f in files if not f.source.is_file()]
    if missing:
        raise PublishError(f"missing backend files: {', '.join(missing)}")
    return files


def git_commit(root: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def stage(files: list[StagedFile], version: str, root: Path, staging: Path) -> None:
    for item in files:
        dest = staging / item.arcname
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(item.source, dest)
    info = {"version": version, "git_commit": git_commit(root), "built_at_unix_s": int(time.time())}
    (staging / BUILD_INFO_NAME).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def check_archive(path: str) -> list[str]:
    """List the archive and refuse anything that is not code (the last line of defence)."""
    bad: list[str] = []
    with tarfile.open(path, "r:gz") as tar:
        members = tar.getmembers()
        names = sorted(m.name for m in members)
        for member in members:
            fh = tar.extractfile(member) if member.isfile() else None
            if fh is not None and SECRET_CONTENT_RE.search(fh.read()):
                bad.append(f"{member.name} (contains a credential-like string)")
    bad += [n for n in names if n not in ("manifest.json", "requirements.txt", BUILD_INFO_NAME)
            and not is_code_file(Path(n))]
    bad += [f"{n} (development only)" for n in names if n.split("/")[0] in NON_PRODUCT_PACKAGES]
    if bad:
        raise PublishError(f"archive {path} holds files that are not backend code: {bad}")
    if "deepinfer_backend.py" not in names:
        raise PublishError(f"archive {path} lacks deepinfer_backend.py")
    return names


def build_package(version: str, name: str, out_dir: str, requires_python: str,
                  root: Path = REPO_ROOT) -> tuple[object, list[str]]:
    """Stage the code in a temporary directory, package it with the SDK and check the archive."""
    from inferencekey.backend import package_backend

    files = collect_code(root)
    with tempfile.TemporaryDirectory(prefix="deepinfer-pkg-") as tmp:
        staging = Path(tmp) / "src"
        staging.mkdir()
        stage(files, version, root, staging)
        kwargs: dict[str, object] = dict(
            src=str(staging), entrypoint=ENTRYPOINT, requirements=str(root / LOCK_NAME),
            name=name, version=version, task_type="text2text", requires_python=requires_python,
            out_dir=out_dir, description="DeepSeek-V4.1-Flash on DeepInfer with L0/L1 prefix cache",
        )
        # SDK 0.260725.739 has no ``api`` keyword; newer releases take it (the seed guide uses it).
        if "api" in inspect.signature(package_backend).parameters:
            kwargs["api"] = "openai-chat"
        pkg = package_backend(**kwargs)
    return pkg, check_archive(pkg.path)


def conflict_message(detail: str, sha256: str) -> tuple[int, str]:
    """Exit status and message for a 409: identical archive (0), other code, or unknown."""
    theirs = SHA256_RE.findall(detail)
    if sha256 in theirs:
        return 0, (f"already published: the control plane holds this very archive (sha256 {sha256}); "
                   "nothing to do (deploy it as is)")
    if theirs:
        return EXIT_CONFLICT, (f"this slug and version are already published with a different archive "
                               f"(theirs sha256 {theirs[0]}, ours {sha256}; 409 Conflict: {detail}). "
                               "Versions are immutable: bump the version (--version or pyproject.toml) "
                               "and publish again.")
    return EXIT_CONFLICT, (f"this slug and version are already published (409 Conflict: {detail}); the "
                           f"control plane did not say which archive it holds (ours: sha256 {sha256}). If "
                           "an earlier publish of this same archive lost its response, it is published: "
                           "deploy it. If the code changed, bump the version (--version or "
                           "pyproject.toml) and publish again.")


def publish(tenant_id: str, path: str, token: str, base_url: str | None, sha256: str = "") -> dict:
    from inferencekey import publish_custom_backend
    from inferencekey.errors import ApiError, AuthError, PermissionDenied, ValidationError

    try:
        return publish_custom_backend(tenant_id, path, token=token, base_url=base_url)
    except (AuthError, PermissionDenied) as exc:
        raise PublishRejected(EXIT_AUTH, f"the control plane refused the SDK token ({exc}); "
                              "check INFERENCEKEY_SDK_TOKEN (ik_sdk_ with workload:write) "
                              "and IK_TENANT_ID") from None
    except ValidationError as exc:
        raise PublishRejected(EXIT_FAILED, f"the control plane rejected the package: {exc}") from None
    except ApiError as exc:
        if str(exc).startswith("409"):
            code, message = conflict_message(str(exc), sha256)
            raise PublishRejected(code, message) from None
        raise PublishRejected(EXIT_FAILED, f"upload failed: {exc}") from None


class PublishRejected(PublishError):
    def __init__(self, exit_code: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python publish.py", description=__doc__.split("\n")[0])
    parser.add_argument("--version", default=None, help="backend version (default: pyproject.toml)")
    parser.add_argument("--name", default=DEFAULT_NAME, help="backend name and slug")
    parser.add_argument("--out-dir", default=str(REPO_ROOT / "dist"))
    parser.add_argument("--requires-python", default="3.12",
                        help="Python of the worker venv; must match the DeepInfer venv (3.12)")
    parser.add_argument("--tenant", default=os.environ.get("IK_TENANT_ID"))
    parser.add_argument("--base-url", default=None, help="default: $INFERENCEKEY_BASE_URL or the SDK's")
    parser.add_argument("--dry-run", action="store_true", help="package and list; do not upload")
    parser.add_argument("--archive", default=None,
                        help="upload this already built archive (same bytes, same sha256) instead of "
                        "packaging the checkout; name and version come from its manifest")
    args = parser.parse_args(argv)

    token = os.environ.get("INFERENCEKEY_SDK_TOKEN")
    try:
        if args.archive:
            pkg, names = existing_package(args.archive)
            version = str(pkg.manifest.get("version"))
            print(f"archive {pkg.path}: {pkg.manifest.get('slug') or pkg.manifest.get('name')} {version} "
                  f"sha256 {pkg.sha256} {pkg.size_bytes / 1024:.0f} KiB, {len(names)} files")
        else:
            version = args.version or project_version()
            pkg, names = build_package(version, args.name, args.out_dir, args.requires_python)
            print(f"packaged {args.name} {version}: {pkg.path} sha256 {pkg.sha256} "
                  f"{pkg.size_bytes / 1024:.0f} KiB, {len(names)} files")
        for name in names:
            print(f"  {name}")
        if args.dry_run:
            print("dry run: nothing uploaded")
            return 0
        if not args.tenant or not token:
            raise PublishRejected(EXIT_AUTH, "set IK_TENANT_ID (or --tenant) and INFERENCEKEY_SDK_TOKEN")
        record = publish(args.tenant, pkg.path, token, args.base_url, pkg.sha256)
    except PublishRejected as exc:
        if exc.exit_code == 0:
            print(_masked(str(exc), token))
            return 0
        print(f"publish failed: {_masked(str(exc), token)}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:  # noqa: BLE001 - one clear line for the operator, not a traceback
        print(f"publish failed: {type(exc).__name__}: {_masked(str(exc), token)}", file=sys.stderr)
        return EXIT_FAILED
    stored = record.get("sha256")
    check = "" if stored in (None, pkg.sha256) else f"; WARNING: the control plane stored sha256 {stored}"
    print(f"published {record.get('slug', args.name)} {record.get('version', version)} "
          f"(id {record.get('id', '?')}, sha256 {pkg.sha256}{check})")
    return 0


def _masked(text: str, token: str | None) -> str:
    """Operator-facing text with the SDK token and credential-shaped strings masked."""
    if token:
        text = text.replace(token, "***")
    return re.sub(SECRET_CONTENT_RE.pattern.decode(), "***", text)


@dataclass(frozen=True, slots=True)
class ExistingPackage:
    path: str
    sha256: str
    size_bytes: int
    manifest: dict


def existing_package(path: str) -> tuple[ExistingPackage, list[str]]:
    """An archive built before (``dist/``), checked like a fresh one."""
    import hashlib

    from inferencekey.backend.packaging import read_manifest_from_archive

    if not Path(path).is_file():
        raise PublishRejected(EXIT_FAILED, f"--archive {path}: no such file")
    names = check_archive(path)
    data = Path(path).read_bytes()
    return ExistingPackage(path, hashlib.sha256(data).hexdigest(), len(data),
                           read_manifest_from_archive(path)), names


if __name__ == "__main__":
    sys.exit(main())
