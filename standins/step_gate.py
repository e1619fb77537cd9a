"""TESTS ONLY: hold a rank's engine steps at a test's gate, so a test orders events without a clock.

Selected in the rank processes by ``DIB_TEST_ENGINE_WRAPPER=standins.step_gate``
(``rank/rank_setup.py``), with the gate directory in ``DIB_TEST_TRANSFER_GATE`` (``rank/transfers.py``):
while ``<dir>/hold-step`` exists, every ``engine.step()`` waits before it runs, and the marker
``<dir>/held-step`` says one is waiting. The transfer tests hold a step this way and show that L1
transfers and releases still complete beside it (``tests/rank/test_rank_transfer_thread.py``,
``tests/rank/test_rank_deepinfer_transfers.py``).
"""

from __future__ import annotations

from collections.abc import Callable

from rank.engine import Engine, RequestOutput
from rank.transfers import hold_at_gate


def wrap_engine(engine: Engine) -> Engine:
    """``engine`` with its ``step`` held at the gate named ``step`` first."""
    step: Callable[[], list[RequestOutput]] = engine.step

    def held_step() -> list[RequestOutput]:
        hold_at_gate("step")
        return step()

    engine.step = held_step  # type: ignore[method-assign]
    return engine
