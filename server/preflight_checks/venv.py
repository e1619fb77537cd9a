"""DeepInfer venv checks: the interpreter the ranks run, the ``deepinfer`` import, the patch API.

Everything runs in a subprocess of the venv's own ``bin/python`` with a timeout: importing
``deepinfer`` pulls in torch and the CUDA libraries, and must neither hang nor pollute the
backend process (which runs on the SDK's interpreter).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from server.preflight_checks.context import is_deepinfer
from server.preflight_checks.probe import SystemProbe
from server.preflight_checks.report import CheckResult, ok, problem, skipped, warn

if TYPE_CHECKING:
    from server.config import WorkloadConfig

REQUIRED_PYTHON = (3, 12)
VERSION_TIMEOUT_S = 20.0
IMPORT_TIMEOUT_S = 120.0
_MARKER = "PREFLIGHT_JSON "
# Modules our rank worker needs in the venv next to DeepInfer (the DeepInfer venv pins them).
RANK_MODULES = ("torch", "numpy", "zmq")
# The prefix-cache patch API: (class, method, modules to look for the class in, first hit wins).
PREFIX_API = (
    ("Scheduler", "add_sequence_with_prefix",
     ("deepinfer._C.engine", "deepinfer._C", "deepinfer.engine.scheduler", "deepinfer")),
    ("LLMEngine", "enqueue_with_prefix", ("deepinfer.engine.llm_engine", "deepinfer.engine", "deepinfer")),
)

# Runs under the venv's Python 3.12 (stdlib only). Prints one marked JSON line last.
_IMPORT_SCRIPT = """
import importlib, json, sys
out = {"python": list(sys.version_info[:3]), "modules": {}, "api": {}}
for name in %(rank_modules)r:
    try:
        mod = importlib.import_module(name)
        out["modules"][name] = str(getattr(mod, "__version__", "?"))
    except BaseException as exc:
        out["modules"][name] = None
try:
    import deepinfer
    out["deepinfer_version"] = str(getattr(deepinfer, "__version__", "?"))
    out["deepinfer_file"] = getattr(deepinfer, "__file__", None)
except BaseException as exc:
    out["import_error"] = "%%s: %%s" %% (type(exc).__name__, exc)
else:
    out["api_errors"] = {}
    for cls_name, attr, modules in %(api)r:
        found, error = None, None
        for mod_name in modules:
            try:
                cls = getattr(importlib.import_module(mod_name), cls_name)
            except BaseException as exc:
                error = error or "%%s: %%s" %% (type(exc).__name__, exc)
                continue
            found = hasattr(cls, attr)
            break
        out["api"][cls_name + "." + attr] = found
        if found is None:
            out["api_errors"][cls_name] = error
print(%(marker)r + json.dumps(out))
""" % {"rank_modules": RANK_MODULES, "api": PREFIX_API, "marker": _MARKER}


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def probe_venv(
    venv: Path, probe: SystemProbe, env: Mapping[str, str], import_timeout_s: float = IMPORT_TIMEOUT_S
) -> dict[str, Any]:
    """Facts about the venv: ``error`` (why it is unusable) or the import script's output."""
    python = venv_python(venv)
    if not venv.is_dir():
        return {"error": f"{venv} does not exist"}
    if not python.exists():
        return {"error": f"{python} does not exist (not a venv?)"}
    # -I: ignore PYTHONPATH and user site, so the answer is the venv's own.
    res = probe.run([str(python), "-I", "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
                    VERSION_TIMEOUT_S, env)
    if res.returncode != 0:
        why = res.error or (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
        return {"error": f"{python} does not run: {why}"}
    version = res.stdout.strip()
    facts: dict[str, Any] = {"python_version": version}
    parts = version.split(".")
    if tuple(int(p) for p in parts[:2] if p.isdigit()) != REQUIRED_PYTHON:
        facts["error"] = f"{python} is Python {version}, DeepInfer and the ranks need 3.12"
        return facts
    res = probe.run([str(python), "-I", "-c", _IMPORT_SCRIPT], import_timeout_s, env)
    if res.timed_out:
        facts["error"] = f"importing deepinfer did not finish within {import_timeout_s:g} s"
        return facts
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(_MARKER)]
    if not lines:
        tail = (res.stderr.strip().splitlines() or [res.error or f"exit {res.returncode}"])[-1]
        facts["error"] = f"the import probe crashed: {tail}"
        return facts
    facts.update(json.loads(lines[-1][len(_MARKER):]))
    return facts


def check_venv(config: WorkloadConfig, facts: dict[str, Any] | None) -> CheckResult:
    name = "deepinfer_venv"
    deepinfer = is_deepinfer(config)
    if facts is None:
        return skipped(name, f"no deepinfer_venv; engine '{config.engine}' does not need one")
    venv = config.deepinfer_venv
    fix_install = (f"Build the venv with the prebuilt package: bash /workspace/deepinfer-prebuilt/install.sh "
                   f"{venv} /workspace (seed guide step 1).")
    if "error" in facts:
        return problem(name, deepinfer, facts["error"], fix_install, **facts)
    if "import_error" in facts:
        return problem(name, deepinfer, f"Python {facts['python_version']}, but 'import deepinfer' fails: "
                       f"{facts['import_error']}", fix_install, **facts)
    missing = [m for m, v in facts.get("modules", {}).items() if v is None]
    if missing:
        return problem(name, deepinfer, f"deepinfer imports but the ranks also need {', '.join(missing)}",
                       f"Install them into the venv: {venv}/bin/pip install {' '.join(missing)}.", **facts)
    return ok(name, f"Python {facts['python_version']}, deepinfer {facts.get('deepinfer_version')} imports "
              f"(torch {facts['modules'].get('torch')})", **facts)


def check_prefix_api(config: WorkloadConfig, facts: dict[str, Any] | None) -> CheckResult:
    name = "prefix_cache_api"
    if facts is None:
        return skipped(name, "no deepinfer venv")
    if "error" in facts or "import_error" in facts or not facts.get("api"):
        return skipped(name, "deepinfer not importable; patch API not checked")
    api: dict[str, bool | None] = facts["api"]
    present = [k for k, v in api.items() if v]
    absent = [k for k, v in api.items() if v is False]
    unknown = [k for k, v in api.items() if v is None]
    if not absent and unknown and present:
        errors = facts.get("api_errors") or {}
        why = "; ".join(f"{k.split('.')[0]}: {errors.get(k.split('.')[0], 'not found')}" for k in unknown)
        return warn(name, f"prefix-cache patch present ({', '.join(present)}); {', '.join(unknown)} not "
                    f"checked: the class does not import in the venv ({why})",
                    "Check the DeepInfer venv's install (the prebuilt package's install.sh).", api=api)
    if not absent and not unknown:
        return ok(name, f"prefix-cache patch present ({', '.join(present)})", api=api)
    absent += unknown
    if not config.prefix_cache:
        return skipped(name, f"patch API missing ({', '.join(absent)}) but prefix_cache is off", api=api)
    return warn(
        name, f"DeepInfer lacks the prefix-cache patch ({', '.join(absent)} missing): the prefix cache and "
        "L1 will be off and cached_tokens stays 0",
        "Install inferencekey/deepinfer-sm100-cu132 (patched), or run rebuild-deepinfer-C.sh on this tree.",
        api=api,
    )
