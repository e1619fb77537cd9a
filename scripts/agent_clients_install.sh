#!/usr/bin/env bash
# Installs the pinned OpenAI-side agent clients into .cache/agent-clients (gitignored):
#   npm: @openai/codex (Codex CLI), opencode-ai (OpenCode)
#   venvs (Python 3.12): openai-agents, aider-chat (separate: their openai pins differ)
# Versions: CODEX_VERSION, OPENCODE_VERSION, OPENAI_AGENTS_VERSION, AIDER_VERSION (defaults below,
# the versions shared/reference/openai-agent-clients.md was observed on). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=${AGENT_CLIENTS_DIR:-.cache/agent-clients}
CODEX_VERSION=${CODEX_VERSION:-0.169.0}
OPENCODE_VERSION=${OPENCODE_VERSION:-1.18.33}
OPENAI_AGENTS_VERSION=${OPENAI_AGENTS_VERSION:-0.24.0}
AIDER_VERSION=${AIDER_VERSION:-0.86.2}
PY312=${PY312:-$HOME/.pyenv/versions/3.12.1/bin/python}
[ -x "$PY312" ] || PY312=python3.12

mkdir -p "$DIR"
stamp="$DIR/npm/.installed-$CODEX_VERSION-$OPENCODE_VERSION"
if [ ! -e "$stamp" ]; then
  command -v npm >/dev/null || { echo "error: npm is needed to install Codex CLI and OpenCode" >&2; exit 2; }
  mkdir -p "$DIR/npm"
  echo "installing @openai/codex@$CODEX_VERSION opencode-ai@$OPENCODE_VERSION into $DIR/npm"
  npm install --prefix "$DIR/npm" --no-audit --no-fund --loglevel=error \
    "@openai/codex@$CODEX_VERSION" "opencode-ai@$OPENCODE_VERSION"
  touch "$stamp"
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
echo "agent clients installed in $DIR"
