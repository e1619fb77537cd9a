#!/usr/bin/env bash
# OpenAI-side agent clients end to end: Codex CLI, OpenCode (both providers), openai-agents
# (Responses default + chat completions), aider, each against the backend on the scripted
# stand-in model (docs/claude-code.md explains scripted replies; docs/responses.md has the matrix).
#
#   bash scripts/agent_clients_e2e.sh            # install the pinned clients if needed, run, print the matrix
#   bash scripts/agent_clients_e2e.sh -k codex   # extra args go to pytest
#
# Installs with scripts/agent_clients_install.sh (npm + PyPI, once); the runs stay on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."

[ -x .venv/bin/python ] || bash scripts/setup.sh
bash scripts/agent_clients_install.sh

DIR=${AGENT_CLIENTS_DIR:-.cache/agent-clients}
export AGENT_MATRIX_OUT=${AGENT_MATRIX_OUT:-$DIR/matrix.jsonl}
rm -f "$AGENT_MATRIX_OUT"
start=$(date +%s)
status=0
.venv/bin/python -m pytest -m agent_clients -p no:cacheprovider -o addopts="" tests/e2e/test_agent_clients.py \
  -v -ra "$@" || status=$?
echo
echo "| client | version | wire API | check | result |"
echo "| --- | --- | --- | --- | --- |"
[ -s "$AGENT_MATRIX_OUT" ] && .venv/bin/python -c '
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print("| " + " | ".join(r[k] for k in ("client", "version", "wire", "check", "result")) + " |")
' "$AGENT_MATRIX_OUT"
echo "agent_clients_e2e: wall time $(( $(date +%s) - start )) s, exit $status"
exit $status
