"""``tl hooks`` lists a booted model's hook namespace; ``tl resolve`` explains hook names."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register"]


def _model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--driver",
        default=None,
        help="driver to boot (default: from --model: hf for a folder, .gguf file or "
        "'org/name' hub id, native for a preset; native without --model)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="what the driver loads: a folder, .gguf file or hub id (hf, vllm), a preset "
        "(native: gpt2, llama; default gpt2)",
    )


def register(sub: Any) -> None:
    """Add the ``hooks`` and ``resolve`` subcommands."""
    hooks = sub.add_parser(
        "hooks", help="list a model's hooks: layout, and whether specs can edit them (and why not)"
    )
    _model_options(hooks)
    hooks.add_argument(
        "--all", action="store_true", help="also list the hooks the driver cannot fire"
    )
    hooks.set_defaults(run=run_hooks)
    resolve = sub.add_parser("resolve", help="show what a hook name (or alias) resolves to")
    resolve.add_argument("names", nargs="+")
    _model_options(resolve)
    resolve.add_argument("--no-model", action="store_true", help="resolve without booting a model")
    resolve.set_defaults(run=run_resolve)


def _boot(args: argparse.Namespace) -> Any:
    from tl_core.bridges._boot import boot
    from tl_core.cli._model_arg import check_model, default_driver

    if args.model is None:
        # Without --model the native GPT-2-style preset boots; other drivers say what they need.
        driver = args.driver or "native"
        return boot("gpt2" if driver == "native" else None, driver=driver)
    model = check_model(args.model)  # before any driver is imported
    return boot(model, driver=args.driver or default_driver(model))


def run_hooks(args: argparse.Namespace) -> int:
    """Print every hook of the booted model with its layout and what specs can do there.

    On a compiled engine (the vllm driver's default on vLLM's CPU build) the hooks whose runs
    leave the compiled graph are marked ``eager``, with the reason.
    """
    bridge = _boot(args)
    try:
        namespace = bridge.namespace
        print(
            f"{bridge!r}: {len(namespace.served)} hooks served, {len(namespace.editable)} editable"
        )
        eager = namespace.eager_only
        if eager:
            print(f"{len(eager)} hooks run only in the engine's eager forward (marked 'eager')")
        for name in namespace.ordered:
            mode = "eager " if name in eager else ""
            if name in namespace.editable:
                print(f"{name:42s} {namespace.layout(name):9s} {mode}edit".rstrip())
            else:
                print(
                    f"{name:42s} {namespace.layout(name):9s} {mode}read  {namespace.reasons[name]}"
                )
        for reason in sorted(set(eager.values())):
            print(f"eager: {reason}")
        if args.all:
            for name, reason in sorted(namespace.non_fireable_reasons.items()):
                print(f"{name:42s} {namespace.layout(name):9s} -     {reason}")
    finally:
        bridge.close()
    return 0


def run_resolve(args: argparse.Namespace) -> int:
    """Print the resolution of each name, against the booted model unless ``--no-model``."""
    from tl_core.hooks._resolution import resolve_hook_name

    bridge = None if args.no_model else _boot(args)
    try:
        for name in args.names:
            r = resolve_hook_name(name) if bridge is None else bridge.namespace.resolve(name)
            note = f"  ({r.note})" if r.note else ""
            print(f"{name} -> {r.canonical}  [{r.status}, {r.family}]{note}")
    finally:
        if bridge is not None:
            bridge.close()
    return 0
