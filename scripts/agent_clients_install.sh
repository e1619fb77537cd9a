#!/usr/bin/env bash
# Installs the pinned OpenAI-side agent clients into .cache/agent-clients (gitignored):
#   npm: @openai/codex (Codex CLI) into codex/<version>/, opencode-ai (OpenCode) into npm/
#   venvs (Python 3.12): openai-agents, aider-chat (separate: their openai pins differ)
# Versions: CODEX_VERSION (default: the oldest pin in scripts/codex-versions.txt; each version gets
# its own directory, so the oldest and the newest sit side by side), OPENCODE_VERSION,
# OPENAI_AGENTS_VERSION, AIDER_VERSION (defaults below, the versions
# docs/responses.md was observed on). Idempotent; `codex --version` is
# checked offline after the install.
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=${AGENT_CLIENTS_DIR:-.cache/agent-clients}
CODEX_VERSION=${CODEX_VERSION:-$(awk '$1 == "oldest" {print $2}' scripts/codex-versions.txt)}
OPENCODE_VERSION=${OPENCODE_VERSION:-1.18.33}
OPENAI_AGENTS_VERSION=${OPENAI_AGENTS_VERSION:-0.24.0}
AIDER_VERSION=${AIDER_VERSION:-0.86.2}
PY312=${PY312:-$HOME/.pyenv/versions/3.12.1/bin/python}
[ -x "$PY312" ] || PY312=python3.12
[ -n "$CODEX_VERSION" ] || { echo "error: no 'oldest' pin in scripts/codex-versions.txt" >&2; exit 2; }

mkdir -p "$DIR"
npm_install() {  # npm_install DIR PACKAGE@VERSION: into DIR (via DIR.tmp, so a broken install leaves no DIR)
  if [ ! -e "$1/.installed" ]; then
    command -v npm >/dev/null || { echo "error: npm is needed to install $2" >&2; exit 2; }
    echo "installing $2 into $1"
    rm -rf "$1.tmp" && mkdir -p "$1.tmp"
    npm install --prefix "$1.tmp" --no-audit --no-fund --loglevel=error "$2"
    touch "$1.tmp/.installed"
    rm -rf "$1" && mv "$1.tmp" "$1"
  fi
}
npm_install "$DIR/codex/$CODEX_VERSION" "@openai/codex@$CODEX_VERSION"
npm_install "$DIR/opencode/$OPENCODE_VERSION" "opencode-ai@$OPENCODE_VERSION"

probe_home=$(mktemp -d "${TMPDIR:-/tmp}/codex-probe.XXXXXX")
trap 'rm -rf "$probe_home"' EXIT
reported=$(HOME=$probe_home CODEX_HOME=$probe_home "$DIR/codex/$CODEX_VERSION/node_modules/.bin/codex" --version 2>/dev/null)
if [ "${reported##* }" != "$CODEX_VERSION" ]; then
  echo "error: $DIR/codex/$CODEX_VERSION reports '$reported', expected $CODEX_VERSION" >&2
  exit 2
fi

venv() {  # venv NAME PACKAGE==VERSION
  local v="$DIR/$1"
  if [ ! -e "$v/.installed-$2" ]; then
    echo "installing $2 into $v"
    "$PY312" -m venv "$v"
    "$v/bin/pip" install -q --disable-pip-version-check "$2"
    touch "$v/.installed-$2"
  fi
}
venv agents-venv "openai-agents==$OPENAI_AGENTS_VERSION"
venv aider-venv "aider-chat==$AIDER_VERSION"
echo "agent clients installed in $DIR ($reported)"
