"""``tl parity --candidate all``: every installed driver on tiny checkpoints, as a report card.

Each driver but the reference runs on a tiny random checkpoint of every family
``tl_driver_hf.testing`` can write (cached in a folder). The native driver loads no
checkpoints, so it is compared with itself (two processes) on each of its presets: a
determinism and batching check in the same-engine band, not a cross-engine one.

A candidate that refuses a family at boot (``ConfigError``, ``UnsupportedFeatureError``) is
a SKIP only when it does not declare that family's architecture (``tl_parity._declared``);
refusing a declared architecture, or failing in any other way, is a FAIL.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CardRow", "NATIVE_PRESETS", "VLLM_TINY_OPTIONS", "format_card", "run_card"]

#: Presets of the native driver (its model zoo).
NATIVE_PRESETS: tuple[str, ...] = ("gpt2", "llama")
#: Engine settings for tiny checkpoints on vLLM: small KV cache, short context.
VLLM_TINY_OPTIONS: dict[str, Any] = {"max_model_len": 256, "kv_cache_memory_bytes": 32 * 2**20}
#: Distributions whose drivers are deliberately wrong (tl-parity's own test fixtures).
FIXTURE_DISTRIBUTIONS: frozenset[str] = frozenset({"tl-parity-faults"})


@dataclass(frozen=True)
class CardRow:
    """One cell of the card: a driver on one family (or native preset)."""

    driver: str
    family: str
    status: str  # PASS, FAIL or SKIP
    detail: str


def _cache_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    root = os.environ.get("TL_PARITY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tl-parity"
    )
    return Path(root) / "tiny"


def tiny_checkpoints(families: list[str] | None, cache: Path) -> tuple[dict[str, Path], str | None]:
    """Write (or reuse) a tiny checkpoint per family; ``(paths, reason)`` when that is impossible."""
    try:
        from tl_driver_hf.testing import TINY_FAMILIES, write_tiny_checkpoint
    except ImportError:
        return {}, "tiny checkpoints need tl-driver-hf (pip install tl-driver-hf)"
    chosen = list(TINY_FAMILIES) if families is None else families
    unknown = [f for f in chosen if f not in TINY_FAMILIES]
    if unknown:
        from tl_core import UserError

        raise UserError(f"unknown tiny families {unknown}; known: {', '.join(TINY_FAMILIES)}")
    paths = {}
    for family in chosen:
        folder = cache / family
        if not (folder / "config.json").exists():
            folder.mkdir(parents=True, exist_ok=True)
            write_tiny_checkpoint(family, folder)
        paths[family] = folder
    return paths, None


def _row(driver: str, family: str, report: Any) -> CardRow:
    if report.error:
        return _error_row(driver, family, report.error, report.extra.get("failure") or {})
    if report.passed:
        agree = "" if report.argmax_agreement is None else f", argmax {report.argmax_agreement:.0%}"
        return CardRow(driver, family, "PASS", f"{len(report.hooks)} hooks{agree}")
    bad = report.failures
    return CardRow(
        driver, family, "FAIL", f"{len(bad)} rows not PASS: " + ", ".join(r.hook for r in bad[:4])
    )


def _error_row(driver: str, family: str, err: str, failure: dict[str, Any]) -> CardRow:
    """SKIP a reference failure and a refusal of an undeclared architecture; FAIL the rest."""
    if failure.get("side") == "reference" or err.startswith("reference"):
        return CardRow(driver, family, "SKIP", f"reference cannot run it: {err}")
    if failure.get("side") != "candidate" or not failure.get("refusal"):
        return CardRow(driver, family, "FAIL", err)
    detail = err.split("failed: ", 1)[-1]
    arch = failure.get("architecture")
    if failure.get("declared") is True:
        return CardRow(
            driver,
            family,
            "FAIL",
            f"refused {arch!r} at boot, although the driver declares it supported: {detail}",
        )
    if failure.get("declared") is None:
        why = (
            "the checkpoint names no architecture"
            if arch is None
            else "the driver declares no supported_architectures"
        )
        detail += f" (not checked against a declaration: {why})"
    return CardRow(driver, family, "SKIP", detail)


def _check_args(
    args: argparse.Namespace, families: list[str] | None, only: set[str] | None
) -> None:
    """Refuse an unknown reference, ``--drivers`` name or ``--families`` name before any run."""
    from tl_core.driver_api import available_drivers, get_driver_entry
    from tl_parity._checks import check_driver

    check_driver(args.reference, "reference")
    installed = available_drivers()
    for name in sorted(only or ()):
        if name not in installed:
            try:
                get_driver_entry(name)  # raises, naming the installed drivers and the closest one
            except ValueError as exc:
                raise type(exc)(f"--drivers: {exc}") from exc
    if families is not None:
        try:
            from tl_driver_hf.testing import TINY_FAMILIES
        except ImportError:
            return  # reported as a SKIP row: tiny checkpoints need tl-driver-hf
        unknown = [f for f in families if f not in TINY_FAMILIES]
        if unknown:
            import difflib

            from tl_core import UserError

            close = {f: difflib.get_close_matches(f, TINY_FAMILIES, n=1) for f in unknown}
            hints = [f"{f!r} (did you mean {c[0]!r}?)" if c else repr(f) for f, c in close.items()]
            raise UserError(
                f"--families: unknown tiny families {', '.join(hints)}; "
                f"known: {', '.join(TINY_FAMILIES)}"
            )


def build_card(args: argparse.Namespace) -> list[CardRow]:
    """Run every installed driver except the reference; one row per driver and family."""
    from tl_core.driver_api import available_drivers
    from tl_parity._run import Progress, run_parity_many

    show = Progress(quiet=args.quiet)
    families = [f.strip() for f in args.families.split(",")] if args.families else None
    rows: list[CardRow] = []
    checkpoints: dict[str, Path] | None = None
    reason: str | None = None
    only = {d.strip() for d in args.drivers.split(",") if d.strip()} if args.drivers else None
    _check_args(args, families, only)
    for name, installed in sorted(available_drivers().items()):
        if (name == args.reference and name != "native") or (only is not None and name not in only):
            continue
        if installed.distribution in FIXTURE_DISTRIBUTIONS:
            rows.append(CardRow(name, "-", "SKIP", "fault-injection fixture driver"))
            continue
        if installed.error is not None:
            rows.append(CardRow(name, "-", "SKIP", f"driver does not load: {installed.error}"))
            continue
        engine = installed.entry.engine if installed.entry is not None else None
        if engine is not None:
            try:
                engine.check(name)
            except Exception as exc:  # engine missing or out of range: nothing to run
                rows.append(CardRow(name, "-", "SKIP", f"{type(exc).__name__}: {exc}"))
                continue
        if name == "native":
            reports = run_parity_many(
                list(NATIVE_PRESETS),
                candidate="native",
                reference="native",
                dtype=args.dtype,
                prompts=args.prompts,
                layers=args.layers,
                progress=show,
            )
            rows += [_row(name, f"native:{r.model}", r) for r in reports]
            continue
        if checkpoints is None:
            checkpoints, reason = tiny_checkpoints(families, _cache_dir(args.cache_dir))
        if reason is not None:
            rows.append(CardRow(name, "-", "SKIP", reason))
            continue
        options = dict(VLLM_TINY_OPTIONS) if name == "vllm" else {}
        options.update(dict(args.candidate_option))
        reports = run_parity_many(
            [str(p) for p in checkpoints.values()],
            candidate=name,
            reference=args.reference,
            dtype=args.dtype,
            prompts=args.prompts,
            layers=args.layers,
            candidate_options=options,
            reference_options=dict(args.reference_option),
            progress=show,
        )
        rows += [_row(name, fam, r) for fam, r in zip(checkpoints, reports, strict=True)]
    return rows


def format_card(rows: list[CardRow], reference: str) -> str:
    """The card as a fixed-width table with a one-line summary."""
    head = ("driver", "family", "status", "detail")
    cells = [(r.driver, r.family, r.status, r.detail) for r in rows]
    widths = [
        max(len(head[i]), *(len(c[i]) for c in cells)) if cells else len(head[i]) for i in range(3)
    ]
    lines = [f"{head[0]:{widths[0]}}  {head[1]:{widths[1]}}  {head[2]:{widths[2]}}  {head[3]}"]
    lines += [f"{a:{widths[0]}}  {b:{widths[1]}}  {c:{widths[2]}}  {d}" for a, b, c, d in cells]
    counts = {s: sum(r.status == s for r in rows) for s in ("PASS", "FAIL", "SKIP")}
    lines.append(
        f"report card vs {reference!r}: " + ", ".join(f"{v} {k}" for k, v in counts.items())
    )
    return "\n".join(lines)


def run_card(args: argparse.Namespace) -> int:
    """Print the card; exit code 1 when any cell FAILs (SKIPs do not fail)."""
    import json

    rows = build_card(args)
    print(format_card(rows, args.reference))
    if args.json:
        Path(args.json).write_text(
            json.dumps([r.__dict__ for r in rows], indent=2) + "\n", encoding="utf-8"
        )
    return 1 if any(r.status == "FAIL" for r in rows) else 0
