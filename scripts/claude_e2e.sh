#!/usr/bin/env bash
# Claude Code end to end: the real CLI against the backend on the scripted stand-in model, run on
# every pinned CLI version (scripts/claude-versions.txt: the oldest supported, the newest on npm).
#
#   bash scripts/claude_e2e.sh                                 # the version matrix
#   CLAUDE_CODE_VERSIONS=2.1.332 bash scripts/claude_e2e.sh    # chosen versions only
#   CLAUDE_BIN=/path/to/claude bash scripts/claude_e2e.sh      # one binary you already have
#   bash scripts/claude_e2e.sh -k parallel                     # extra args go to pytest
#
# Each version is installed once with npm into .cache/claude-cli/<version> (gitignored; the
# native binary is 245-400 MB) and checked with `claude --version`, offline. The first version
# runs all of tests/e2e but the agent_clients tests (CLI scenarios, OpenAI-SDK flows,
# scripted-engine unit tests); the others run the tests marked claude_cli. Prints each version's
# wall time, then a summary. Needs npm only to install; the runs stay on 127.0.0.1 (the TUI test
# needs tmux). See docs/claude-code.md.
set -euo pipefail
cd "$(dirname "$0")/.."

PINS=scripts/claude-versions.txt
CACHE=${CLAUDE_CLI_CACHE:-.cache/claude-cli}
VERSIONS=${CLAUDE_CODE_VERSIONS:-$(awk '$1 !~ /^#/ && NF >= 2 {print $2}' "$PINS")}
[ -n "${CLAUDE_BIN:-}" ] && VERSIONS=custom

[ -x .venv/bin/python ] || bash scripts/setup.sh

binary_for() {  # install version $1 if needed (scripts/claude_cli.sh); print its binary
  if [ "$1" = custom ]; then realpath "$CLAUDE_BIN"; return 0; fi
  CLAUDE_CLI_CACHE=$CACHE bash scripts/claude_cli.sh "$1" | tail -1
}

probe_home=$(mktemp -d)
trap 'rm -rf "$probe_home"' EXIT
summary=()
status=0
first=1
for version in $VERSIONS; do
  bin=$(binary_for "$version")
  reported=$(HOME=$probe_home DISABLE_AUTOUPDATER=1 "$bin" --version)
  if [ "$version" != custom ] && [ "${reported%% *}" != "$version" ]; then
    echo "error: $bin reports '$reported', expected $version" >&2
    exit 2
  fi
  echo "=== Claude Code $reported: $bin"
  if [ $first = 1 ]; then marker="not agent_clients"; scope="all of tests/e2e"; else marker="claude_cli"; scope="claude_cli tests"; fi
  start=$(date +%s)
  rc=0
  CLAUDE_BIN="$bin" .venv/bin/python -m pytest -m "$marker" -p no:cacheprovider -o addopts="" \
    tests/e2e -v -ra -rP --durations=12 "$@" || rc=$?
  wall=$(( $(date +%s) - start ))
  echo "claude_e2e: Claude Code ${reported%% *}: wall time $wall s, exit $rc"
  summary+=("  ${reported%% *}: exit $rc, wall time $wall s ($scope)")
  [ $rc = 0 ] || status=$rc
  first=0
done
echo "claude_e2e summary:"
printf '%s\n' "${summary[@]}"
exit $status
