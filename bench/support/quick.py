"""``--quick``: one flag that every bench entry point takes for its smallest run.

A quick run uses tiny sizes, on the CPU where the bench has a CPU path (``--device cpu``; the
two with none still need CUDA), lasts seconds and prints the same figure lines as a full run
(the figures themselves mean little at that size). The default suite runs every entry point
this way (``tests/bench/test_bench_entry_points.py``), so a benchmark that nothing else runs
cannot break unnoticed. The quick sizes are argument defaults: a flag given next to ``--quick``
still wins (``--quick --tokens 8192``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

HELP = "tiny sizes, seconds (the default suite runs every bench this way): "


def add_quick(parser: argparse.ArgumentParser, argv: Sequence[str] | None, **sizes: object) -> None:
    """Adds ``--quick`` to ``parser``; when ``argv`` (``None``: the command line) holds it, ``sizes``
    become the parser's defaults, and a required flag named there (``--out``, ``--url``) is no
    longer required. Call it after the other arguments are added, before parsing."""
    shown = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in sizes.items())
    parser.add_argument("--quick", action="store_true", help=HELP + (shown or "the defaults"))
    if requested(argv):
        parser.set_defaults(**sizes)
        for action in parser._actions:  # argparse has no public way to relax a flag
            if action.dest in sizes:
                action.required = False


def requested(argv: Sequence[str] | None) -> bool:
    """Whether ``argv`` (``None``: the command line) asks for a quick run."""
    return "--quick" in (sys.argv[1:] if argv is None else argv)
