#!/usr/bin/env bash
# tests/deepinfer and the engine-contract suite (tests/engines) against DeepInfer's real compiled
# Scheduler/BlockManager/Sequence (-m deepinfer_build),
# in the DeepInfer venv built by scripts/build_deepinfer.sh (built on first use, cached per machine).
#
#   bash scripts/test_deepinfer_build.sh          # extra args go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_LINE=$(bash scripts/build_deepinfer.sh | tail -1)
BUILD_DIR=${BUILD_LINE#DEEPINFER_BUILD_DIR=}
export DEEPINFER_BUILD_DIR=$BUILD_DIR
# The build's pytest-venv adds the DeepInfer venv as a site dir; our code comes from PYTHONPATH (it is
# installed in neither venv); the libcuda stub stands where the driver's libcuda.so.1 would be.
PYTHONPATH=$PWD LD_LIBRARY_PATH=$BUILD_DIR/stubs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
    exec "$BUILD_DIR/pytest-venv/bin/python" -m pytest -m deepinfer_build -p no:cacheprovider tests/deepinfer tests/engines "$@"
