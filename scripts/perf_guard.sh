#!/usr/bin/env bash
# Hot-path regression guard (bench/perf_guard.py): this checkout against the baseline commit named in
# bench/perf_baseline.txt, interleaved in one run; fails when a median is over 1.25x the baseline's.
# The baseline is checked out as a git worktree under ${PERF_GUARD_DIR:-/tmp/dib-perf-guard}; a shallow clone
# fetches the commit first. Extra arguments go to bench/perf_guard.py (e.g. --rounds 5, --probe request).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
BASE=$(grep -v '^#' bench/perf_baseline.txt | head -1 | tr -d '[:space:]')
DIR=${PERF_GUARD_DIR:-${TMPDIR:-/tmp}/dib-perf-guard}/$BASE
if ! git cat-file -e "$BASE^{commit}" 2>/dev/null; then
    echo "perf guard: baseline $BASE is not in this clone; fetching it"
    if ! git fetch --quiet origin "$BASE" 2>/dev/null && ! git fetch --quiet --unshallow origin 2>/dev/null; then
        echo "perf guard: cannot get baseline commit $BASE (shallow clone without a reachable origin?);" \
             "fetch it or move bench/perf_baseline.txt to a commit this clone has" >&2
        exit 2
    fi
fi
if [ ! -d "$DIR" ]; then
    git worktree prune
    git worktree add --detach --quiet "$DIR" "$BASE"
fi
exec "$PY" -m bench.perf_guard --baseline-dir "$DIR" "$@"
