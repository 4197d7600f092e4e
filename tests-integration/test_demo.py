"""`tl demo` as the README shows it: the real-model tour and the --native one, run as a user runs them.

The shown output blocks in README.md (between ``<!-- demo-output: COMMAND -->`` markers)
must be what the command prints today: lines that report a wall-clock time are compared
without their numbers, and a decimal number may be off by one unit in its last digit (as
in ``scripts/check_doc_examples.py``). Every figure the demo writes is opened again and
must be a non-blank image.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tl_core.models import SMOLLM2

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
_TIMED = re.compile(r"\d+\.\d+s\b")
_NUMBER = re.compile(r"[-+]?\d+(?:\.(\d+))?")


def _shown(command: str) -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(
        rf"<!-- demo-output: {re.escape(command)} -->\n```\n(.*?)```\n<!-- /demo-output -->",
        text,
        re.S,
    )
    assert match, f"README.md has no shown output for {command!r} between demo-output markers"
    return match.group(1)


def _same_line(shown: str, actual: str) -> bool:
    shown, actual = _TIMED.sub("<time>", shown), _TIMED.sub("<time>", actual)
    if _NUMBER.sub("#", shown) != _NUMBER.sub("#", actual):
        return False
    for s, a in zip(_NUMBER.finditer(shown), _NUMBER.finditer(actual), strict=True):
        if s.group() == a.group():
            continue
        decimals = len(s.group(1) or "")
        if decimals == 0 or len(a.group(1) or "") != decimals:
            return False
        if abs(float(s.group()) - float(a.group())) > 1.5 * 10.0**-decimals:
            return False
    return True


def _compare(command: str, stdout: str) -> None:
    shown = _shown(command).splitlines()
    actual = stdout.lstrip("\n").splitlines()
    stale = [
        f"line {n}: README {s!r}\n        now    {a!r}"
        for n, (s, a) in enumerate(zip(shown, actual, strict=False), 1)
        if not _same_line(s, a)
    ]
    if len(shown) != len(actual):
        stale.append(f"README shows {len(shown)} lines, `{command}` prints {len(actual)}")
    assert not stale, f"README.md's output of `{command}` is stale:\n" + "\n".join(stale[:20])


def _tl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("tl")
    assert exe is not None, "the tl console script is not installed"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=600, cwd=cwd)


def test_native_demo_matches_the_readme(tmp_path: Path) -> None:
    result = _tl("demo", "--native", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    _compare("tl demo --native", result.stdout)


def test_demo_on_smollm2_matches_the_readme_and_writes_real_figures(tmp_path: Path) -> None:
    if not SMOLLM2.is_installed():
        pytest.skip(f"needs SmolLM2's GGUF file: {SMOLLM2.install_command}")
    for module, extra in (("gguf", "tl-driver-hf[gguf]"), ("matplotlib", "tl-core[plots]")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}: pip install '{extra}'")
    from matplotlib.image import imread

    from tl_core.cli._demo_figures import FIGURES

    result = _tl("demo", cwd=tmp_path)  # the default output folder, as the README shows it
    assert result.returncode == 0, result.stderr
    _compare("tl demo", result.stdout)
    out = tmp_path / "tl-demo"
    page = (out / "index.html").read_text()
    for name in FIGURES:
        assert f'src="{name}"' in page, f"index.html does not show {name}"
        image = imread(out / name)
        assert image.ndim == 3 and min(image.shape[:2]) > 200, f"{name}: {image.shape}"
        rgb = image[..., :3]
        assert rgb.std() > 0.05, f"{name} is blank"
        assert (rgb.reshape(-1, 3).std(axis=0) > 0.02).any(), f"{name} has no contrast"
