"""Minimal version-range checks (tl-core depends on torch and numpy only, not packaging)."""

from __future__ import annotations

import re

__all__ = ["parse_version", "version_in_range"]

_RELEASE = re.compile(r"^\s*v?(\d+(?:\.\d+)*)")
_CLAUSE = re.compile(r"^\s*(>=|<=|==|!=|>|<|~=)\s*([0-9][0-9.]*)\s*$")


def parse_version(text: str) -> tuple[int, ...]:
    """The numeric release part of a version (``"0.32.1+cpu"`` -> ``(0, 32, 1)``).

    Raises:
        ValueError: If ``text`` does not start with a release number.
    """
    match = _RELEASE.match(text)
    if not match:
        raise ValueError(f"cannot read a version number from {text!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def _pad(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    width = max(len(a), len(b))
    return a + (0,) * (width - len(a)), b + (0,) * (width - len(b))


def version_in_range(version: str, spec: str) -> bool:
    """Whether ``version`` satisfies a comma-separated range such as ``">=0.32,<0.33"``.

    Pre-release and local labels are ignored: ``0.32.0rc1`` and ``0.32.0+cpu`` count as
    ``0.32.0``, which is what an engine build label means for a supported window.

    Raises:
        ValueError: If ``spec`` has a clause this parser does not understand.
    """
    found = parse_version(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        match = _CLAUSE.match(clause)
        if not match:
            raise ValueError(f"unsupported version clause {clause!r} in {spec!r}")
        op, bound_text = match.groups()
        bound = tuple(int(p) for p in bound_text.split("."))
        a, b = _pad(found, bound)
        if op == "~=":
            prefix = bound[:-1]
            ok = a >= b and found[: len(prefix)] == prefix
        else:
            ok = {
                ">=": a >= b,
                "<=": a <= b,
                ">": a > b,
                "<": a < b,
                "==": a == b,
                "!=": a != b,
            }[op]
        if not ok:
            return False
    return True
