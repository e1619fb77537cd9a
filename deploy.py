"""Pin the DeepInfer workload to a 4x B200 worker and wait until it serves.

    python deploy.py                        # the measured configuration of the deployment guide
    python deploy.py --config my.json       # a workload config of your own (JSON object)
    python deploy.py --dry-run              # validate and print the spec; contact nothing

Environment: ``INFERENCEKEY_SDK_TOKEN`` (``ik_sdk_``, workload:read + workload:write),
``INFERENCEKEY_PROJECT`` (project slug) and ``IK_WORKER_ID`` (the 4x B200 worker);
``INFERENCEKEY_BASE_URL`` overrides the control plane.

The config is validated with the backend's own ``WorkloadConfig`` before anything is sent, so a
misspelt key fails here, naming the key, instead of 90 minutes later in the worker's ``setup()``.
Publish the backend first (``python publish.py``); ``backend`` below is its slug.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from server.config import ConfigError, load_config

SLUG = "deepinfer-v41-flash"
MODEL = "deepseek-v4.1-flash"

# The workload configuration of the measured runs (seed deployment guide, step 4).
MEASURED_CONFIG: dict[str, Any] = {
    "engine": "deepinfer",
    "env": {
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        "DEEPINFER_HF_MODEL_DIR": "/workspace/v41flash",
        "IK_BACKEND_HTTP": "native",
    },
    "ep": 4,
    "deepinfer_venv": "/workspace/di-venv",
    "eplb": False,
    "extra_experts": 0,
    "max_model_len": 1064960,
    "max_num_seqs": 128,
    "max_num_batched_tokens": 16384,
    "gpu_memory_utilization": 0.90,
    "load_timeout_seconds": 3600,
    "l1_cache": True,
    "l1_host_gb": 128,
    "deepinfer_env": {
        "DEEPINFER_ENGRAM_LOCAL": "1",
        "EP_DISABLE_GIN": "1",
        "NCCL_IB_DISABLE": "1",
        "MASTER_PORT": "29511",
        "DEEPINFER_NCCL_NVLS_ENABLE": "0",
        "NCCL_NVLS_ENABLE": "0",
    },
    "ready_timeout_secs": 5400,
    "request_timeout_secs": 1800,
}


def read_config(path: str | None) -> dict[str, Any]:
    if path is None:
        return dict(MEASURED_CONFIG)
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the workload config must be a JSON object")
    return raw


def build_spec(config: dict[str, Any], worker_id: str | None, backend_slug: str) -> Any:
    from inferencekey import ExecutionPolicy, WorkloadSpec

    cfg = load_config(config)  # raises ConfigError naming the key
    return WorkloadSpec(
        name="DeepSeek-V4.1-Flash on DeepInfer",
        slug=cfg.slug,
        model=cfg.model_name,
        backend=backend_slug,
        task_type="text2text",
        worker_id=worker_id,
        execution_policy=ExecutionPolicy.FIXED,  # one always-on replica pinned to the worker
        config=config,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python deploy.py", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=None, help="workload config JSON (default: measured)")
    parser.add_argument("--backend", default=SLUG, help="published custom backend slug")
    parser.add_argument("--worker", default=os.environ.get("IK_WORKER_ID"))
    parser.add_argument("--timeout-s", type=float, default=None,
                        help="wait limit (default: the config's ready_timeout_secs)")
    parser.add_argument("--dry-run", action="store_true", help="validate and print; send nothing")
    args = parser.parse_args(argv)

    try:
        config = read_config(args.config)
        spec = build_spec(config, args.worker, args.backend)
    except (ConfigError, OSError, json.JSONDecodeError) as exc:
        print(f"deploy failed: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(spec.to_wire(), indent=2))
    if args.dry_run:
        print("dry run: config valid, nothing sent")
        return 0
    if not args.worker:
        print("deploy failed: set IK_WORKER_ID (or --worker) to the 4x B200 worker", file=sys.stderr)
        return 2

    from inferencekey import ManagementClient
    from inferencekey.errors import InferenceKeyError

    timeout_s = args.timeout_s or float(load_config(config).ready_timeout_secs)
    try:
        mgmt = ManagementClient.from_env()
        ref = mgmt.ensure(spec)
        print(f"ensured workload {ref.project_slug}/{ref.workload_slug}; waiting up to {timeout_s:.0f} s")
        mgmt.wait_until_ready(ref.workload_slug, timeout=timeout_s)
    except (InferenceKeyError, TimeoutError) as exc:
        print(f"deploy failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"ready: {ref.workload_slug}")
    print("next: raise the worker's Concurrent requests for this workload to "
          f"{load_config(config).ep * load_config(config).max_num_seqs} (Workloads page)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
