"""Messages between the backend (``RankGroup``) and a rank process (``rank.worker``).

Every message is a zmq multipart message whose first frame is a small orjson header; bulk data
(prompt ids, a step's output ids) travels in further frames as raw little-endian int32 bytes, so
nothing per token is JSON-encoded. One ``step`` message carries every output of one engine step:

    header {"t": "step", "stats": [9 ints], "fin": [[index, reason, n_prompt, n_cached,
            kept_blocks, error], ...]}  (one entry per finished output)
    frame 1: int32 handles (one per output; the backend's id for the request)
    frame 2: int32 token counts (one per output)
    frame 3: int32 token ids (all outputs' ids, concatenated)

Commands (backend -> rank): ``add`` (+ prompt frame), ``abort``, ``release``, ``export``,
``import``, ``shutdown``. ``release``/``export``/``import`` carry a command id ``cid`` that the
``reply`` echoes; an ``add`` the engine rejects is answered by ``reject`` with its handle. An
``add`` may carry an L1 import to run first (``im``, ``apply_fold``): its reply echoes that ``cid``.
Other rank messages: ``hb`` (heartbeat, with load progress), ``ready`` (geometry), ``fatal``.
"""

from __future__ import annotations

from array import array
from itertools import chain
from typing import Any

import numpy as np
import orjson

from rank.engine import EngineRequest, EngineStats, RequestOutput, SamplingParams

STATS_FIELDS = (
    "num_blocks", "num_free_blocks", "num_cached_blocks", "num_running", "num_waiting",
    "running_tokens", "waiting_tokens", "num_cached_tokens_total", "num_prompt_tokens_total",
    "num_vote_fillers_total",
)


def pack(header: dict[str, Any], *frames: bytes) -> list[bytes]:
    return [orjson.dumps(header), *frames]


def unpack_header(frame: bytes) -> dict[str, Any]:
    header: dict[str, Any] = orjson.loads(frame)
    return header


def encode_add(request: EngineRequest, handle: int, fold_cid: int = 0) -> tuple[dict[str, Any], bytes]:
    """An ``add`` command: its header and its prompt frame. A request with a ``fold`` carries it
    as ``im`` (``fold_cid``: the id its reply echoes; ``apply_fold``)."""
    sp = request.sampling
    header: dict[str, Any] = {
        "op": "add", "rid": request.request_id, "h": handle,
        "sp": [sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.ignore_eos],
        "pb": [int(b) for b in request.prefix_blocks], "nc": request.num_cached_tokens,
        "kb": request.keep_blocks,
    }
    fold = request.fold
    if fold is not None:
        header["im"] = {"cid": fold_cid, "slot": int(fold.host_slot), "n": int(fold.num_blocks),
                        "fb": int(fold.fallback_blocks), "fnc": int(fold.fallback_tokens)}
    prompt = np.ascontiguousarray(request.prompt_ids, dtype="<i4")
    return header, prompt.tobytes()


def apply_fold(header: dict[str, Any], reply: dict[str, Any]) -> None:
    """An ``add`` whose ``im`` import ran (``reply``, as ``rank/transfers.py`` ``run_command``
    returns it): its prefix gets the imported blocks, or, if the import failed, shrinks to the
    fallback; the reply moves to ``imr`` (sent by the loop thread once the add is applied)."""
    im = header.pop("im")
    if reply["ok"]:
        header["pb"] = [*header["pb"], *reply["result"]]
    else:
        header["pb"] = header["pb"][: im["fb"]]
        header["nc"] = im["fnc"]
    header["imr"] = reply


def decode_add(header: dict[str, Any], prompt_frame: bytes) -> EngineRequest:
    max_tokens, temperature, top_p, top_k, seed, ignore_eos = header["sp"]
    return EngineRequest(
        request_id=header["rid"],
        prompt_ids=np.frombuffer(prompt_frame, dtype="<i4").astype(np.int32),
        sampling=SamplingParams(max_tokens, temperature, top_p, top_k, seed, ignore_eos),
        prefix_blocks=tuple(header["pb"]),
        num_cached_tokens=header["nc"],
        keep_blocks=header["kb"],
    )


def stats_list(stats: EngineStats) -> list[int]:
    return [getattr(stats, name) for name in STATS_FIELDS]


def stats_from_list(values: list[int]) -> EngineStats:
    return EngineStats(*values)


def encode_step(outputs: list[RequestOutput], handles: dict[str, int], stats: EngineStats) -> list[bytes]:
    """Encode a step's outputs; drops handles of finished requests from ``handles``.

    Called every step with one output per running sequence: whole-list comprehensions, no
    per-output appends.
    """
    get = handles.get
    hs = array("i", [get(out.request_id, -1) for out in outputs])
    ids = [out.token_ids for out in outputs]
    counts = array("i", map(len, ids))
    tokens = array("i", chain.from_iterable(ids))
    fin: list[list[Any]] = [[i, out.finish_reason.value if out.finish_reason else None, out.num_prompt_tokens,
                             out.num_cached_tokens, out.kept_blocks, out.error]
                            for i, out in enumerate(outputs) if out.finished]
    for entry in fin:
        handles.pop(outputs[entry[0]].request_id, None)
    header = {"t": "step", "stats": stats_list(stats), "fin": fin}
    return pack(header, hs.tobytes(), counts.tobytes(), tokens.tobytes())
