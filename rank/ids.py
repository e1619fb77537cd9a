"""Names for the plain values that cross the rank/cache seam.

Block hashes, block ids, ranks and host slots are all ints (and session ids are strings); mixing
them up is the classic bug in a cache index, and a type checker catches it only when each has
its own name. ``NewType`` costs nothing at run time (``BlockId(7) is 7``), so wire decoding and
hot loops keep plain ints; the names are for signatures and records.

This module sits at the bottom of the layers (``rank`` < ``cache`` < ``server``), so the rank
layer, the cache and the server can all spell the same names. It imports nothing.

* ``BlockId``: a KV block of one rank's pool, ``1 .. num_blocks-1`` (0 is scratch); valid only
  within one rank and one group epoch.
* ``Rank``: a rank's index in the group, ``0 .. num_ranks-1``.
* ``HostSlot``: a slot of the shared L1 host pool (one block row each).
* ``Epoch``: a rank group's incarnation; every block id and in-flight request dies with it (the
  host pool's slots outlive it: ``cache/state.py`` ``reset``).
* ``BlockHash``: the chain hash naming a full block's content (``cache.hashing``).
* ``SessionId``: the cache's key for a conversation (``cache.sessions``; see
  ``session_id_for_hint`` there for how a client's hint becomes one).
"""

from __future__ import annotations

from typing import NewType

BlockId = NewType("BlockId", int)
Rank = NewType("Rank", int)
HostSlot = NewType("HostSlot", int)
Epoch = NewType("Epoch", int)
BlockHash = NewType("BlockHash", int)
SessionId = NewType("SessionId", str)

__all__ = ["BlockHash", "BlockId", "Epoch", "HostSlot", "Rank", "SessionId"]
