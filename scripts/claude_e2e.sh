#!/usr/bin/env bash
# Claude Code end to end: the real CLI against the backend on the scripted stand-in model.
#
#   bash scripts/claude_e2e.sh            # install the CLI if needed, run every scenario
#   bash scripts/claude_e2e.sh -k parallel   # extra args go to pytest
#
# Installs @anthropic-ai/claude-code (pinned: CLAUDE_CODE_VERSION, default the version the
# protocol notes were observed on) into .cache/claude-cli with npm, checks `claude --version`
# offline, then runs the tests marked claude_cli plus the OpenAI-SDK flows. Needs node/npm once,
# for the install; the runs themselves need no network (everything is on 127.0.0.1).
# See docs/claude-code.md.
set -euo pipefail
cd "$(dirname "$0")/.."

CLI_DIR=${CLAUDE_CLI_DIR:-.cache/claude-cli}
VERSION=${CLAUDE_CODE_VERSION:-2.1.197}

[ -x .venv/bin/python ] || bash scripts/setup.sh

find_bin() {
  local b
  for b in "$CLI_DIR"/node_modules/@anthropic-ai/claude-code-*/claude; do
    [ -x "$b" ] && { realpath "$b"; return 0; }
  done
  return 1
}

if ! BIN=$(find_bin); then
  command -v npm >/dev/null || { echo "error: npm is needed to install the Claude Code CLI" >&2; exit 2; }
  mkdir -p "$CLI_DIR"
  echo "installing @anthropic-ai/claude-code@$VERSION into $CLI_DIR"
  npm install --prefix "$CLI_DIR" --no-audit --no-fund --loglevel=error "@anthropic-ai/claude-code@$VERSION"
  BIN=$(find_bin) || { echo "error: the npm package brought no native binary for this platform" >&2; exit 2; }
fi
echo "claude: $BIN ($(HOME=$(mktemp -d) DISABLE_AUTOUPDATER=1 "$BIN" --version))"

start=$(date +%s)
status=0
CLAUDE_BIN="$BIN" .venv/bin/python -m pytest -m "claude_cli or not claude_cli" -p no:cacheprovider \
  -o addopts="" tests/e2e -v -ra --durations=12 "$@" || status=$?
echo "claude_e2e: wall time $(( $(date +%s) - start )) s, exit $status"
exit $status
