"""The ``tl`` command. Other packages add subcommands through the ``tl_core.cli`` entry points.

An entry point of that group names a function ``register(subparsers)`` that adds one
sub-parser and sets its ``run`` default to ``fn(args) -> int``. A first-party subcommand
whose package is missing gets one line with its install command instead of argparse's
"invalid choice"; Ctrl-C ends any command with one line and exit code 130.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import sys
from collections.abc import Mapping, Sequence

from tl_core._errors import TLError
from tl_core._version import __version__

__all__ = [
    "CLI_ENTRY_POINT_GROUP",
    "INTERRUPTED_EXIT",
    "KNOWN_SUBCOMMANDS",
    "build_parser",
    "main",
    "plugin_entry_points",
]

#: The entry-point group whose ``register(subparsers)`` functions add ``tl`` subcommands.
CLI_ENTRY_POINT_GROUP = "tl_core.cli"

#: First-party subcommands that other distributions add, and the distribution to install.
KNOWN_SUBCOMMANDS: Mapping[str, str] = {"parity": "tl-parity"}

#: Exit code of a command ended by Ctrl-C (128 + SIGINT, as shells report it).
INTERRUPTED_EXIT = 130


def plugin_entry_points() -> Sequence[metadata.EntryPoint]:
    """The installed ``tl_core.cli`` entry points (tests replace this to fake an install set)."""
    return list(metadata.entry_points(group=CLI_ENTRY_POINT_GROUP))


def build_parser() -> argparse.ArgumentParser:
    """The full parser: built-in subcommands plus those of installed packages."""
    return _build_parser({})[0]


def _build_parser(failed: dict[str, str]) -> tuple[argparse.ArgumentParser, set[str]]:
    """``build_parser`` and its subcommand names; ``failed`` gets each plugin that did not load."""
    from tl_core.cli import _capture, _certify, _demo, _drivers, _hooks

    parser = argparse.ArgumentParser(
        prog="tl",
        description="One hook vocabulary, cache and intervention language for every engine.",
    )
    parser.add_argument("--version", action="version", version=f"tl-core {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in (
        _drivers.register,
        _demo.register,
        _hooks.register,
        _capture.register,
        _certify.register,
    ):
        register(sub)
    for ep in plugin_entry_points():
        try:
            ep.load()(sub)
        except Exception as exc:  # a broken plugin must not break the whole command
            failed[ep.name] = f"{type(exc).__name__}: {exc}"
            print(
                f"tl: warning: subcommand plugin {ep.name!r} failed to load: {exc}", file=sys.stderr
            )
    return parser, set(sub.choices)


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand word of ``argv`` (its first word that is not an option)."""
    return next((word for word in argv if not word.startswith("-")), None)


def _missing_plugin(
    command: str | None, available: set[str], failed: Mapping[str, str]
) -> str | None:
    """The one-line message for a known plugin subcommand that is not available, else ``None``."""
    dist = KNOWN_SUBCOMMANDS.get(command) if command is not None else None
    if command is None or dist is None or command in available:
        return None
    if command in failed:
        return (
            f"tl: error: 'tl {command}' comes from {dist}, which is installed but failed to load "
            f"({failed[command]}); reinstall it with: pip install --force-reinstall {dist}"
        )
    return (
        f"tl: error: 'tl {command}' needs the {dist} package, which is not installed; "
        f"install it with: pip install {dist}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``tl``; returns the exit code (1 for tl errors, 2 for usage errors, 130 on Ctrl-C)."""
    try:
        return _main(sys.argv[1:] if argv is None else list(argv))
    except KeyboardInterrupt:
        print("tl: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT


def _main(argv: list[str]) -> int:
    failed: dict[str, str] = {}
    parser, available = _build_parser(failed)
    missing = _missing_plugin(_command(argv), available, failed)
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    try:
        return int(args.run(args))
    except TLError as exc:
        print(f"tl: error: {exc}", file=sys.stderr)
        return 1
