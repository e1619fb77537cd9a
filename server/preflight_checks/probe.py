"""Every read of the machine that preflight makes goes through a ``SystemProbe``.

``RealSystemProbe`` reads this machine (``/proc/mounts``, ``nvidia-smi``, psutil, cgroup files,
sockets, subprocesses); tests pass fakes. Nothing here decides whether a value is good or bad:
the checks do.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from cache.l2_io import DiskSpeed

NVIDIA_SMI_TIMEOUT_S = 15.0
_SMI_FIELDS_FULL = "index,uuid,name,compute_cap,memory.total,memory.used"
_SMI_FIELDS_OLD = "index,uuid,name,memory.total,memory.used"  # drivers before 510 lack compute_cap
_MIB = 1024 * 1024


@dataclass(slots=True, frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str
    compute_capability: tuple[int, int] | None  # None when the query could not tell
    memory_total_bytes: int | None
    memory_used_bytes: int | None


@dataclass(slots=True, frozen=True)
class GpuQuery:
    """What the GPU query saw. ``error`` says why ``gpus`` is empty (or incomplete)."""

    gpus: tuple[GpuInfo, ...]
    source: str  # "nvidia-smi", "torch", "none"
    error: str | None = None


@dataclass(slots=True, frozen=True)
class MemoryInfo:
    total_bytes: int
    available_bytes: int  # what the kernel could hand out without swapping (psutil)
    cgroup_limit_bytes: int | None = None  # container memory limit, None when unlimited/unknown
    cgroup_usage_bytes: int | None = None

    @property
    def usable_bytes(self) -> int:
        """Available to us: the host's available RAM, capped by the container's headroom."""
        if self.cgroup_limit_bytes is None:
            return self.available_bytes
        headroom = max(0, self.cgroup_limit_bytes - (self.cgroup_usage_bytes or 0))
        return min(self.available_bytes, headroom)


@dataclass(slots=True, frozen=True)
class ReadSample:
    num_bytes: int
    elapsed_s: float
    cache_dropped: bool  # True when the sampled range was evicted from the page cache first

    @property
    def bytes_per_s(self) -> float | None:
        return self.num_bytes / self.elapsed_s if self.elapsed_s > 0 and self.num_bytes else None


@dataclass(slots=True, frozen=True)
class RunResult:
    returncode: int | None  # None when the command could not start or timed out
    stdout: str
    stderr: str
    timed_out: bool = False
    error: str | None = None  # why it did not start (FileNotFoundError text, ...)


@dataclass(slots=True, frozen=True)
class RdmaInfo:
    dev_infiniband: bool  # /dev/infiniband exists (uverbs device nodes mapped into the container)
    verbs_devices: tuple[str, ...] = field(default_factory=tuple)  # /sys/class/infiniband entries

    @property
    def usable(self) -> bool:
        return self.dev_infiniband and bool(self.verbs_devices)


@dataclass(slots=True, frozen=True)
class ShmInfo:
    """The shared-memory filesystem the L1 pool file lives on (``statvfs``)."""

    total_bytes: int
    free_bytes: int


@dataclass(slots=True, frozen=True)
class DriverInfo:
    """The NVIDIA driver: its version and the newest CUDA it supports (None when not known)."""

    driver_version: str | None
    cuda_version: str | None
    source: str  # "nvidia-smi", "/proc/driver/nvidia/version", "none"
    error: str | None = None


@runtime_checkable
class SystemProbe(Protocol):
    def environ(self) -> Mapping[str, str]: ...
    def query_gpus(self) -> GpuQuery: ...
    def filesystem_type(self, path: Path) -> str | None: ...
    def disk_free_bytes(self, path: Path) -> int | None: ...
    def memory(self) -> MemoryInfo: ...
    def port_in_use(self, host: str, port: int) -> str | None:
        """None when ``port`` can be bound on ``host``, else the reason it cannot."""
        ...
    def read_sample(self, path: Path, offset: int, max_bytes: int, max_seconds: float) -> ReadSample: ...
    def disk_speed(self, directory: Path, num_bytes: int, max_seconds: float) -> DiskSpeed:
        """Sequential direct-I/O write then read of a scratch file in ``directory`` (deleted after)."""
        ...
    def run(self, argv: Sequence[str], timeout_s: float, env: Mapping[str, str] | None) -> RunResult: ...
    def rdma(self) -> RdmaInfo: ...
    def shm(self, path: Path) -> ShmInfo | None:
        """Size and free space of the filesystem at ``path`` (None when it does not exist)."""
        ...
    def memlock_limit(self) -> tuple[int | None, int | None]:
        """RLIMIT_MEMLOCK (soft, hard) in bytes; None for unlimited."""
        ...
    def nvidia_driver(self) -> DriverInfo: ...


_SMI_DRIVER_RE = re.compile(r"Driver Version:\s*([0-9][0-9.]*)")
_SMI_CUDA_RE = re.compile(r"CUDA Version:\s*([0-9][0-9.]*)")
_PROC_DRIVER_RE = re.compile(r"Kernel Module\s+(?:for \S+\s+)?([0-9]+\.[0-9.]+)")


def parse_nvidia_smi_banner(text: str) -> tuple[str | None, str | None]:
    """(driver version, CUDA version) from plain ``nvidia-smi`` output's header."""
    driver, cuda = _SMI_DRIVER_RE.search(text), _SMI_CUDA_RE.search(text)
    return (driver.group(1) if driver else None), (cuda.group(1) if cuda else None)


def parse_proc_driver_version(text: str) -> str | None:
    """The driver version from ``/proc/driver/nvidia/version``
    (``NVRM version: NVIDIA UNIX ... Kernel Module  595.91 ...``)."""
    match = _PROC_DRIVER_RE.search(text)
    return match.group(1) if match else None


def parse_mounts(text: str) -> list[tuple[str, str]]:
    """``/proc/mounts`` text -> [(mount point, fs type)], with octal escapes (``\\040``) decoded."""
    mounts = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            point = parts[1].encode().decode("unicode_escape") if "\\" in parts[1] else parts[1]
            mounts.append((point, parts[2]))
    return mounts


def fs_type_for(path: Path, mounts: Sequence[tuple[str, str]]) -> str | None:
    """The fs type of the longest mount point containing ``path`` (the last mount wins ties)."""
    target = str(path)
    best: tuple[int, str] | None = None
    for point, fstype in mounts:
        prefix = point.rstrip("/") + "/"
        inside = target == point or target.startswith(prefix) or point == "/"
        if inside and (best is None or len(point) >= best[0]):
            best = (len(point), fstype)
    return best[1] if best else None


def parse_nvidia_smi(text: str, has_compute_cap: bool) -> list[GpuInfo]:
    """Parse ``--format=csv,noheader,nounits`` output; '[N/A]' fields become None."""

    def num(value: str) -> int | None:
        try:
            return int(float(value)) * _MIB
        except ValueError:
            return None

    gpus = []
    for line in text.strip().splitlines():
        cols = [c.strip() for c in line.split(",")]
        if has_compute_cap and len(cols) == 6:
            index, uuid, name, cap, total, used = cols
        elif not has_compute_cap and len(cols) == 5:
            index, uuid, name, total, used = cols
            cap = ""
        else:
            raise ValueError(f"unexpected nvidia-smi line: {line!r}")
        cc: tuple[int, int] | None = None
        if "." in cap:
            major, minor = cap.split(".", 1)
            if major.isdigit() and minor.isdigit():
                cc = (int(major), int(minor))
        gpus.append(GpuInfo(int(index), uuid, name, cc, num(total), num(used)))
    return gpus


_TORCH_GPU_SCRIPT = """
import json, torch
gpus = []
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append([i, getattr(p, "uuid", ""), p.name, [p.major, p.minor], p.total_memory])
print(json.dumps(gpus))
"""


class RealSystemProbe:
    """Reads this machine. Subprocesses always run with a timeout, so no read can hang setup()."""

    def __init__(self, proc_mounts: Path = Path("/proc/mounts"), cgroup_root: Path = Path("/sys/fs/cgroup"),
                 proc_driver: Path = Path("/proc/driver/nvidia/version")):
        self._proc_mounts = proc_mounts
        self._cgroup_root = cgroup_root
        self._proc_driver = proc_driver

    def environ(self) -> Mapping[str, str]:
        return dict(os.environ)

    def run(self, argv: Sequence[str], timeout_s: float, env: Mapping[str, str] | None) -> RunResult:
        try:
            proc = subprocess.run(
                list(argv), capture_output=True, text=True, timeout=timeout_s,
                env=dict(env) if env is not None else None, stdin=subprocess.DEVNULL, check=False,
            )
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
            return RunResult(None, out, "", timed_out=True, error=f"timed out after {timeout_s:g} s")
        except OSError as exc:  # not found, not executable
            return RunResult(None, "", "", error=f"{type(exc).__name__}: {exc}")
        return RunResult(proc.returncode, proc.stdout, proc.stderr)

    def query_gpus(self) -> GpuQuery:
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return self._query_gpus_torch("nvidia-smi not found")
        for fields, has_cap in ((_SMI_FIELDS_FULL, True), (_SMI_FIELDS_OLD, False)):
            res = self.run(
                [smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits"], NVIDIA_SMI_TIMEOUT_S, None
            )
            if res.returncode == 0:
                try:
                    return GpuQuery(tuple(parse_nvidia_smi(res.stdout, has_cap)), "nvidia-smi")
                except ValueError as exc:
                    return GpuQuery((), "nvidia-smi", str(exc))
            if res.timed_out or res.error:
                return GpuQuery((), "nvidia-smi", f"nvidia-smi {res.error}")
        msg = (res.stderr or res.stdout).strip().splitlines()
        return GpuQuery((), "nvidia-smi", f"nvidia-smi failed: {msg[-1] if msg else res.returncode}")

    def _query_gpus_torch(self, why: str) -> GpuQuery:
        """Fallback without nvidia-smi: ask torch in a subprocess (no CUDA context in this one)."""
        res = self.run([sys.executable, "-c", _TORCH_GPU_SCRIPT], 60.0, None)
        if res.returncode != 0:
            return GpuQuery((), "none", f"{why}; torch not usable either")
        rows = json.loads(res.stdout.strip().splitlines()[-1])
        gpus = tuple(GpuInfo(i, u, n, (c[0], c[1]), t, None) for i, u, n, c, t in rows)
        return GpuQuery(gpus, "torch", None if gpus else f"{why}; torch sees no CUDA device")

    def filesystem_type(self, path: Path) -> str | None:
        real = Path(os.path.realpath(path))
        try:
            mounts = parse_mounts(self._proc_mounts.read_text())
        except OSError:
            mounts = []
        found = fs_type_for(real, mounts)
        if found is not None:
            return found
        res = self.run(["stat", "-f", "-c", "%T", str(real)], 10.0, None)  # no /proc (macOS, sandbox)
        return (res.stdout.strip() or None) if res.returncode == 0 else None

    def disk_free_bytes(self, path: Path) -> int | None:
        try:
            return shutil.disk_usage(path).free
        except OSError:
            return None

    def memory(self) -> MemoryInfo:
        import psutil

        vm = psutil.virtual_memory()
        limit, usage = self._cgroup_memory()
        return MemoryInfo(int(vm.total), int(vm.available), limit, usage)

    def _cgroup_memory(self) -> tuple[int | None, int | None]:
        """Container memory limit and usage (cgroup v2, then v1); (None, None) when unlimited."""
        candidates = [
            (self._cgroup_root / "memory.max", self._cgroup_root / "memory.current"),
            (self._cgroup_root / "memory" / "memory.limit_in_bytes",
             self._cgroup_root / "memory" / "memory.usage_in_bytes"),
        ]
        for limit_path, usage_path in candidates:
            try:
                raw = limit_path.read_text().strip()
            except OSError:
                continue
            if raw == "max" or not raw.isdigit() or int(raw) >= 1 << 60:  # v1 reports ~2^63 for none
                return None, None
            try:
                usage = int(usage_path.read_text().strip())
            except (OSError, ValueError):
                usage = None
            return int(raw), usage
        return None, None

    def port_in_use(self, host: str, port: int) -> str | None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            # SO_REUSEADDR like a real server: TIME_WAIT leftovers do not count, listeners do.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                return exc.strerror or str(exc)
        return None

    def read_sample(self, path: Path, offset: int, max_bytes: int, max_seconds: float) -> ReadSample:
        chunk_bytes = 8 * _MIB
        fd = os.open(path, os.O_RDONLY)
        try:
            dropped = False
            if hasattr(os, "posix_fadvise"):
                # Evict the range from the page cache so we time the disk, not RAM.
                try:
                    os.posix_fadvise(fd, offset, max_bytes, os.POSIX_FADV_DONTNEED)
                    dropped = True
                except OSError:
                    dropped = False
            os.lseek(fd, offset, os.SEEK_SET)
            num_bytes = 0
            start = time.perf_counter()
            elapsed = 0.0
            while num_bytes < max_bytes and elapsed < max_seconds:
                data = os.read(fd, min(chunk_bytes, max_bytes - num_bytes))
                if not data:
                    break
                num_bytes += len(data)
                elapsed = time.perf_counter() - start
            return ReadSample(num_bytes, time.perf_counter() - start, dropped)
        finally:
            os.close(fd)

    def disk_speed(self, directory: Path, num_bytes: int, max_seconds: float) -> DiskSpeed:
        from cache.l2_io import measure_sequential  # numpy: imported only when l2_dir is set

        return measure_sequential(str(directory), num_bytes, max_seconds=max_seconds)

    def rdma(self) -> RdmaInfo:
        sys_ib = Path("/sys/class/infiniband")
        try:
            devices = tuple(sorted(p.name for p in sys_ib.iterdir()))
        except OSError:
            devices = ()
        return RdmaInfo(Path("/dev/infiniband").is_dir(), devices)

    def shm(self, path: Path) -> ShmInfo | None:
        try:
            st = os.statvfs(path)
        except OSError:
            return None
        return ShmInfo(st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize)

    def memlock_limit(self) -> tuple[int | None, int | None]:
        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        return (None if soft == resource.RLIM_INFINITY else soft,
                None if hard == resource.RLIM_INFINITY else hard)

    def nvidia_driver(self) -> DriverInfo:
        smi = shutil.which("nvidia-smi")
        why = "nvidia-smi not found"
        if smi is not None:
            res = self.run([smi], NVIDIA_SMI_TIMEOUT_S, None)
            driver, cuda = parse_nvidia_smi_banner(res.stdout) if res.returncode == 0 else (None, None)
            if driver:
                return DriverInfo(driver, cuda, "nvidia-smi")
            why = f"nvidia-smi failed: {res.error or (res.stderr or res.stdout).strip()[-200:]}"
        try:
            text = self._proc_driver.read_text()
        except OSError:
            return DriverInfo(None, None, "none", f"{why}; no {self._proc_driver}")
        return DriverInfo(parse_proc_driver_version(text), None, str(self._proc_driver), why)
