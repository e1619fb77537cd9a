#!/usr/bin/env bash
# The InferenceKey worker stand-in: this checkout published (dry run), unpacked, installed and started
# exactly as a worker does it, with engine reference and engine deepinfer, then checked from the
# outside and stopped with SIGTERM. Run it before every publish; CI runs it (.ci/run).
#
#   bash scripts/worker_standin.sh                 # both engines
#   bash scripts/worker_standin.sh -k deepinfer    # extra args go to pytest
#
# Builds the DeepInfer venv on first use (scripts/build_deepinfer.sh, cached per machine) and
# installs the pinned Claude Code CLI (scripts/claude_cli.sh, cached per machine). STANDIN_KEEP=1
# keeps the work directory (archive, venvs, serve logs). See tests/worker/test_worker_standin.py.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
BUILD_LINE=$(bash scripts/build_deepinfer.sh | tail -1)
export DEEPINFER_BUILD_DIR=${BUILD_LINE#DEEPINFER_BUILD_DIR=}
CLAUDE_BIN=$(bash scripts/claude_cli.sh | tail -1)
export CLAUDE_BIN
exec .venv/bin/python -m pytest -m worker_standin -o addopts="" -p no:cacheprovider -s -v tests/worker "$@"
