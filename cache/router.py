"""Which rank a turn runs on.

Rules, in order:

1. A known session goes to its *home* rank (sticky): the rank that holds its prefix. Turns of
   one session are never spread over ranks, whatever the loads, so ties cannot scatter it.
2. Unless its home is overloaded and the session is idle (no turn in flight) and L1 can carry
   it: then the whole session moves to the least-loaded rank (export to the shared host pool on
   the old rank, import on the new one). A move must strictly lower the larger of the two
   loads (``load(home) - load(target) > 2 * session tokens``), the home must carry at least
   ``overload_ratio`` times the target's load plus ``move_min_tokens``, and a session moves at
   most once per ``move_cooldown_s``, so sessions do not ping-pong.
3. A new session goes to the rank with the lowest ``cost = load_tokens + uncached prompt tokens
   on that rank`` (a rank that already holds part of the prompt, e.g. a resumed conversation,
   saves that prefill); ties go to the rank with more free blocks, then the lowest rank index
   (deterministic).
4. On by default (``place_homeless``): a known session with no turn in flight whose home rank
   holds nothing of its prefix, or no more than L1 holds (running it elsewhere costs one host-to-
   GPU copy, no prefill), is *not bound to a rank on arrival*. It waits in every rank's admission
   queue at once and runs on the first rank that has room for it while it is that rank's head
   (late binding, ``AdmissionQueue.enter_any``); when several can take it, the one with the
   least work in flight (``bind_order``). With more sessions than the pools hold, sessions
   rotate through L1 and the KV room freed by a finishing turn is what admits the next one: one
   queue for the node admits the oldest waiter wherever room appears, where per-rank queues
   left turns waiting on one rank while another had room (``docs/loadtest.md``). The price: a
   turn that fits nowhere yet heads every queue it is in, not only its home's; turns behind it
   overtake only into free blocks, as behind any head, and after ``queue_force_after_s`` it may
   evict protected sessions, which bounds that stall. Not within ``move_cooldown_s`` of a move
   (``rebalance``, ``move_session``): the move chose its home.

Branches and prefixes held elsewhere (``cache/sessions.py``): each branch of a session (a
subagent, keyed by its agent id or detected from its prompts) is a session of its own for rules
1-4, so concurrent branches spread over the ranks by cost and each one's later turns stay on the
rank holding its prefix. In rule 3's cost, prefix tokens resident on another rank (the system
prompt and tools a branch shares with its parent, or any new session of the same client) or in
L1 cost ``l1_copy_cost`` of a prefilled token: the turn may run on a less loaded rank and get
them by one copy through L1 (``RouteDecision.copy_from``: the manager writes that chain to L1
from the rank holding it, and the admission restores it) when that is cheaper than running where
they are. Auxiliary requests (titles, memory passes: ``RequestClass.AUXILIARY``) have no home:
every one goes to the cheapest rank by rule 3, with no copy, and never moves anything. A new
branch's rule-3 cost counts the work in flight (running + waiting tokens, as rule 4) instead of
the whole load: it runs beside its siblings, and in lockstep the busiest rank paces every step.

Load measure (``RankLoad.load_tokens``): running tokens (context of admitted, unfinished turns)
+ waiting tokens (prompt tokens of turns queued for admission) + idle tokens (last context of
idle sessions homed on the rank and expected back within ``home_horizon_s``). Idle sessions
count because their next turns will run there and their blocks occupy that rank's pool; a rank
with few running turns but many homed sessions is not free.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cache.sessions import RequestClass, Session
from rank.ids import Rank


class RouteReason(str, enum.Enum):
    """Which rule placed a turn (module docstring): its value is the metric/log label."""

    HOME = "home"  # rule 1: a known session's home rank
    MOVE = "move"  # rule 2: the session moves off an overloaded home
    NEW = "new"  # rule 3: a new session, on the cheapest rank
    HOMELESS = "homeless"  # rule 4: nothing on its home rank that L1 lacks: runs where room appears first
    AUXILIARY = "auxiliary"  # an auxiliary request: the cheapest rank, never a home


@dataclass(frozen=True, slots=True)
class RankLoad:
    rank: Rank
    running_tokens: int
    waiting_tokens: int
    idle_tokens: int
    num_free_blocks: int

    @property
    def load_tokens(self) -> int:
        return self.running_tokens + self.waiting_tokens + self.idle_tokens


@dataclass(frozen=True, slots=True)
class RouteDecision:
    rank: Rank
    reason: RouteReason
    move_from: Rank | None = None
    # Rule 4 only: the other ranks the turn may run on (``rank`` is the one preferred now).
    also: tuple[Rank, ...] = ()
    # Rule 3: copy the prompt's first ``copy_blocks`` blocks from ``copy_from`` through L1.
    copy_from: Rank | None = None
    copy_blocks: int = 0

    @property
    def candidates(self) -> tuple[Rank, ...]:
        return (self.rank, *self.also)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    overload_ratio: float = 1.5
    move_min_tokens: int = 65_536
    move_cooldown_s: float = 60.0
    place_homeless: bool = True
    # What a prefix token held on another rank (or in L1) costs on this one, in prefilled tokens:
    # one GPU -> host -> GPU copy against a prefill; and the least worth copying.
    l1_copy_cost: float = 0.1
    copy_min_tokens: int = 2048


class Router:
    def __init__(self, config: RouterConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size

    def route(
        self,
        session: Session,
        matched_blocks: Sequence[int],
        num_prompt_tokens: int,
        loads: Sequence[RankLoad],
        can_move: bool,
        now_s: float,
        l1_blocks: int = 0,
    ) -> RouteDecision:
        """Pick the rank for one turn. ``matched_blocks[r]`` is the L0 prefix match on rank r,
        ``l1_blocks`` the prefix blocks L1 holds (readable)."""
        if session.request_class is RequestClass.AUXILIARY:
            best = self._by_cost(loads, matched_blocks, num_prompt_tokens, lambda load: load.load_tokens)[0]
            return RouteDecision(best, RouteReason.AUXILIARY)
        home = session.home_rank
        homeless = (
            home is not None and self.config.place_homeless and can_move
            and session.num_in_flight == 0 and matched_blocks[home] <= l1_blocks
            and now_s - session.moved_at_s >= self.config.move_cooldown_s  # a move chose its home
        )
        if home is not None and not homeless:
            target = self._move_target(session, loads, can_move, now_s)
            if target is not None:
                return RouteDecision(target, RouteReason.MOVE, move_from=home)
            return RouteDecision(home, RouteReason.HOME)

        if homeless:
            order = self.bind_order(loads, matched_blocks, num_prompt_tokens)
            return RouteDecision(order[0], RouteReason.HOMELESS, also=tuple(order[1:]))
        held = max(matched_blocks, default=0)
        copy_ok = can_move and held * self.block_size >= self.config.copy_min_tokens
        copyable = max(held, l1_blocks) if copy_ok else l1_blocks if can_move else 0
        # A branch runs beside its siblings (1-4 at once, short-lived): what it competes with is
        # the work in flight (lockstep: the busiest rank paces every step), not idle sessions.
        work: Callable[[RankLoad], int] = (
            (lambda load: load.running_tokens + load.waiting_tokens)
            if session.request_class is RequestClass.SUBAGENT else (lambda load: load.load_tokens)
        )
        best = self._by_cost(loads, matched_blocks, num_prompt_tokens, work, copyable)[0]
        if copy_ok and held > max(matched_blocks[best], l1_blocks) and (
            (held - matched_blocks[best]) * self.block_size >= self.config.copy_min_tokens
        ):
            src = max(range(len(matched_blocks)), key=lambda r: (matched_blocks[r], -r))
            return RouteDecision(best, RouteReason.NEW, copy_from=Rank(src), copy_blocks=held)
        return RouteDecision(best, RouteReason.NEW)

    def bind_order(
        self, loads: Sequence[RankLoad], matched_blocks: Sequence[int], num_prompt_tokens: int
    ) -> list[Rank]:
        """Rule 4's preference among ranks that could all take the turn now: the least work in
        flight (running + queued tokens: in lockstep the busiest rank sets every rank's step
        time; idle sessions do not decode) plus the prompt tokens not resident there, so a rank
        holding the prefix wins unless it is busier by about that much. Then more free blocks,
        then the lower index."""
        return self._by_cost(loads, matched_blocks, num_prompt_tokens,
                             lambda load: load.running_tokens + load.waiting_tokens)

    def _by_cost(
        self, loads: Sequence[RankLoad], matched_blocks: Sequence[int], num_prompt_tokens: int,
        work: Callable[[RankLoad], int], copyable_blocks: int = 0,
    ) -> list[Rank]:
        """Ranks by ``work(load)`` + the prompt tokens not resident there (those another rank or
        L1 holds, ``copyable_blocks``, at ``l1_copy_cost``), then more free blocks, then the lower
        index (rule 3 with the whole load, rule 4 with the work in flight)."""
        bs = self.block_size
        copy_cost = self.config.l1_copy_cost

        def cost(load: RankLoad) -> tuple[float, int, int]:
            cached_tokens = min(num_prompt_tokens, matched_blocks[load.rank] * bs)
            copied_tokens = max(0, min(num_prompt_tokens, copyable_blocks * bs) - cached_tokens)
            uncached = num_prompt_tokens - cached_tokens - copied_tokens * (1.0 - copy_cost)
            return (work(load) + uncached, -load.num_free_blocks, load.rank)

        return [load.rank for load in sorted(loads, key=cost)]

    def _move_target(
        self, session: Session, loads: Sequence[RankLoad], can_move: bool, now_s: float
    ) -> Rank | None:
        cfg = self.config
        home = session.home_rank
        if (
            not can_move
            or home is None
            or session.num_in_flight > 0
            or now_s - session.moved_at_s < cfg.move_cooldown_s
        ):
            return None
        home_load = loads[home].load_tokens
        best = min(loads, key=lambda x: (x.load_tokens, -x.num_free_blocks, x.rank))
        if best.rank == home:
            return None
        gap_tokens = home_load - best.load_tokens
        if (
            home_load >= cfg.overload_ratio * best.load_tokens + cfg.move_min_tokens
            and gap_tokens > 2 * session.context_tokens
        ):
            return best.rank
        return None
