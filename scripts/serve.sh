#!/usr/bin/env bash
# Sets up a fresh machine and serves the backend on its embedded default: the reference engine
# (random weights: its text is meaningless) on 4 CPU ranks, /v1/messages and
# /v1/chat/completions on http://127.0.0.1:8000. Extra arguments go to `serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m deepinfer_backend serve --engine reference --ranks 4 "$@"
