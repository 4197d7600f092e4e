"""The ``parity`` pytest fixture (registered through the ``pytest11`` entry point).

A driver's tests assert parity in one line::

    def test_parity(parity, checkpoint):
        parity.assert_passes(checkpoint, candidate="vllm")

The plugin imports nothing heavy: ``run_parity`` loads only when a test uses it.
"""

from __future__ import annotations

from typing import Any

import pytest

__all__ = ["ParityAssertion", "ParityChecker", "parity"]


class ParityAssertion(AssertionError):
    """A parity run that did not pass; the message lists every failing row."""


class ParityChecker:
    """What the ``parity`` fixture gives: ``run`` (a report) and ``assert_passes``."""

    def run(self, model: Any, *, candidate: str, **kwargs: Any) -> Any:
        """``run_parity(model, candidate=..., quiet=True, **kwargs)``; returns the report."""
        from tl_parity._run import run_parity

        kwargs.setdefault("quiet", True)
        return run_parity(model, candidate=candidate, **kwargs)

    def assert_passes(self, model: Any, *, candidate: str, **kwargs: Any) -> Any:
        """Run parity and raise ``ParityAssertion`` naming each failing hook and its numbers.

        Args:
            model: Checkpoint folder (or native preset).
            candidate: Driver under test.
            **kwargs: Any other ``run_parity`` argument (``reference``, ``dtype``,
                ``layers``, ``candidate_options``, ...).

        Returns:
            The passing ``ParityReport``.

        Raises:
            ParityAssertion: A driver failed, or a row is not ``PASS``.
        """
        report = self.run(model, candidate=candidate, **kwargs)
        if not report.passed:
            raise ParityAssertion(describe_failure(report))
        return report


def describe_failure(report: Any) -> str:
    """One line per failing row: hook, status, numbers, tolerance and diagnostic."""
    head = f"parity {report.candidate!r} vs {report.reference!r} on {report.model} ({report.dtype}) failed"
    if report.error:
        return f"{head}: {report.error}"
    rows = report.failures
    if not rows:
        return f"{head}: no rows compared"
    lines = [f"{head}: {len(rows)} rows not PASS"]
    for r in rows:
        lines.append(
            f"  {r.hook} [{r.status}] shape={r.shape} max_abs={r.max_abs:.3g} max_rel={r.max_rel:.3g} "
            f"atol={r.atol:.2g} rtol={r.rtol:.2g}" + (f" -- {r.diagnostic}" if r.diagnostic else "")
        )
    return "\n".join(lines)


@pytest.fixture
def parity() -> ParityChecker:
    """Run parity reports from a test: ``parity.assert_passes(model, candidate="vllm")``."""
    return ParityChecker()
