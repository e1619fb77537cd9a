#!/usr/bin/env bash
# Installs the Claude Code CLI once per machine and prints the path of its native binary.
#
#   bash scripts/claude_cli.sh            # the oldest pinned version (scripts/claude-versions.txt)
#   bash scripts/claude_cli.sh 2.1.332    # a given version
#
# The pins live in scripts/claude-versions.txt (one source of truth). Installs go to
# ${CLAUDE_CLI_CACHE:-${XDG_CACHE_HOME:-~/.cache}/deepinfer-backend/claude-cli}/<version> with npm
# (registry access once), under a lock so parallel runs share one install. `claude --version` is
# checked offline before the path is printed. scripts/claude_e2e.sh installs through this script.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
VERSION=${1:-$(awk '$1 == "oldest" {print $2}' "$REPO/scripts/claude-versions.txt")}
[ -n "$VERSION" ] || { echo "error: no 'oldest' pin in scripts/claude-versions.txt" >&2; exit 2; }
ROOT=${CLAUDE_CLI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/deepinfer-backend/claude-cli}
DIR=$ROOT/$VERSION

find_bin() {
    local b
    for b in "$DIR"/node_modules/@anthropic-ai/claude-code-*/claude; do
        [ -x "$b" ] && { realpath "$b"; return 0; }
    done
    return 1
}

if ! BIN=$(find_bin); then
    mkdir -p "$ROOT"
    exec 9>"$ROOT/.lock-$VERSION"
    flock 9
    if ! BIN=$(find_bin); then
        command -v npm >/dev/null || { echo "error: npm is needed to install the Claude Code CLI" >&2; exit 2; }
        echo "installing @anthropic-ai/claude-code@$VERSION into $DIR" >&2
        rm -rf "$DIR.tmp" && mkdir -p "$DIR.tmp"
        npm install --prefix "$DIR.tmp" --no-audit --no-fund --loglevel=error "@anthropic-ai/claude-code@$VERSION" >&2
        rm -rf "$DIR" && mv "$DIR.tmp" "$DIR"
        BIN=$(find_bin) || { echo "error: the npm package brought no native binary for this platform" >&2; exit 2; }
    fi
fi
TMP_HOME=$(mktemp -d)
trap 'rm -rf "$TMP_HOME"' EXIT
HOME=$TMP_HOME DISABLE_AUTOUPDATER=1 "$BIN" --version >&2
echo "$BIN"
