"""Run the Python examples in the docs and check (or rewrite) the output shown after them.

An example is a ```python block directly followed by a plain ``` block: the second block is
what the first prints. Each example runs in a fresh interpreter in a temporary folder, so
the output shown is real output. ``--write`` replaces stale outputs; without it a stale
output fails the check with a diff. A decimal number may differ from the shown one by one
unit in its last shown digit (34.57 against 34.56): float sums round differently on other
CPUs' vector units, and the check is about the docs, not the last bit of a BLAS kernel;
integers (shapes, counts) and everything else must match exactly. Examples that need a
package that is not installed fail too: the docs session installs what the docs use.
"""

from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The vLLM driver's README is left out: its examples need an engine the docs session lacks.
FILES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "packages" / "tl-core" / "README.md",
    ROOT / "packages" / "tl-driver-hf" / "README.md",
    *sorted((ROOT / "packages" / "tl-driver-hf" / "docs").glob("*.md")),
    ROOT / "packages" / "tl-driver-inspect" / "README.md",
]
# Neither block may contain a fence: an example is two adjacent blocks, nothing between.
_EXAMPLE = re.compile(
    r"```python\n(?P<code>(?:(?!```).)*)```\n\n```\n(?P<out>(?:(?!```).)*)```", re.S
)


def run(code: str) -> str:
    """What ``code`` prints, run in a fresh interpreter in an empty folder."""
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=folder, capture_output=True, text=True, timeout=600
        )
    if done.returncode != 0:
        raise RuntimeError(f"example failed:\n{code}\n{done.stderr}")
    return done.stdout


NUMBER = re.compile(r"[-+]?\d+(?:\.(\d+))?(?:[eE][-+]?\d+)?")


def same_up_to_last_digit(shown: str, actual: str) -> bool:
    """Whether ``actual`` reads as ``shown`` with each number off by at most one last-digit unit."""
    if NUMBER.sub("#", shown) != NUMBER.sub("#", actual):
        return False
    for s, a in zip(NUMBER.finditer(shown), NUMBER.finditer(actual), strict=True):
        if s.group() == a.group():
            continue
        if "e" in s.group().lower() or "e" in a.group().lower():
            return False
        decimals = len(s.group(1) or "")
        if decimals == 0 or len(a.group(1) or "") != decimals:
            return False  # integers (counts, shapes, ids) must match exactly
        if abs(float(s.group()) - float(a.group())) > 1.5 * 10.0**-decimals:
            return False
    return True


def check(path: Path, write: bool) -> list[str]:
    """The stale examples of one file (rewritten in place with ``write``)."""
    text = path.read_text()
    stale: list[str] = []

    def replace(match: re.Match[str]) -> str:
        shown, actual = match.group("out"), run(match.group("code"))
        if actual != shown and not same_up_to_last_digit(shown, actual):
            diff = "".join(
                difflib.unified_diff(
                    shown.splitlines(True), actual.splitlines(True), "shown", "actual"
                )
            )
            stale.append(f"{path.relative_to(ROOT)}:\n{diff}")
        kept = shown if same_up_to_last_digit(shown, actual) else actual
        return f"```python\n{match.group('code')}```\n\n```\n{kept}```"

    new = _EXAMPLE.sub(replace, text)
    if write and new != text:
        path.write_text(new)
    return stale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite stale outputs")
    args = parser.parse_args()
    stale = [entry for path in FILES for entry in check(path, args.write)]
    if stale and not args.write:
        print(
            "stale doc outputs (run python scripts/check_doc_examples.py --write):", file=sys.stderr
        )
        print("\n".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
