"""``tl hooks`` lists a native model's hooks; ``tl resolve`` explains a hook name."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the ``hooks`` and ``resolve`` subcommands."""
    hooks = sub.add_parser("hooks", help="list the hooks of a native model with their shapes")
    hooks.add_argument("--preset", choices=("gpt2", "llama"), default="gpt2")
    hooks.set_defaults(run=run_hooks)
    resolve = sub.add_parser("resolve", help="show what a hook name (or alias) resolves to")
    resolve.add_argument("names", nargs="+")
    resolve.set_defaults(run=run_resolve)


def run_hooks(args: argparse.Namespace) -> int:
    """Print every hook of a tiny native model and its layout."""
    from tl_core.bridges._transformer import TransformerBridge
    from tl_core.hooks._resolution import layout_of

    bridge = TransformerBridge.boot_native(args.preset)
    _, cache = bridge.run_with_cache("hi")
    for name, tensor in cache.items():
        print(f"{name:40s} {layout_of(name):10s} {tuple(tensor.shape)}")
    return 0


def run_resolve(args: argparse.Namespace) -> int:
    """Print the resolution of each name."""
    from tl_core.hooks._resolution import resolve_hook_name

    for name in args.names:
        r = resolve_hook_name(name)
        note = f"  ({r.note})" if r.note else ""
        print(f"{name} -> {r.canonical}  [{r.status}, {r.family}]{note}")
    return 0
