#!/usr/bin/env bash
# Builds the DeepInfer venv the way the prebuilt package's install.sh does, on a CPU-only machine,
# and caches it per machine (outside the checkout):
#
#   bash scripts/build_deepinfer.sh              # build if needed; prints DEEPINFER_BUILD_DIR=... last
#   bash scripts/build_deepinfer.sh --print-dir  # the cache directory for this recipe (built or not)
#
# What lands in the build directory (default ${XDG_CACHE_HOME:-~/.cache}/deepinfer-backend/deepinfer-<key>):
#   venv/         THE DeepInfer venv: Python 3.12, torch 2.13.0 (the PyPI CUDA build: the CPU wheel has no
#                 CUDA_HOME and no libc10_cuda, so DeepInfer's extension cannot build against it), every
#                 pin of DeepInfer 0.1.0's requirements.txt (numpy 2.3.5, orjson 3.11.7, pyzmq 27.1.0,
#                 tokenizers 0.21.4, ...), and DeepInfer 0.1.0 itself, patched with
#                 patches/deepinfer-prefix-cache.patch and built in place (editable install). Nothing of
#                 this project is installed in it. The worker stand-in points deepinfer_venv at it.
#   src/          the sdist (sha256 checked), unpacked and patched; deepinfer/_C*.so is built here.
#   stubs/        libcuda.so.1: 5 functions returning CUDA_ERROR_STUB_LIBRARY (no driver on this
#                 machine); put it on LD_LIBRARY_PATH where the worker's driver would be.
#   shim/         a <format> header over torch's bundled {fmt} (GCC 12's libstdc++ has no <format>).
#   pytest-venv/  Python 3.12 + pytest, layered over venv/ by a .pth (site.addsitedir, as the backend
#                 adds the DeepInfer venv): runs tests/deepinfer -m deepinfer_build against the build.
#   .complete     written last; a directory without it is rebuilt (interrupted steps are redone).
#
# The key hashes everything the build depends on: the sdist's sha256, the patch, the Python and torch
# versions and RECIPE (bump it when this recipe changes). Builds on one machine are serialised by a
# lock, so parallel runs (several engineers, CI) wait for one build instead of racing it.
# Workarounds and the reasons for them: docs/deepinfer.md.
#
# Environment: PYTHON (default: python3.12 on PATH, else pyenv's 3.12.x), DEEPINFER_CACHE_DIR (the cache
# root), DEEPINFER_BUILD_DIR (use exactly this directory), CUDA_HOME (default /usr/local/cuda),
# MAX_JOBS (default: the CPU count), NICE (default 10), DEEPINFER_PATCH (default
# patches/deepinfer-prefix-cache.patch; "none" builds the unpatched release).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
RECIPE=3
TORCH_VERSION=2.13.0
SDIST_SHA256=959b9bd010893b4c6dc60be0dd822e10e7f1ae1e53289233a83741f76c3d681a
CACHE_ROOT=${DEEPINFER_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/deepinfer-backend}
PATCH=${DEEPINFER_PATCH:-$REPO/patches/deepinfer-prefix-cache.patch}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
NICE=${NICE:-10}
START_S=$(date +%s)
log() { echo "[build_deepinfer $(($(date +%s) - START_S))s] $*" >&2; }
quiet() {  # run pip without the local indexes' "Location ... is ignored" noise (exit status kept)
    "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
}

find_python() {
    local p
    if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
    for p in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python; do
        if "$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; then
            "$p" -c 'import sys; print(sys.executable)'; return
        fi
    done
    echo "error: Python 3.12 is needed (DeepInfer requires it); set PYTHON" >&2
    exit 2
}
PY=$(find_python)
PY_VERSION=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$PY_VERSION" = 3.12 ] || { echo "error: $PY is Python $PY_VERSION; DeepInfer 0.1.0 needs 3.12" >&2; exit 2; }
PATCH_ID=none
[ "$PATCH" = none ] || PATCH_ID=$(sha256sum "$PATCH" | cut -c1-16)
KEY=$(printf 'recipe=%s sdist=%s patch=%s python=%s torch=%s' "$RECIPE" "$SDIST_SHA256" "$PATCH_ID" \
    "$PY_VERSION" "$TORCH_VERSION" | sha256sum | cut -c1-16)
BUILD_DIR=${DEEPINFER_BUILD_DIR:-$CACHE_ROOT/deepinfer-$KEY}
if [ "${1:-}" = --print-dir ]; then echo "$BUILD_DIR"; exit 0; fi
if [ -f "$BUILD_DIR/.complete" ]; then
    log "cached: $BUILD_DIR"
    echo "DEEPINFER_BUILD_DIR=$BUILD_DIR"
    exit 0
fi

mkdir -p "$CACHE_ROOT" "$BUILD_DIR"
exec 9>"$CACHE_ROOT/.build.lock"
if ! flock -n 9; then
    log "another build holds $CACHE_ROOT/.build.lock; waiting for it"
    flock 9
fi
if [ -f "$BUILD_DIR/.complete" ]; then  # built by whoever held the lock
    log "cached: $BUILD_DIR"
    echo "DEEPINFER_BUILD_DIR=$BUILD_DIR"
    exit 0
fi
[ -f "$CUDA_HOME/include/cuda_runtime_api.h" ] || {
    echo "CUDA_HOME=$CUDA_HOME has no include/cuda_runtime_api.h (the CUDA toolkit headers are needed)" >&2
    exit 2
}
log "building $BUILD_DIR (key $KEY: patch $PATCH_ID, Python $PY_VERSION, torch $TORCH_VERSION)"
VENV=$BUILD_DIR/venv
SRC=$BUILD_DIR/src/deepinfer-0.1.0
WHEELS=$CACHE_ROOT/wheels
mkdir -p "$BUILD_DIR/stubs" "$BUILD_DIR/shim" "$WHEELS"

# 1. The venv with torch (install.sh: torch from the PyTorch index; here PyPI's CUDA 13.0 build of the
#    same version, which pulls its nvidia-* libraries: most lie on this machine's local index). The
#    526 MB torch wheel is kept in $WHEELS, so a rebuild for a new patch downloads it only once.
if [ ! -f "$VENV/.torch-ok" ]; then
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    if ! ls "$WHEELS"/torch-"$TORCH_VERSION"-cp312-*.whl >/dev/null 2>&1; then
        log "downloading torch $TORCH_VERSION (cp312)"
        quiet "$VENV/bin/pip" download -q --no-deps -d "$WHEELS" "torch==$TORCH_VERSION"
    fi
    log "installing torch $TORCH_VERSION and its dependencies"
    quiet nice -n "$NICE" "$VENV/bin/pip" install -q --find-links "$WHEELS" "torch==$TORCH_VERSION"
    touch "$VENV/.torch-ok"
fi
export VIRTUAL_ENV=$VENV PATH=$VENV/bin:$PATH
python -W ignore -c 'import torch; assert torch._C._GLIBCXX_USE_CXX11_ABI and torch.version.cuda, "need the CUDA (CXX11 ABI) torch"'

# 2. The sdist. `pip download` prepares its metadata by running setup.py, which needs VIRTUAL_ENV and a
#    CUDA torch (both set above).
mkdir -p "$CACHE_ROOT/sdist"
TARBALL=$CACHE_ROOT/sdist/deepinfer-0.1.0.tar.gz
if ! echo "$SDIST_SHA256  $TARBALL" | sha256sum -c --quiet - >/dev/null 2>&1; then
    log "downloading the deepinfer 0.1.0 sdist"
    rm -f "$TARBALL"
    quiet pip download -q --no-deps --no-build-isolation deepinfer==0.1.0 -d "$CACHE_ROOT/sdist"
    echo "$SDIST_SHA256  $TARBALL" | sha256sum -c --quiet -
fi

# 3. Source tree + patch.
if [ ! -f "$BUILD_DIR/src/.patch-ok" ]; then
    log "unpacking the sdist (patch: $PATCH_ID)"
    rm -rf "$BUILD_DIR/src" && mkdir -p "$BUILD_DIR/src"
    tar -xzf "$TARBALL" -C "$BUILD_DIR/src"
    if [ "$PATCH" != none ]; then
        (cd "$SRC" && patch -p1 --forward --batch --quiet <"$PATCH")
    fi
    touch "$BUILD_DIR/src/.patch-ok"
fi

# 4. DeepInfer's own pins (its requirements.txt: what `pip install deepinfer` would install).
if [ ! -f "$VENV/.pins-ok" ]; then
    log "installing DeepInfer's pinned requirements"
    quiet nice -n "$NICE" pip install -q --find-links "$WHEELS" -r "$SRC/requirements.txt"
    touch "$VENV/.pins-ok"
fi

# 5. libcuda stub and <format> shim.
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
gcc -shared -fPIC -O1 -Wl,-soname,libcuda.so.1 -o "$BUILD_DIR/stubs/libcuda.so.1" "$BUILD_DIR/stubs/cuda_stub.c"
ln -sf libcuda.so.1 "$BUILD_DIR/stubs/libcuda.so"
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

# 6. Build deepinfer._C in place, then install the tree into the venv as an editable install of
#    that in-place build (the prebuilt package ships DeepInfer built in place the same way): its
#    metadata (setup.py dist_info) plus a .pth naming the tree. Not `pip install -e`: that compiles
#    everything again in a temporary directory (measured: a second full build).
if ! ls "$SRC"/deepinfer/_C*.so >/dev/null 2>&1; then
    log "building deepinfer._C (MAX_JOBS=$MAX_JOBS, nice $NICE; ~4 min on 2 idle cores, ~25 under load)"
    BUILD_START_S=$(date +%s)
    (cd "$SRC" && LIBRARY_PATH=$BUILD_DIR/stubs${LIBRARY_PATH:+:$LIBRARY_PATH} \
        CFLAGS="-isystem $BUILD_DIR/shim -DFMT_HEADER_ONLY" \
        nice -n "$NICE" python setup.py -q build_ext --inplace >"$BUILD_DIR/build.log" 2>&1) || {
        tail -40 "$BUILD_DIR/build.log" >&2
        echo "build failed; full log: $BUILD_DIR/build.log" >&2
        exit 1
    }
    log "build_ext took $(($(date +%s) - BUILD_START_S))s"
fi
if [ ! -f "$VENV/.deepinfer-ok" ]; then
    SITE=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    rm -rf "$SITE"/deepinfer-*.dist-info
    (cd "$SRC" && python setup.py -q dist_info --output-dir "$SITE" >>"$BUILD_DIR/build.log" 2>&1)
    echo pip >"$(echo "$SITE"/deepinfer-*.dist-info)/INSTALLER"
    echo "$SRC" >"$SITE/deepinfer-inplace.pth"
    touch "$VENV/.deepinfer-ok"
fi

# 7. The venv must hold exactly the pins the backend is developed against (scripts/deepinfer-pins.txt).
python - "$REPO/scripts/deepinfer-pins.txt" <<'EOF'
import sys
from importlib.metadata import version

pins = [line.split("#")[0].strip() for line in open(sys.argv[1])]
bad = [f"{name} {version(name)} != {want}" for name, want in (p.split("==") for p in pins if p)
       if version(name) != want]
assert not bad, f"the DeepInfer venv disagrees with scripts/deepinfer-pins.txt: {bad}"
EOF

# 8. Smoke test: import the real package and its extension; report whether the patch API is there.
(cd "$BUILD_DIR" && PYTHONPATH=$REPO LD_LIBRARY_PATH=$BUILD_DIR/stubs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
    python "$REPO/scripts/deepinfer_smoke.py")

# 9. The pytest venv, layered over the DeepInfer venv (which stays free of test tools).
if [ ! -f "$BUILD_DIR/pytest-venv/.ok" ]; then
    rm -rf "$BUILD_DIR/pytest-venv"
    "$PY" -m venv "$BUILD_DIR/pytest-venv"
    quiet "$BUILD_DIR/pytest-venv/bin/pip" install -q pytest pytest-timeout hypothesis
    echo "import site; site.addsitedir('$VENV/lib/python3.12/site-packages')" \
        >"$BUILD_DIR/pytest-venv/lib/python3.12/site-packages/zz_deepinfer_venv.pth"
    touch "$BUILD_DIR/pytest-venv/.ok"
fi

touch "$BUILD_DIR/.complete"
log "done: $BUILD_DIR ($(du -sh "$BUILD_DIR" | cut -f1))"
echo "DEEPINFER_BUILD_DIR=$BUILD_DIR"
