#!/usr/bin/env bash
# OpenAI-side agent clients end to end: Codex CLI, OpenCode (both providers), openai-agents
# (Responses default + chat completions), aider, each against the backend on the scripted
# stand-in model (docs/claude-code.md explains scripted replies; docs/responses.md has the matrix).
# Codex runs on every pinned version (scripts/codex-versions.txt: the oldest supported, the newest
# on npm); the other clients, pinned to one version each, run with the first Codex version only.
#
#   bash scripts/agent_clients_e2e.sh                          # install if needed, run, print the matrix
#   CODEX_VERSIONS=0.171.0 bash scripts/agent_clients_e2e.sh   # chosen Codex versions only
#   bash scripts/agent_clients_e2e.sh -k codex                 # extra args go to pytest
#
# Installs with scripts/agent_clients_install.sh (npm + PyPI, once); the runs stay on 127.0.0.1.
# Prints each Codex version's wall time, then the matrix and a summary.
set -euo pipefail
cd "$(dirname "$0")/.."

[ -x .venv/bin/python ] || bash scripts/setup.sh
VERSIONS=${CODEX_VERSIONS:-$(awk '$1 !~ /^#/ && NF >= 2 {print $2}' scripts/codex-versions.txt)}

DIR=${AGENT_CLIENTS_DIR:-.cache/agent-clients}
export AGENT_MATRIX_OUT=${AGENT_MATRIX_OUT:-$DIR/matrix.jsonl}
rm -f "$AGENT_MATRIX_OUT"
summary=()
status=0
first=1
for version in $VERSIONS; do
  CODEX_VERSION=$version bash scripts/agent_clients_install.sh
  if [ $first = 1 ]; then select=(); scope="every client"; else select=(-k codex); scope="the Codex checks"; fi
  echo "=== Codex CLI $version: $scope"
  start=$(date +%s)
  rc=0
  CODEX_VERSION=$version .venv/bin/python -m pytest -m agent_clients -p no:cacheprovider -o addopts="" \
    tests/e2e/test_agent_clients.py -v -ra "${select[@]}" "$@" || rc=$?
  wall=$(( $(date +%s) - start ))
  echo "agent_clients_e2e: Codex CLI $version: wall time $wall s, exit $rc"
  summary+=("  Codex $version: exit $rc, wall time $wall s ($scope)")
  [ $rc = 0 ] || status=$rc
  first=0
done
echo
echo "| client | version | wire API | check | result |"
echo "| --- | --- | --- | --- | --- |"
[ -s "$AGENT_MATRIX_OUT" ] && .venv/bin/python -c '
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print("| " + " | ".join(r[k] for k in ("client", "version", "wire", "check", "result")) + " |")
' "$AGENT_MATRIX_OUT"
echo "agent_clients_e2e summary:"
printf '%s\n' "${summary[@]}"
exit $status
