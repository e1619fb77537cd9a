#!/usr/bin/env bash
# Creates .venv (if missing) and installs the backend with its development tools.
# torch is pinned to 2.13.0: a CPU wheel lies on disk on the build machines, and an unpinned
# torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q torch==2.13.0 -c scripts/deepinfer-pins.txt -e '.[dev]'
