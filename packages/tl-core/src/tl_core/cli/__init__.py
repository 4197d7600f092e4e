"""The ``tl`` command. Other packages add subcommands through the ``tl_core.cli`` entry points.

An entry point of that group names a function ``register(subparsers)`` that adds one
sub-parser and sets its ``run`` default to ``fn(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import sys
from collections.abc import Sequence

from tl_core._errors import TLError
from tl_core._version import __version__

__all__ = ["CLI_ENTRY_POINT_GROUP", "build_parser", "main"]

#: The entry-point group whose ``register(subparsers)`` functions add ``tl`` subcommands.
CLI_ENTRY_POINT_GROUP = "tl_core.cli"


def build_parser() -> argparse.ArgumentParser:
    """The full parser: built-in subcommands plus those of installed packages."""
    from tl_core.cli import _capture, _demo, _drivers, _hooks

    parser = argparse.ArgumentParser(
        prog="tl", description="One hook vocabulary, cache and intervention language for every engine."
    )
    parser.add_argument("--version", action="version", version=f"tl-core {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in (_drivers.register, _demo.register, _hooks.register, _capture.register):
        register(sub)
    for ep in metadata.entry_points(group=CLI_ENTRY_POINT_GROUP):
        try:
            ep.load()(sub)
        except Exception as exc:  # a broken plugin must not break the whole command
            print(f"tl: warning: subcommand plugin {ep.name!r} failed to load: {exc}", file=sys.stderr)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``tl``; returns the exit code (1 for tl errors, 2 for usage errors)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return int(args.run(args))
    except TLError as exc:
        print(f"tl: error: {exc}", file=sys.stderr)
        return 1
