"""Preflight results: one ``CheckResult`` per check, gathered in a ``PreflightReport``.

A check says what it measured (``detail``), how bad it is (``status``) and, unless it passed,
the fix in one sentence (``fix``). ``data`` carries the measured values for ``--json`` and
``/healthz`` so tooling never has to parse the prose.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any


class Status(str, enum.Enum):
    """Severity of one check. Only FATAL stops ``setup()``."""

    OK = "ok"
    WARN = "warn"
    FATAL = "fatal"
    SKIPPED = "skipped"


class PreflightError(RuntimeError):
    """Raised by ``PreflightReport.raise_if_fatal``; the message lists every fatal check."""


@dataclass(slots=True, frozen=True)
class CheckResult:
    """The outcome of one check.

    Invariant: ``fix`` is non-empty exactly when ``status`` is WARN or FATAL (the operator is
    always told what to do about a problem, and never told to fix something that passed).
    """

    name: str
    status: Status
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        needs_fix = self.status in (Status.WARN, Status.FATAL)
        assert bool(self.fix) == needs_fix, f"check {self.name}: fix must be set iff warn/fatal"

    def line(self) -> str:
        """One line: ``name: detail. Fix: fix`` (the form used in logs and /healthz)."""
        text = f"{self.name}: {self.detail}"
        return f"{text} Fix: {self.fix}" if self.fix else text

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status.value,
            "detail": self.detail,
            "fix": self.fix,
            "data": self.data,
        }


def ok(name: str, detail: str, **data: Any) -> CheckResult:
    return CheckResult(name, Status.OK, detail, "", data)


def warn(name: str, detail: str, fix: str, **data: Any) -> CheckResult:
    return CheckResult(name, Status.WARN, detail, fix, data)


def fatal(name: str, detail: str, fix: str, **data: Any) -> CheckResult:
    return CheckResult(name, Status.FATAL, detail, fix, data)


def skipped(name: str, detail: str, **data: Any) -> CheckResult:
    return CheckResult(name, Status.SKIPPED, detail, "", data)


def problem(name: str, is_fatal: bool, detail: str, fix: str, **data: Any) -> CheckResult:
    """FATAL or WARN for the same finding: most checks are fatal only for engine 'deepinfer'."""
    return CheckResult(name, Status.FATAL if is_fatal else Status.WARN, detail, fix, data)


class PreflightReport:
    """All check results of one preflight run, in the order they ran."""

    __slots__ = ("checks", "context")

    def __init__(self, checks: Iterable[CheckResult], context: dict[str, Any] | None = None) -> None:
        self.checks: list[CheckResult] = list(checks)
        self.context: dict[str, Any] = dict(context or {})

    def __iter__(self) -> Iterator[CheckResult]:
        return iter(self.checks)

    def get(self, name: str) -> CheckResult | None:
        for check in self.checks:
            if check.name == name:
                return check
        return None

    @property
    def has_fatal(self) -> bool:
        return any(c.status is Status.FATAL for c in self.checks)

    def fatal_checks(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status is Status.FATAL]

    def warning_checks(self) -> list[CheckResult]:
        return [c for c in self.checks if c.status is Status.WARN]

    def warnings(self) -> list[str]:
        """Non-fatal problems, one line each, for the log and ``/healthz``."""
        return [c.line() for c in self.warning_checks()]

    def fatal_message(self) -> str:
        lines = [c.line() for c in self.fatal_checks()]
        return "preflight failed: " + " | ".join(lines) if lines else ""

    def raise_if_fatal(self) -> None:
        """Raise ``PreflightError`` naming every fatal check (what ``setup()`` calls)."""
        if self.has_fatal:
            raise PreflightError(self.fatal_message())

    def to_dict(self) -> dict[str, Any]:
        counts = {s.value: 0 for s in Status}
        for check in self.checks:
            counts[check.status.value] += 1
        return {
            "ok": not self.has_fatal,
            "counts": counts,
            "context": self.context,
            "checks": [c.to_dict() for c in self.checks],
            "warnings": self.warnings(),
        }

    def log(self, logger: logging.Logger) -> None:
        """Log every check at a level matching its status (fatal as error)."""
        levels = {
            Status.OK: logging.INFO,
            Status.SKIPPED: logging.INFO,
            Status.WARN: logging.WARNING,
            Status.FATAL: logging.ERROR,
        }
        for check in self.checks:
            logger.log(levels[check.status], "preflight %s %s", check.status.value, check.line())

    def format_text(self) -> str:
        """The human report printed by the CLI."""
        ctx = self.context
        head = (
            f"DeepInfer backend preflight: engine {ctx.get('engine')}, ep {ctx.get('ep')}, "
            f"model_dir {ctx.get('model_dir') or '-'}"
        )
        width = max((len(c.name) for c in self.checks), default=4)
        lines = [head, ""]
        for check in self.checks:
            tag = f"[{check.status.value.upper()}]"
            lines.append(f"  {tag:<9} {check.name:<{width}}  {check.detail}")
            if check.fix:
                lines.append(f"  {'':<9} {'':<{width}}  fix: {check.fix}")
        num_fatal = len(self.fatal_checks())
        num_warn = len(self.warning_checks())
        verdict = "setup() would stop" if num_fatal else "setup() would continue"
        lines += ["", f"Result: {num_fatal} fatal, {num_warn} warnings: {verdict}."]
        return "\n".join(lines)
