"""``tl certify MODEL`` prints the certification report of a booted model.

The report says what the architecture is (described by hand, or inferred from the module
tree and how), every equation checked on the booted model, and each hook's status with
the reason: only certified hooks are served.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register", "run_certify"]


def register(sub: Any) -> None:
    """Add the ``certify`` subcommand."""
    parser = sub.add_parser(
        "certify",
        help="boot a model and print its certification: which hooks are served, proven by which equations",
    )
    parser.add_argument(
        "model", help="a folder, .gguf file or hub id (hf, vllm), or a native preset"
    )
    parser.add_argument(
        "--driver",
        default=None,
        help="driver to boot (default: hf for a folder, .gguf file or 'org/name' hub id, "
        "native for a preset)",
    )
    parser.add_argument(
        "--verbose", "-v", action="store_true", help="list every check and every hook name"
    )
    parser.set_defaults(run=run_certify)


def run_certify(args: argparse.Namespace) -> int:
    """Boot ``args.model`` and print its report; exit 1 when a check failed, 2 when the
    driver does not certify."""
    from tl_core._errors import UnsupportedFeatureError
    from tl_core.bridges._boot import boot
    from tl_core.cli._model_arg import check_model, default_driver
    from tl_core.driver_api._capabilities import CertifyingDriver

    model = check_model(args.model)  # before any driver is imported
    driver = args.driver or default_driver(model)
    bridge = boot(model, driver=driver)
    try:
        # Every check, on demand (a described family's boot runs the quick ones).
        engine = bridge.driver
        report = engine.certify() if isinstance(engine, CertifyingDriver) else None
        if report is None:
            raise UnsupportedFeatureError(
                f"the {driver!r} driver does not certify its hooks; tl certify runs on drivers "
                f"that do (hf, vllm)"
            )
        print(report.format(verbose=args.verbose))
    finally:
        bridge.close()
    return 1 if report.failed else 0
