"""What each process of the worker may import, and from which venv.

The backend process: on the worker its venv holds requirements.txt and the SDK only; torch, numpy,
orjson, pyzmq and tokenizers come from the DeepInfer venv. A module that ``deepinfer_backend`` or
``setup()`` imports before ``add_venv_site_packages`` has put that venv on ``sys.path``, and that
requirements.txt does not provide, kills the workload in "Preparing backend"
(``BackendSetupError: No module named 'orjson'``, found by the worker stand-in). Here such an
import fails at once: the subprocess can import only what the requirements (and their
dependencies) provide until that point.

The rank processes run the DeepInfer venv's interpreter with only the backend's code on
PYTHONPATH: they may import what the DeepInfer venv's pins provide (torch, numpy, orjson, pyzmq,
tokenizers and their dependencies), nothing from requirements.txt.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import numpy as np
import pytest

from rank.engine import EngineRequest, FinishReason, SamplingParams
from rank.group import RankGroup
from server.config import WorkloadConfig
from tests.server.import_guard import REPO, allowed_modules, guarded_python, requirement_lines, run_guarded

SDK_PIN = "inferencekey==0.260725.739"
BACKEND_VENV = requirement_lines(REPO / "requirements.txt") + [SDK_PIN]
DEEPINFER_VENV = requirement_lines(REPO / "scripts" / "deepinfer-pins.txt") + ["torch"]

_SETUP_UNTIL_VENV = r"""
import deepinfer_backend
from inferencekey.backend import BackendContext

class VenvAdded(Exception):
    pass

def add_venv_site_packages(venv):  # the point where setup() puts the DeepInfer venv on sys.path
    guard.release()
    raise VenvAdded(venv)

deepinfer_backend.add_venv_site_packages = add_venv_site_packages
config = {"engine": "reference", "ep": 2, "deepinfer_venv": "/workspace/di-venv"}
try:
    deepinfer_backend.DeepInferBackend().setup(BackendContext(config=config, port=0))
except VenvAdded:
    print("REACHED the DeepInfer venv with", sorted(m for m in sys.modules if "." not in m
          and m not in sys.stdlib_module_names and not m.startswith("_")))
"""


def test_guard_blocks_what_requirements_do_not_provide() -> None:
    """The guard itself: orjson and numpy are not in the backend venv, pydantic is."""
    allowed = allowed_modules(BACKEND_VENV)
    assert {"pydantic", "inferencekey", "uvicorn", "xxhash"} <= allowed
    assert not {"orjson", "numpy", "zmq", "torch", "tokenizers"} & allowed
    res = run_guarded("import pydantic\nimport orjson\n", allowed, "requirements.txt")
    assert res.returncode != 0 and "import of 'orjson' blocked" in res.stderr, res.stderr


def test_setup_imports_only_requirements_before_the_deepinfer_venv() -> None:
    """Red on the old setup(), which imported server.runtime (orjson, numpy) first."""
    res = run_guarded(_SETUP_UNTIL_VENV, allowed_modules(BACKEND_VENV), "requirements.txt + the SDK")
    if "REACHED" not in res.stdout:
        pytest.fail("setup() imported a module that requirements.txt does not provide before adding the "
                    f"DeepInfer venv:\n{res.stderr[-3000:]}")


@pytest.mark.parametrize("argv", [["serve", "--engine", "reference"]])
def test_cli_adds_the_venv_before_runtime_imports(argv: list[str]) -> None:
    """``python -m deepinfer_backend serve`` on a worker: the same rule."""
    code = r"""
import deepinfer_backend
class VenvAdded(Exception):
    pass
def add_venv_site_packages(venv):
    guard.release()
    raise VenvAdded(venv)
deepinfer_backend.add_venv_site_packages = add_venv_site_packages
try:
    deepinfer_backend.main(%r)
except VenvAdded:
    print("REACHED")
""" % (argv,)
    res = run_guarded(code, allowed_modules(BACKEND_VENV), "requirements.txt + the SDK")
    assert "REACHED" in res.stdout, res.stderr[-3000:]


def test_preflight_runs_on_the_requirements_alone(tmp_path: Path) -> None:
    """``python -m deepinfer_backend preflight`` needs nothing from the DeepInfer venv: with the venv
    missing it still runs every check (the missing venv is one finding among them)."""
    cfg = tmp_path / "workload.json"
    cfg.write_text(json.dumps({"engine": "deepinfer", "ep": 2, "deepinfer_venv": str(tmp_path / "no-venv"),
                               "model_dir": str(tmp_path / "no-model"), "port": 0}))
    code = "import deepinfer_backend\nprint('EXIT', deepinfer_backend.main(%r))\n" % (
        ["preflight", "--config", str(cfg), "--read-sample-mb", "0", "--skip", "gpu", "--skip", "nccl_env"],)
    res = run_guarded(code, allowed_modules(BACKEND_VENV), "requirements.txt + the SDK")
    assert "EXIT 1" in res.stdout, res.stderr[-3000:]
    assert "deepinfer_venv" in res.stdout and "no-venv does not exist" in res.stdout
    assert "model_dir" in res.stdout and "memlock" in res.stdout


@pytest.mark.timeout(240)
@pytest.mark.parametrize("engine", ["reference", "deepinfer"])
def test_rank_processes_need_only_the_deepinfer_venv(tmp_path: Path, engine: str) -> None:
    """Two real rank processes under an interpreter that has only the DeepInfer venv's packages
    (pydantic, from requirements.txt, is blocked: the rank reads the config without it)."""
    allowed = allowed_modules(DEEPINFER_VENV)
    assert "pydantic" not in allowed and {"torch", "numpy", "orjson", "zmq"} <= allowed
    python = guarded_python(tmp_path, allowed, "the DeepInfer venv's pins")
    config = WorkloadConfig(engine=engine, ep=2, block_size=128, reference_num_blocks=64, max_num_seqs=4,
                            max_num_batched_tokens=512, max_model_len=4096, l1_host_gb=0.002,
                            model_dir="/nonexistent/model", deepinfer_venv=str(tmp_path),
                            load_timeout_seconds=180, deepinfer_env={
                                "DIB_DEEPINFER_MODULE": "standins.fake_deepinfer_lockstep",
                                "OMP_NUM_THREADS": "1",
                                "DIB_FAKE_DEEPINFER": json.dumps({"num_gpu_blocks": 64, "vocab_size": 1000})})

    async def scenario() -> tuple[list[int], FinishReason | None]:
        group = RankGroup(config.rank_config(), python=str(python))
        try:
            await group.start()
            ids = np.arange(3, 203, dtype=np.int32)
            stream = group.submit(1, EngineRequest("r", ids, SamplingParams(max_tokens=5, ignore_eos=True)))
            tokens: list[int] = []
            async for out in stream:
                tokens += out.token_ids
                last = out
            return tokens, last.finish_reason
        finally:
            await group.close()

    try:
        tokens, reason = asyncio.run(scenario())
    except Exception as exc:  # noqa: BLE001 - the ranks' stderr names the blocked import
        pytest.fail(f"rank processes failed under the DeepInfer venv's packages only: {exc}")
    assert len(tokens) == 5 and reason == FinishReason.LENGTH


def test_smoke_runs_on_the_standard_library_alone() -> None:
    """``python -m deepinfer_backend smoke`` on an operator's machine: nothing beyond
    requirements.txt + the SDK, and it never reaches for the DeepInfer venv (an endpoint that does
    not answer is a FAIL line per check and exit status 1, not an import error)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    code = f"""
import deepinfer_backend
def add_venv_site_packages(venv):
    raise SystemExit("smoke reached for the DeepInfer venv")
deepinfer_backend.add_venv_site_packages = add_venv_site_packages
argv = ["smoke", "--url", "http://127.0.0.1:{port}", "--api", "openai", "--timeout", "5"]
code = deepinfer_backend.main(argv)
print("EXIT", code)
"""
    res = run_guarded(code, allowed_modules(BACKEND_VENV), "requirements.txt + the SDK")
    assert "EXIT 1" in res.stdout, res.stderr[-3000:]
    assert res.stdout.count("FAIL ") == 3 and "Connection refused" in res.stdout, res.stdout
