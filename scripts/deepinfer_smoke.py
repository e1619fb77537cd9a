"""Import the installed DeepInfer package and its extension; report whether the prefix-cache patch
API is present.

Usage (from scripts/build_deepinfer.sh, with the DeepInfer venv's interpreter and the libcuda stub
on LD_LIBRARY_PATH): PYTHONPATH=<repo> python scripts/deepinfer_smoke.py
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch  # noqa: F401  (deepinfer._C needs libc10 loaded first)


def main() -> int:
    import deepinfer
    from deepinfer._C import engine

    from rank.deepinfer_settings import patch_missing_reason

    print(f"deepinfer {deepinfer.__version__} from {deepinfer.__file__}; _C from {engine.__name__}")
    reason = patch_missing_reason(
        SimpleNamespace(Scheduler=engine.Scheduler, BlockManager=engine.BlockManager,
                        Sequence=engine.Sequence))
    print("prefix-cache patch:", "present" if reason is None else f"MISSING ({reason})")
    bm = engine.BlockManager(100)
    assert bm.get_num_free_blocks() == 99, "block 0 must be reserved"
    return 0


if __name__ == "__main__":
    sys.exit(main())
