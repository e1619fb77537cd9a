#!/usr/bin/env bash
# Builds DeepInfer 0.1.0's C++ extension (deepinfer._C) with our prefix-cache patch on a CPU-only
# machine, so tests/deepinfer can drive the real Scheduler, BlockManager and Sequence classes.
#
#   bash scripts/build_deepinfer.sh            # venv + sdist + patch + build (idempotent)
#   .deepinfer-build/venv/bin/python -m pytest -m deepinfer_build tests/deepinfer
#
# Recipe and the reasons for each workaround: ../shared/reference/deepinfer-build.md and
# docs/deepinfer.md. Everything lands in $DEEPINFER_BUILD_DIR (default .deepinfer-build/, git-ignored):
#   venv/    Python 3.11 + the CUDA build of torch 2.14.1 (local wheel, CXX11 ABI; the CPU wheel has
#            no CUDA_HOME and no libc10_cuda) + ninja, numpy, pytest.
#   dl/      the sdist from `pip download` (sha256 checked).
#   src/     the unpacked, patched sdist; the extension is built in place (src/deepinfer/_C*.so).
#   stubs/   a self-built libcuda.so.1 (5 functions returning CUDA_ERROR_STUB_LIBRARY): no driver
#            here, and the CUDA toolkit on the image ships no lib64/stubs/libcuda.so.
#   shim/    a <format> header mapping std::format onto torch's bundled {fmt} (GCC 12's libstdc++
#            lacks <format>), passed with -isystem so no DeepInfer source changes for it.
#
# Environment: PYTHON (default python3; 3.11 keeps every input on local disk), CUDA_HOME (default
# /usr/local/cuda), MAX_JOBS (default 1), NICE (default 10), DEEPINFER_PATCH (default
# patches/deepinfer-prefix-cache.patch; "none" builds the unpatched release).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
BUILD_DIR=${DEEPINFER_BUILD_DIR:-$REPO/.deepinfer-build}
PYTHON=${PYTHON:-python3}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export MAX_JOBS=${MAX_JOBS:-1}
NICE=${NICE:-10}
PATCH=${DEEPINFER_PATCH:-$REPO/patches/deepinfer-prefix-cache.patch}
SDIST_SHA256=959b9bd010893b4c6dc60be0dd822e10e7f1ae1e53289233a83741f76c3d681a
VENV=$BUILD_DIR/venv
SRC=$BUILD_DIR/src/deepinfer-0.1.0
START_S=$(date +%s)

log() { echo "[build_deepinfer $(($(date +%s) - START_S))s] $*"; }

[ -f "$CUDA_HOME/include/cuda_runtime_api.h" ] || {
    echo "CUDA_HOME=$CUDA_HOME has no include/cuda_runtime_api.h (the CUDA toolkit headers are needed)" >&2
    exit 2
}
mkdir -p "$BUILD_DIR/dl" "$BUILD_DIR/stubs" "$BUILD_DIR/shim"

# 1. venv (skipped when torch 2.14.1 is already there).
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.14.1")' 2>/dev/null; then
    log "creating $VENV"
    "$PYTHON" -m venv "$VENV"
    nice -n "$NICE" "$VENV/bin/pip" install -q torch==2.14.1 ninja setuptools pytest pytest-timeout hypothesis \
        -c "$REPO/scripts/deepinfer-pins.txt" numpy
fi
export VIRTUAL_ENV=$VENV PATH=$VENV/bin:$PATH
python -c 'import torch; assert torch._C._GLIBCXX_USE_CXX11_ABI and torch.version.cuda, "need the CUDA (CXX11 ABI) torch"'

# 2. sdist. `pip download` prepares the metadata by running setup.py, which needs VIRTUAL_ENV and
#    a CUDA torch (both set above); the release requires Python 3.12, which only the import needs.
TARBALL=$BUILD_DIR/dl/deepinfer-0.1.0.tar.gz
if [ ! -f "$TARBALL" ]; then
    log "downloading the deepinfer 0.1.0 sdist"
    pip download -q --no-deps --no-build-isolation --ignore-requires-python deepinfer==0.1.0 -d "$BUILD_DIR/dl"
fi
echo "$SDIST_SHA256  $TARBALL" | sha256sum -c --quiet -

# 3. Fresh source tree + patch whenever the patch changed (ninja then rebuilds only what changed:
#    the build/ directory is kept next to the tree, and unchanged files keep their mtimes).
PATCH_ID=none
[ "$PATCH" = none ] || PATCH_ID=$(sha256sum "$PATCH" | cut -c1-16)
if [ "$(cat "$BUILD_DIR/src/.patch-id" 2>/dev/null)" != "$PATCH_ID" ]; then
    log "unpacking the sdist (patch: $PATCH_ID)"
    rm -rf "$BUILD_DIR/src.new" && mkdir -p "$BUILD_DIR/src.new"
    tar -xzf "$TARBALL" -C "$BUILD_DIR/src.new"
    if [ "$PATCH" != none ]; then
        (cd "$BUILD_DIR/src.new/deepinfer-0.1.0" && patch -p1 --forward --batch --quiet <"$PATCH")
    fi
    # Keep mtimes of files the patch did not change, so ninja's incremental rebuild stays small.
    if [ -d "$SRC" ]; then
        (cd "$BUILD_DIR/src.new/deepinfer-0.1.0" && find . -type f | while read -r f; do
            if cmp -s "$f" "$SRC/$f"; then touch -r "$SRC/$f" "$f"; fi
        done)
        [ -d "$SRC/build" ] && mv "$SRC/build" "$BUILD_DIR/src.new/deepinfer-0.1.0/build"
        find "$SRC/deepinfer" -maxdepth 1 -name '_C*.so' -exec rm -f {} +
    fi
    echo "$PATCH_ID" >"$BUILD_DIR/src.new/.patch-id"
    rm -rf "$BUILD_DIR/src" && mv "$BUILD_DIR/src.new" "$BUILD_DIR/src"
fi

# 4. libcuda stub and <format> shim.
cat >"$BUILD_DIR/stubs/cuda_stub.c" <<'EOF'
/* Just enough of libcuda.so.1 for deepinfer._C to link and import without a driver.
   Every call reports CUDA_ERROR_STUB_LIBRARY (34). */
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
CUresult cuInit(unsigned int flags) { (void)flags; return 34; }
CUresult cuDriverGetVersion(int *version) { if (version) *version = 0; return 34; }
CUresult cuMemAlloc_v2(CUdeviceptr *ptr, unsigned long long size) { (void)size; if (ptr) *ptr = 0; return 34; }
CUresult cuMemFree_v2(CUdeviceptr ptr) { (void)ptr; return 34; }
CUresult cuGetErrorString(CUresult err, const char **msg) {
    (void)err; if (msg) *msg = "CUDA driver stub (no GPU on this machine)"; return 0; }
EOF
if [ ! -f "$BUILD_DIR/stubs/libcuda.so.1" ] || [ "$BUILD_DIR/stubs/cuda_stub.c" -nt "$BUILD_DIR/stubs/libcuda.so.1" ]; then
    gcc -shared -fPIC -O1 -Wl,-soname,libcuda.so.1 -o "$BUILD_DIR/stubs/libcuda.so.1" "$BUILD_DIR/stubs/cuda_stub.c"
    ln -sf libcuda.so.1 "$BUILD_DIR/stubs/libcuda.so"
fi
cat >"$BUILD_DIR/shim/format" <<'EOF'
#pragma once
// GCC 12's libstdc++ has no <format>; DeepInfer only needs std::format and std::format_string,
// which {fmt} (bundled in torch/include, header-only) provides with the same semantics.
#include <fmt/format.h>
namespace std {
using fmt::format;
template <class... Args>
using format_string = fmt::format_string<Args...>;
}  // namespace std
EOF

# 5. Build only the extension, in place.
log "building deepinfer._C (MAX_JOBS=$MAX_JOBS, nice $NICE)"
BUILD_START_S=$(date +%s)
(cd "$SRC" && LIBRARY_PATH=$BUILD_DIR/stubs${LIBRARY_PATH:+:$LIBRARY_PATH} \
    CFLAGS="-isystem $BUILD_DIR/shim -DFMT_HEADER_ONLY" \
    nice -n "$NICE" python setup.py -q build_ext --inplace >"$BUILD_DIR/build.log" 2>&1) || {
    tail -40 "$BUILD_DIR/build.log" >&2
    echo "build failed; full log: $BUILD_DIR/build.log" >&2
    exit 1
}
log "build_ext took $(($(date +%s) - BUILD_START_S))s"

# 6. Smoke test: load the extension (by path: the deepinfer package itself needs Python 3.12) and
#    report whether the prefix-cache patch's API is there.
LD_LIBRARY_PATH=$BUILD_DIR/stubs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PYTHONPATH=$REPO \
    python "$REPO/scripts/deepinfer_smoke.py" "$SRC" "$BUILD_DIR/stubs"
log "done; run: $VENV/bin/python -m pytest -m deepinfer_build tests/deepinfer"
