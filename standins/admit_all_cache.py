"""A cache stand-in that admits every turn on rank 0 at once: nothing to evict, restore or queue.

For driving the real ``server.service.ChatService`` without the cache: ``bench.serving_bench
--service-only`` (the serving path's own cost) and the submission-order tests. ``cached`` maps a
prompt length to the tokens reported cached for it (0 when absent).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import numpy as np

from cache.turns import TierTokens, Turn


class AdmitAllAdmission:
    """The admission fields a ``Turn`` reads (``cache.turns.Admission``'s, as plain values)."""

    def __init__(self, num_prompt_tokens: int, num_cached_tokens: int, max_output_tokens: int) -> None:
        self.rank = 0
        self.prefix_blocks: list[int] = []
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = num_cached_tokens
        self.queue_time_s = 0.0
        self.restore_s = 0.0
        self.cached_tokens_by_tier = TierTokens()
        self.max_output_tokens = max_output_tokens
        self.session_id = "admit-all"
        self.keep_blocks = False
        self.fold = None  # no folded L1 restore (``Turn.settle_fold`` has nothing to wait for)

    def engine_request(self, request_id: str, prompt_ids: np.ndarray, sampling: object) -> str:
        return request_id  # the stand-in rank clients take the request id alone


class AdmitAllCache:
    def __init__(self, max_output_tokens: int) -> None:
        self.max_output_tokens = max_output_tokens
        self.cached: dict[int, int] = {}  # prompt length -> cached tokens

    @contextlib.asynccontextmanager
    async def turn(self, prompt_ids: np.ndarray, *_: object, **__: object) -> AsyncIterator[Turn]:
        admission = AdmitAllAdmission(len(prompt_ids), self.cached.get(len(prompt_ids), 0),
                                      self.max_output_tokens)
        turn = Turn(self, admission, prompt_ids)  # type: ignore[arg-type]
        try:
            yield turn
        finally:
            turn.exit(True)

    def make_room(self, *_: object) -> None:
        pass

    def finish(self, *_: object) -> None:
        pass

    def abort(self, *_: object) -> None:
        pass
