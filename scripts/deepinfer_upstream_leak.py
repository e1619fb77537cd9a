"""Run the adapter over an UNPATCHED deepinfer._C (real upstream classes) and show what it does.

    # its own cached build; prints DEEPINFER_BUILD_DIR=...
    DEEPINFER_PATCH=none bash scripts/build_deepinfer.sh
    export DEEPINFER_BUILD_DIR=<that directory>
    PYTHONPATH=. LD_LIBRARY_PATH=$DEEPINFER_BUILD_DIR/stubs $DEEPINFER_BUILD_DIR/pytest-venv/bin/python \
        scripts/deepinfer_upstream_leak.py

Prints the patch detection (prefix cache off, with the reason) and shows upstream 0.1.0 leaking
the blocks and state slot of a chunked prefill aborted between chunks (what the patch fixes).
"""

import os
import socket
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ["DEEPINFER_USE_NEXTN_DECODE"] = "0"
import torch.distributed as dist
from deepinfer import _C as mod  # the unpatched build's DeepInfer venv

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
from tests.deepinfer.deepinfer_harness import Transcript, drive, make_engine, prompt, request


def free_blocks() -> int:
    return e.stats().num_free_blocks


e = make_engine(patched=False, prefix_cache=True, core=mod.engine, dp_group=dist.group.WORLD,
                num_gpu_blocks=64)
print("prefix_cache_supported:", e.prefix_cache_supported, "|", e.prefix_cache_reason)
e.add(request("a", prompt(300, 1), 8))
t = drive(e)
print("a:", t.terminal("a").finish_reason, len(t.tokens("a")), "free", free_blocks())
e.add(request("w", prompt(200, 2), 8))
e.abort(["w"])
t = drive(e)
print("w:", [o.finish_reason for o in t.outputs["w"]], "free", free_blocks())
e.add(request("c", prompt(1500, 7), 4))
seq = e._active["c"].seq
drive(e, until=lambda _t: seq.num_cached_tokens > 0)
e.abort(["c"])
t = Transcript()
try:
    drive(e, t)
except AssertionError as exc:
    print("accounting after abort between chunks:", "LEAK", exc)
print("c:", t.terminal("c").finish_reason, "free", free_blocks(), "of 63; state slots free",
      e.llm.state_manager.get_num_free_blocks())
