#!/usr/bin/env bash
# Sets up a fresh machine and runs the default test suite (no GPU, no Claude CLI, no DeepInfer build).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
