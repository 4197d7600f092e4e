"""``tl parity``: the parity report on the command line (a ``tl_core.cli`` plug-in)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["register", "run"]


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value  # a bare string


def register(sub: Any) -> None:
    """Add the ``parity`` subcommand."""
    p = sub.add_parser(
        "parity",
        help="compare every hook a driver serves with a reference driver (exit 1 on any FAIL)",
        description="Run the same token ids through a reference and a candidate driver, each in "
        "its own process, and compare every hook the candidate serves.",
    )
    p.add_argument("--model", help="checkpoint folder or hub id (a preset for native)")
    p.add_argument("--candidate", help="driver under test, or 'all' for a report card")
    p.add_argument("--reference", default="hf", help="reference driver (default: hf)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument(
        "--prompts", help="file with one prompt a line (default: a built-in ragged batch)"
    )
    p.add_argument(
        "--layers",
        default="all",
        help="'all' or block indices, e.g. 0,1; negative ones count from the end (--layers=-1)",
    )
    p.add_argument(
        "--candidate-option",
        "-C",
        action="append",
        type=_option,
        default=[],
        metavar="KEY=VALUE",
        help="candidate boot option (VALUE parsed as JSON if it can be)",
    )
    p.add_argument(
        "--reference-option",
        "-R",
        action="append",
        type=_option,
        default=[],
        metavar="KEY=VALUE",
        help="reference boot option",
    )
    p.add_argument("--json", metavar="OUT", help="write the JSON report here")
    p.add_argument("--md", metavar="OUT", help="write a Markdown report here")
    p.add_argument(
        "--html", metavar="OUT", help="write a self-contained HTML report (per-layer plot)"
    )
    p.add_argument(
        "--show-non-fireable", action="store_true", help="list the declared non-fireable hooks"
    )
    p.add_argument(
        "--families", help="with --candidate all: comma-separated tiny families (default: all)"
    )
    p.add_argument("--drivers", help="with --candidate all: only these drivers (comma-separated)")
    p.add_argument("--cache-dir", help="with --candidate all: where tiny checkpoints are kept")
    p.add_argument(
        "--aliases",
        metavar="GENERATION",
        help="print the alias report of a naming generation for --model on --candidate",
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no progress lines on stderr")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run ``tl parity``; returns 0 when everything passes, 1 on any FAIL/ERROR."""
    from tl_core import UserError

    if args.aliases:
        return _aliases(args)
    if not args.candidate:
        raise UserError("tl parity needs --candidate DRIVER (or --candidate all)")
    if args.candidate == "all":
        from tl_parity._card import run_card

        return run_card(args)
    if not args.model:
        raise UserError("tl parity needs --model (a checkpoint folder, hub id or native preset)")
    from tl_parity._format import format_table
    from tl_parity._run import run_parity

    try:
        report = run_parity(
            args.model,
            candidate=args.candidate,
            reference=args.reference,
            dtype=args.dtype,
            prompts=args.prompts,
            layers=args.layers,
            candidate_options=dict(args.candidate_option),
            reference_options=dict(args.reference_option),
            quiet=args.quiet,
        )
    except (ValueError, OSError) as exc:
        raise UserError(str(exc)) from exc
    print(format_table(report, show_non_fireable=args.show_non_fireable))
    write_outputs(report, args)
    return 0 if report.passed else 1


def write_outputs(report: Any, args: argparse.Namespace) -> None:
    """Write the ``--json``/``--md``/``--html`` files that were asked for."""
    from pathlib import Path

    if args.json:
        report.to_json(args.json)
    if args.md:
        from tl_parity._format import format_markdown

        Path(args.md).write_text(format_markdown(report), encoding="utf-8")
    if args.html:
        try:
            from tl_parity._html import render_html
        except ImportError:
            print(
                "tl parity: --html needs tl_parity._html, which this install lacks", file=sys.stderr
            )
        else:
            Path(args.html).write_text(render_html(report), encoding="utf-8")


def _aliases(args: argparse.Namespace) -> int:
    from tl_core import UserError

    try:
        from tl_parity._aliases import alias_report, check_generation
    except ImportError:
        print(
            "tl parity: the alias report (tl_parity._aliases) is not in this install",
            file=sys.stderr,
        )
        return 1
    import tl_core
    from tl_parity._checks import check_driver, check_model

    try:  # everything the command line says is checked before the model boots
        generation = check_generation(args.aliases)
    except ValueError as exc:
        raise UserError(f"--aliases: {exc}") from exc
    driver = args.candidate if args.candidate not in (None, "all") else args.reference
    model = args.model if args.model else ("gpt2" if driver == "native" else None)
    if model is None:
        raise UserError("tl parity --aliases needs --model (and the driver as --candidate)")
    check_driver(driver, "candidate" if driver == args.candidate else "reference")
    check_model(model)
    bridge = tl_core.boot(model, driver=driver, **dict(args.candidate_option))
    try:
        try:
            print(alias_report(bridge, generation))
        except ValueError as exc:
            raise UserError(str(exc)) from exc
    finally:
        bridge.close()
    return 0
