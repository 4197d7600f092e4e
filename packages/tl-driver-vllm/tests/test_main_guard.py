"""Scripts that boot vLLM without an ``if __name__ == "__main__":`` guard, run for real.

vLLM spawns its engine process (and parallel workers); a spawned child re-imports the main
script. Each test writes a script and runs it in a fresh interpreter, as a user would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

_MP = "VLLM_ENABLE_V1_MULTIPROCESSING"


def _run(
    script: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != _MP}  # vLLM's default mode
    return subprocess.run(
        [sys.executable, *args, str(script)]
        if args != ("-m",)
        else [sys.executable, "-m", script.stem],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**base, **(env or {})},
        cwd=script.parent,
        check=False,
    )


_FINDER = """
from tl_driver_vllm._driver_side._spawn import unguarded_boot

def boot():
    print("FOUND", unguarded_boot())
"""

_LAYOUTS = {
    "top level": ("boot()\n", "line=7"),
    "inside a try at top level": ("try:\n    boot()\nexcept Exception:\n    pass\n", "line=8"),
    "guarded": ('if __name__ == "__main__":\n    boot()\n', "None"),
    "guarded, reversed comparison, through a function": (
        'def main():\n    boot()\n\nif "__main__" == __name__:\n    main()\n',
        "None",
    ),
    "under an if that is no guard": ('if __name__ != "__main__" or True:\n    boot()\n', "line=8"),
}


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_the_call_site_is_read_from_the_script(layout: str, tmp_path: Path) -> None:
    body, expected = _LAYOUTS[layout]
    script = tmp_path / "finder_script.py"
    script.write_text(_FINDER + "\n" + body)
    done = _run(script)
    assert done.returncode == 0, done.stderr[-2000:]
    found = next(line for line in done.stdout.splitlines() if line.startswith("FOUND"))
    assert expected in found, (layout, found, script.read_text())


def test_a_module_run_with_dash_m_is_checked_too(tmp_path: Path) -> None:
    script = tmp_path / "finder_module.py"
    script.write_text(_FINDER + "\nboot()\n")
    done = _run(script, "-m")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "line=7" in done.stdout and "finder_module.py" in done.stdout, done.stdout


_SCRIPT = """
import os
import psutil
from tl_core import ConfigError, RemoteBridge

FOLDER = {folder!r}
OPTIONS = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=32 * 2**20, enforce_eager=True)
"""


@pytest.mark.vllm
@pytest.mark.slow
def test_an_unguarded_script_runs_its_engine_in_process(checkpoint: Any, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    script = tmp_path / "unguarded.py"
    script.write_text(
        _SCRIPT.format(folder=str(checkpoint("llama")))
        + textwrap.dedent(
            """
            bridge = RemoteBridge.boot_vllm(FOLDER, **OPTIONS)
            print("IN-PROCESS", all(w["pid"] == os.getpid() for w in bridge.driver.workers))
            print("TOKENS", bridge.generate([[5, 6, 7]], max_new_tokens=3).tolist())
            bridge.close()
            """
        )
    )
    done = _run(script)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "IN-PROCESS True" in done.stdout and "TOKENS [[" in done.stdout, output[-3000:]
    assert f"{script}, line 9 boots vLLM at the script's top level" in output, output[-3000:]
    assert "bootstrapping phase" not in output


@pytest.mark.vllm
@pytest.mark.slow
def test_an_unguarded_script_that_needs_processes_gets_the_fix(
    checkpoint: Any, tmp_path: Path
) -> None:
    pytest.importorskip("vllm")
    script = tmp_path / "unguarded_workers.py"
    script.write_text(
        _SCRIPT.format(folder=str(checkpoint("llama")))
        + textwrap.dedent(
            """
            try:
                RemoteBridge.boot_vllm(FOLDER, tensor_parallel_size=2, **OPTIONS)
            except ConfigError as error:
                print("TP", error)
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            try:
                RemoteBridge.boot_vllm(FOLDER, **OPTIONS)
            except ConfigError as error:
                print("MP", error)
            print("CHILDREN", len(psutil.Process().children()))
            """
        )
    )
    done = _run(script)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    lines = {line.split(" ", 1)[0]: line for line in done.stdout.splitlines() if " " in line}
    assert "starts 2 worker processes" in lines["TP"] and f"{script}, line 10" in lines["TP"], lines
    assert (
        "VLLM_ENABLE_V1_MULTIPROCESSING='1'" in lines["MP"] and f"{script}, line 15" in lines["MP"]
    ), lines
    for key in ("TP", "MP"):
        assert 'if __name__ == "__main__":' in lines[key] and "Nothing was started" in lines[key]
    assert lines["CHILDREN"] == "CHILDREN 0"
