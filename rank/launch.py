"""How a rank process is started: its interpreter, its environment and its rendezvous port.

``RankProcesses`` (``rank/rank_processes.py``) starts one ``python -m rank.worker`` per rank with
these. A rank gets only what it needs: no API keys, tokens or the backend's other settings, and
only the backend's code on ``PYTHONPATH`` (``tests/server/test_backend_import_order.py`` checks what a rank
may import).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from rank.config import RankConfig

BACKEND_ROOT = str(Path(__file__).resolve().parents[1])
ENV_PASSTHROUGH = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "TZ", "TMPDIR", "LD_LIBRARY_PATH", "CUDA_HOME")
KERNEL_CACHE_VARS = ("DG_JIT_CACHE_DIR", "EP_JIT_CACHE_DIR", "TILELANG_CACHE_DIR", "TRITON_CACHE_DIR")
ENV_PREFIXES = ("NCCL_", "DEEPINFER_")  # engine knobs an operator may set; never credentials
# Test and benchmark knobs of the rank worker (rank/rank_setup.py lists them), passed on when the
# backend's own environment sets them (the worker stand-in does; a rank logs a warning for the test ones).
TEST_ENV_PREFIX = "DIB_"
DEEPINFER_PORT_OFFSET = 50  # DeepInfer's rendezvous: tcp://MASTER_ADDR:(MASTER_PORT-50+engine_group_rank)


RUN_DIR_PREFIX = "dib-ranks-"
RUN_DIR_LOCK = ".lock"


def make_run_dir() -> tuple[str, int]:
    """A private directory for one rank group's sockets and config (``dib-ranks-*`` under the
    temp dir), and the descriptor of the lock its backend holds on it for as long as it runs.

    A backend killed outright cannot remove its directory, so this first removes every other one
    whose lock nobody holds: the kernel drops a dead process's ``flock``, whatever its pid
    namespace, so a live backend's directory is never taken for a stale one."""
    base = tempfile.gettempdir()
    for name in os.listdir(base):
        path = os.path.join(base, name)
        if name.startswith(RUN_DIR_PREFIX) and _unlocked(os.path.join(path, RUN_DIR_LOCK)):
            with contextlib.suppress(OSError):  # another backend may be removing it too
                shutil.rmtree(path)
    path = tempfile.mkdtemp(prefix=RUN_DIR_PREFIX)
    # Locked before it takes its name: another backend's scan never finds it unlocked.
    fd = os.open(os.path.join(path, RUN_DIR_LOCK + ".new"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new: nobody else can hold it
    os.rename(os.path.join(path, RUN_DIR_LOCK + ".new"), os.path.join(path, RUN_DIR_LOCK))
    return path, fd


def _unlocked(lock_path: str) -> bool:
    """Whether ``lock_path`` exists and no process holds its lock (a directory without one, as
    before this lock existed, is left alone)."""
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_python(config: RankConfig) -> str:
    """The ranks' interpreter: the DeepInfer venv's whenever one is configured (whatever the engine:
    on the worker the backend's own venv has no torch or pyzmq), else this process's."""
    return os.path.join(config.deepinfer_venv, "bin", "python") if config.deepinfer_venv else sys.executable


def master_port_for(config: RankConfig) -> int:
    """MASTER_PORT for a new epoch: the configured one (``deepinfer_env``, then ``env``), else a
    free one. DeepInfer rendezvouses at MASTER_PORT-50 (+engine_group_rank, 0 here), so for it the
    port that must be free is the one 50 below."""
    if config.master_port:
        return int(config.master_port)
    if config.engine != "deepinfer":
        return free_port()
    for _ in range(100):
        port = free_port() + DEEPINFER_PORT_OFFSET
        if port <= 65535:
            return port
    raise RuntimeError("no free TCP port for DeepInfer's rendezvous")


def threads_per_rank(config: RankConfig, num_ranks: int) -> int:
    """CPU threads per rank for the reference engine on the CPU (0: leave torch's default)."""
    if config.engine == "reference" and not config.uses_gpu:
        return max(1, (os.cpu_count() or 1) // num_ranks)
    return 0


def rank_env(config: RankConfig, num_ranks: int, rank: int, master_port: int,
             base: Mapping[str, str]) -> dict[str, str]:
    """Only what a rank needs: no API keys, tokens or the backend's other settings.

    Layers, later wins: a few of the backend's variables (``base``: ``ENV_PASSTHROUGH``, ``NCCL_*``,
    ``DEEPINFER_*``, ``KERNEL_CACHE_VARS``), the workload's ``env``, its ``deepinfer_env``, then
    what the group manages (PYTHONPATH, MASTER_*, CUDA_VISIBLE_DEVICES order). PYTHONPATH is
    the backend's code only: a rank imports nothing but our code, the standard library and
    the interpreter's own packages (torch, numpy, orjson, pyzmq: the DeepInfer venv's, see
    ``rank_python``), never the backend venv's.
    """
    env = {k: base[k] for k in ENV_PASSTHROUGH if k in base}
    env.update({k: v for k, v in base.items() if k.startswith((*ENV_PREFIXES, TEST_ENV_PREFIX))})
    for key in KERNEL_CACHE_VARS:
        value = config.env.get(key) or base.get(key)
        if value:
            env[key] = value
    env.update(config.env)
    env.update(config.deepinfer_env)
    env["PYTHONPATH"] = BACKEND_ROOT
    env["PYTHONUNBUFFERED"] = "1"
    env["MASTER_ADDR"] = "127.0.0.1"  # the rendezvous store binds it only (rank/rendezvous.py)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # Gloo's pair sockets on loopback unless the deployment says
    env["MASTER_PORT"] = str(master_port)
    if config.uses_gpu:
        listed = config.env.get("CUDA_VISIBLE_DEVICES") or base.get("CUDA_VISIBLE_DEVICES") or ""
        gpus = [g.strip() for g in listed.split(",") if g.strip()] or [str(i) for i in range(num_ranks)]
        own = gpus[rank % len(gpus)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join([own] + [g for g in gpus if g != own])
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        threads = threads_per_rank(config, num_ranks)
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
    return env


def worker_argv(python: str, config: RankConfig, rank: int, num_ranks: int, *, config_path: str,
                cmd_addr: str, out_addr: str, channel_addr: str, master_port: int, host_pool_path: str,
                host_pool_bytes: int, parent_pid: int) -> list[str]:
    """The command line of rank process ``rank`` (``python -m rank.worker``, see its ``parse_args``);
    the rank exits as soon as ``parent_pid`` (the supervisor) is no longer its parent."""
    args = [
        python, "-m", "rank.worker", "--rank", str(rank), "--world-size", str(num_ranks),
        "--config", config_path, "--cmd-addr", cmd_addr, "--out-addr", out_addr,
        "--channel-addr", channel_addr,
        "--master-port", str(master_port), "--threads", str(threads_per_rank(config, num_ranks)),
        "--host-pool-path", host_pool_path, "--host-pool-bytes", str(host_pool_bytes),
        "--parent-pid", str(parent_pid),
    ]
    if config.engine == "deepinfer":
        args += ["--min-python", "3.12"]
    return args
