#!/usr/bin/env bash
# The optional L3 tier (config key l3): Mooncake Store's client and master, into .venv.
#
# The wheel (mooncake-transfer-engine-non-cuda, ~46 MB, pyproject extra "l3") links libibverbs and
# libnl without declaring them: on Debian/Ubuntu they come from libibverbs1 libnl-3-200
# libnl-route-3-200, installed here with apt-get when missing (needs root). Both steps are skipped
# when already done, so CI can run this every time. On a worker, install the same in the DeepInfer
# venv: <deepinfer_venv>/bin/python -m pip install 'mooncake-transfer-engine-non-cuda==0.3.13.post1'.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON_L3:-.venv/bin/python}
WHEEL="mooncake-transfer-engine-non-cuda==0.3.13.post1"
LIBS=(libibverbs1 libnl-3-200 libnl-route-3-200)

missing=()
for lib in "${LIBS[@]}"; do
    dpkg-query -W -f='${Status}' "$lib" 2>/dev/null | grep -q "install ok installed" || missing+=("$lib")
done
if [ ${#missing[@]} -gt 0 ]; then
    if ! command -v apt-get >/dev/null; then
        echo "setup_l3: ${missing[*]} missing and no apt-get: install libibverbs and libnl yourself" >&2
        exit 1
    fi
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    echo "setup_l3: apt-get install ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! "$PY" -c "import mooncake.store" 2>/dev/null; then
    echo "setup_l3: pip install $WHEEL"
    "$PY" -m pip install -q "$WHEEL"
fi
"$PY" -c "import mooncake.store" && echo "setup_l3: Mooncake Store client ready ($("$PY" -m pip show mooncake-transfer-engine-non-cuda | sed -n 's/^Version: //p'))"
