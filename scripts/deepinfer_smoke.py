"""Load a built deepinfer._C by path and report whether the prefix-cache patch API is present.

Usage (from scripts/build_deepinfer.sh): python scripts/deepinfer_smoke.py SRC_DIR STUB_DIR
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch  # noqa: F401  (deepinfer._C needs libc10 loaded first)

from rank.deepinfer_adapter import patch_missing_reason
from rank.fake_deepinfer import load_native_extension


def main(argv: list[str]) -> int:
    native = load_native_extension(argv[1], argv[2] if len(argv) > 2 else None)
    engine = native.engine
    print("deepinfer._C loaded from", native.__file__)
    reason = patch_missing_reason(
        SimpleNamespace(Scheduler=engine.Scheduler, BlockManager=engine.BlockManager, Sequence=engine.Sequence))
    print("prefix-cache patch:", "present" if reason is None else f"MISSING ({reason})")
    bm = engine.BlockManager(100)
    assert bm.get_num_free_blocks() == 99, "block 0 must be reserved"
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
