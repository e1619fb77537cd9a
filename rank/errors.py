"""Rank-layer errors seen by callers of a ``RankClient`` (the cache and the server).

``EngineMisuse`` and ``CapacityExhausted`` (contract violations and capacity) live in
``rank/engine.py``; these two are about the rank *group*: whether it can take work at all.
"""

from __future__ import annotations


class RankUnavailable(RuntimeError):
    """The rank group is not READY (starting, restarting, stopped or failed); retry later."""


class RankFailed(RuntimeError):
    """The rank group failed while a request or command was in flight; the message says why.

    Everything the dead group held (requests, block ids, epoch) is gone; a restarted group has a
    new ``epoch``.
    """
