"""Run the tutorials in docs/tutorials/ and check (or rewrite) the output and figures they show.

A tutorial is a Markdown page whose ```python blocks run in order in one fresh interpreter,
sharing their variables like notebook cells, in an empty temporary folder. A python block
followed (after one blank line) by a plain ``` block shows what it prints; a python block
without one must print nothing. Outputs compare as in ``check_doc_examples.py`` (a decimal
may be off by one unit in its last shown digit); ``--write`` rewrites stale outputs.

Drivers: a page names the drivers it runs on in a comment, ``<!-- tutorial drivers: hf,
vllm -->``. Its shown output, and the boot line it shows (``BOOTS``), are its first driver's
(hf when it names none). ``--driver vllm`` on a page shown on hf runs the same blocks with
only the boot line replaced and checks them against the same shown output (the boot block's
own output, the bridge's repr, excepted); its figures are drawn and checked but the shown
driver's stay in the docs. A page that does not name the driver is reported as skipped,
with the drivers it does name, unless it is named on the command line.

Processors: a page whose output depends on float32 rounding beyond the last shown digit (a
model trained on float32 activations picks other features when their last bits differ)
marks each such block with ``<!-- tutorial output varies by processor -->`` on the line before
it, and says once where its output was recorded, ``<!-- tutorial recorded on: PROCESSOR -->``
(the processor as ``processor()`` and ``.ci/run`` name it). On that processor every block is
checked as above; on another, a marked block's output only has to keep its form: the same
text with every number and quoted string free to differ. ``--write`` records the page on
this processor.

Modules: a page that needs more than the docs environment names the modules in a comment,
``<!-- tutorial needs: sae_lens -->``. Where one is missing the page is reported as skipped
with the reason, or, when it is named on the command line, as a problem.

Figures: every image the page shows from ``figures/`` (``![...](figures/NAME.png)``) must be
written by the run into its own ``figures/`` folder, must not be blank, and is then copied
over ``docs/tutorials/figures/NAME.png``, so the site built after this run shows the figures
this run drew. A figure the run writes that the page does not show is an error too.

Usage: ``python scripts/run_tutorials.py [--write] [--driver vllm] [NAME ...]`` (names
without ``.md``).
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_doc_examples import NUMBER, same_up_to_last_digit

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = ROOT / "docs" / "tutorials"
FIGURES = TUTORIALS / "figures"

_BLOCK = re.compile(
    r"```python\n(?P<code>(?:(?!```).)*)```\n(?:\n```\n(?P<out>(?:(?!```).)*)```\n)?", re.S
)
_DRIVERS = re.compile(r"<!-- tutorial drivers: (?P<names>[a-z_, ]+) -->")
#: The boot line every tutorial has, and what replaces it on each driver; nothing else changes.
HF_BOOT = "model = TransformerBridge.boot_transformers(smollm2_gguf())\n"
BOOTS = {
    "hf": HF_BOOT,
    # A small KV cache and context: the CPU build's default asks for ~11 GiB of KV cache.
    "vllm": (
        "from tl_core import RemoteBridge\n"
        'model = RemoteBridge.boot_vllm(smollm2_gguf(), dtype="float32", max_model_len=512, kv_cache_memory_bytes=256 * 2**20)\n'
    ),
}
VARIES = "<!-- tutorial output varies by processor -->"
_RECORDED = re.compile(r"<!-- tutorial recorded on: (?P<cpu>[^\n]*?) -->")
_PADDED_NUMBER = re.compile(r" +#")
_QUOTED = re.compile(r"'(?:[^'\\\n]|\\.)*'|\"(?:[^\"\\\n]|\\.)*\"")
_NEEDS = re.compile(r"<!-- tutorial needs: (?P<names>[a-z_, ]+) -->")
_FIGURE = re.compile(r"!\[[^\]]*\]\(figures/(?P<name>[^)\s]+\.png)\)")
_MARK = "\x1etl-tutorial-block "
# Runs inside the fresh interpreter: every block in one namespace, a marker line before each.
_RUNNER = f"""
import json, sys
blocks = json.load(open(sys.argv[1]))
namespace = {{"__name__": "__main__"}}
for index, code in enumerate(blocks):
    print({_MARK!r} + str(index), flush=True)
    exec(compile(code, f"<tutorial block {{index + 1}}>", "exec"), namespace)
    sys.stdout.flush()
"""


@dataclass(frozen=True)
class Block:
    """One python block of a tutorial and the output the page shows for it (``None``: none)."""

    code: str
    shown: str | None


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def blocks_of(text: str) -> list[Block]:
    """The python blocks of a page, in order."""
    return [Block(m.group("code"), m.group("out")) for m in _BLOCK.finditer(text)]


def drivers_of(text: str) -> list[str]:
    """The drivers a page says it runs on (``hf`` when it says nothing)."""
    match = _DRIVERS.search(text)
    return [n.strip() for n in match.group("names").split(",")] if match else ["hf"]


def missing_modules(text: str) -> list[str]:
    """The modules a page needs (``<!-- tutorial needs: ... -->``) that this Python lacks."""
    match = _NEEDS.search(text)
    names = [n.strip() for n in match.group("names").split(",")] if match else []
    return [name for name in names if importlib.util.find_spec(name) is None]


def processor() -> str:
    """This machine's processor as ``.ci/run`` names it: model name, family, model and the widest
    vector extension (float32 results can differ in their last bits between any two of these)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine() or "unknown"
    fields: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = fields.get("flags", "").split()
    width = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "no avx2"
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown"
    return (
        f"{name}, family {fields.get('cpu family', '?')} model {fields.get('model', '?')}, {width}"
    )


def same_form(shown: str, actual: str) -> bool:
    """Whether ``actual`` reads as ``shown`` with every number and quoted string free to differ.

    A number's padding is free too: ``f"{feature:4d}"`` pads 396 with one more space than 2040.
    """

    def form(text: str) -> str:
        return _PADDED_NUMBER.sub(" #", NUMBER.sub("#", _QUOTED.sub("''", text)))

    return form(shown) == form(actual)


def varying_blocks(text: str) -> set[int]:
    """The indices of the python blocks marked as printing processor-dependent output."""
    return {
        i
        for i, m in enumerate(_BLOCK.finditer(text))
        if text[: m.start()].rstrip().endswith(VARIES)
    }


def with_boot(
    path: Path, blocks: list[Block], driver: str, shown: str = "hf"
) -> tuple[list[Block], int]:
    """The blocks with the boot line for ``driver`` instead of the ``shown`` driver's, and the
    index of the boot block (-1: nothing replaced)."""
    if driver == shown:
        return blocks, -1
    booting = [i for i, b in enumerate(blocks) if BOOTS[shown] in b.code]
    if len(booting) != 1:
        raise RuntimeError(
            f"{_shown(path)}: {len(booting)} blocks boot with {BOOTS[shown].strip()!r}; a tutorial has one"
        )
    index = booting[0]
    code = blocks[index].code.replace(BOOTS[shown], BOOTS[driver])
    return [*blocks[:index], Block(code, blocks[index].shown), *blocks[index + 1 :]], index


def run(path: Path, blocks: list[Block], folder: Path, vllm_cache: Path) -> list[str]:
    """What each block prints, run in order in one interpreter with ``folder`` as its cwd
    (``vllm_cache``: vLLM's cache, shared by the pages of one run)."""
    (folder / "figures").mkdir()
    source = folder.parent / "blocks.json"
    source.write_text(json.dumps([b.code for b in blocks]))
    env = {
        **os.environ,
        "MPLBACKEND": "Agg",
        "PYTHONHASHSEED": "0",
        # vLLM: the engine in this process, its sockets in this page's folder, its cache shared
        # by the pages of this run (every page boots the same model the same way, so the pages
        # after the first load the compiled graph instead of compiling it again).
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CACHE_ROOT": str(vllm_cache),
        # vLLM 0.32's CPU build cannot load the graphs it compiled ahead of time ("'function'
        # object has no attribute 'finalize_loading'"), so every page compiled SmolLM2 again
        # (90 s); its other compile path reuses the cache (22 s). The pages check output only.
        "VLLM_USE_AOT_COMPILE": os.environ.get("VLLM_USE_AOT_COMPILE", "0"),
        "VLLM_RPC_BASE_PATH": str(folder.parent),
        # vLLM logs to stdout by default; a page shows what its code prints, not the engine's log.
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    }
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, str(source)],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    parts = done.stdout.split(_MARK)[1:]
    outputs = [part.split("\n", 1)[1] if "\n" in part else "" for part in parts]
    if done.returncode != 0:
        failed = len(outputs)
        raise RuntimeError(
            f"{_shown(path)}: block {failed} failed (exit {done.returncode}):\n"
            f"{blocks[failed - 1].code if failed else ''}\n{done.stderr[-4000:]}"
        )
    return outputs


def blank(png: Path) -> str | None:
    """Why ``png`` counts as blank, or ``None`` when it shows something."""
    import numpy as np
    from matplotlib import image

    try:
        pixels = image.imread(png)
    except Exception as error:  # an unreadable file is as good as blank
        return f"cannot be read as a PNG ({error})"
    if pixels.ndim < 2 or pixels.shape[0] < 100 or pixels.shape[1] < 100:
        return f"is only {pixels.shape[:2]} pixels"
    flat = pixels.reshape(pixels.shape[0] * pixels.shape[1], -1)
    colours, counts = np.unique(flat, axis=0, return_counts=True)
    drawn = 1 - counts.max() / counts.sum()
    if len(colours) < 16 or drawn < 0.02:
        return f"is nearly blank ({len(colours)} colours, {drawn:.1%} of pixels off the background)"
    return None


def check(path: Path, write: bool, driver: str = "hf", vllm_cache: Path | None = None) -> list[str]:
    """Run one tutorial; return its problems (stale outputs rewritten with ``write``).

    ``vllm_cache``: vLLM's cache folder, shared by the pages of a run (default: the page's own).
    """
    text = path.read_text()
    shown_driver = drivers_of(text)[0]
    missing = missing_modules(text)
    if missing:
        return [f"{path.name}: needs {', '.join(missing)}, which this Python cannot import"]
    blocks, boot = with_boot(path, blocks_of(text), driver, shown_driver)
    problems: list[str] = []
    varying, recorded, here = varying_blocks(text), _RECORDED.search(text), processor()
    rewriting = write and driver == shown_driver
    if varying and recorded is None and not rewriting:
        problems.append(
            f"{path.name}: marks blocks whose output varies by processor but does not say where it was "
            f"recorded; run it with --write, or add <!-- tutorial recorded on: {here} -->"
        )
    # Elsewhere than where it was recorded a marked block keeps only its form; --write records it here.
    loose = varying if recorded and recorded["cpu"] != here and not rewriting else set()
    if driver != shown_driver and BOOTS[driver] not in text:
        problems.append(
            f"{path.name}: runs on {driver} but does not show its boot line:\n{BOOTS[driver]}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "work"
        folder.mkdir()
        started = time.perf_counter()
        outputs = run(path, blocks, folder, vllm_cache or Path(tmp) / "vllm-cache")
        seconds = time.perf_counter() - started
        drawn = {p.name for p in (folder / "figures").glob("*.png")}
        shown = {m.group("name") for m in _FIGURE.finditer(text)}
        for name in sorted(shown - drawn):
            problems.append(f"{path.name}: shows figures/{name}, which the run did not write")
        for name in sorted(drawn - shown):
            problems.append(
                f"{path.name}: the run writes figures/{name}, which the page does not show"
            )
        for name in sorted(shown & drawn):
            why = blank(folder / "figures" / name)
            if why:
                problems.append(f"{path.name}: figures/{name} {why}")
            if driver == shown_driver:
                FIGURES.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(folder / "figures" / name, FIGURES / name)
    print(
        f"{_shown(path)} on {driver}: {len(blocks)} blocks, {len(shown & drawn)} figures, {seconds:.1f}s"
    )
    if loose:
        print(
            f"  {len(loose)} blocks checked by form only: recorded on {recorded['cpu'] if recorded else '?'}, "
            f"run on {here}"
        )

    stale: list[str] = []
    pieces: list[str] = []
    last = 0
    for index, (match, block, actual) in enumerate(
        zip(_BLOCK.finditer(text), blocks, outputs, strict=True)
    ):
        shown_out = block.shown
        if index == boot:
            kept = match.group(0)  # it prints the shown driver's bridge repr
        elif shown_out is None and actual:
            stale.append(
                f"{path.name}: a block prints but the page shows no output after it:\n{block.code}{actual}"
            )
            kept = f"```python\n{block.code}```\n\n```\n{actual}```\n"
        elif (
            shown_out is None
            or actual == shown_out
            or same_up_to_last_digit(shown_out, actual)
            or (index in loose and same_form(shown_out, actual))
        ):
            kept = match.group(0)
        else:
            diff = "".join(
                difflib.unified_diff(
                    shown_out.splitlines(True), actual.splitlines(True), "shown", "actual"
                )
            )
            stale.append(f"{path.name}: stale output\n{diff}")
            kept = f"```python\n{block.code}```\n\n```\n{actual}```\n"
        pieces += [text[last : match.start()], kept]
        last = match.end()
    new = "".join(pieces) + text[last:]
    if rewriting and varying and (new != text or recorded is None):
        mark = f"<!-- tutorial recorded on: {here} -->"
        new = (
            _RECORDED.sub(lambda _: mark, new)
            if recorded
            else new.replace("\n\n", f"\n\n{mark}\n", 1)
        )
    if rewriting and new != text:
        path.write_text(new)
    return problems if rewriting else problems + stale


def main(argv: list[str] | None = None) -> int:
    """Run the tutorials; return the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write", action="store_true", help="rewrite stale outputs (of pages shown on --driver)"
    )
    parser.add_argument(
        "--driver", choices=sorted(BOOTS), default="hf", help="the driver to boot (default: hf)"
    )
    parser.add_argument("names", nargs="*", help="tutorials to run (default: all)")
    args = parser.parse_args(argv)
    paths = sorted(
        p for p in TUTORIALS.glob("*.md") if blocks_of(p.read_text())
    )  # index.md has none
    if args.names:
        unknown = set(args.names) - {p.stem for p in paths}
        if unknown:
            parser.error(
                f"no tutorial named {sorted(unknown)}; there are {[p.stem for p in paths]}"
            )
        paths = [p for p in paths if p.stem in args.names]
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="tl-tutorials-vllm-") as scratch:
        # vLLM's cache: the one the caller names (nox shares one between suites), else this run's.
        vllm_cache = Path(os.environ.get("VLLM_CACHE_ROOT") or scratch)
        for path in paths:
            problems += _run_page(path, args, parser, vllm_cache)
    if problems:
        print(
            "tutorial problems (run python scripts/run_tutorials.py --write for stale outputs):",
            file=sys.stderr,
        )
        print("\n".join(problems), file=sys.stderr)
        return 1
    return 0


def _run_page(
    path: Path, args: argparse.Namespace, parser: argparse.ArgumentParser, vllm_cache: Path
) -> list[str]:
    """Run one page as the command line asks (or say why it is not run); its problems."""
    text = path.read_text()
    named = drivers_of(text)
    if args.write and named[0] != args.driver:
        if args.names:
            parser.error(
                f"--write rewrites what a page shows, and {path.name} shows the {named[0]} driver's "
                f"output: run it with --driver {named[0]}"
            )
        print(
            f"{_shown(path)}: not rewritten (it shows the {named[0]} driver's output; --driver {named[0]} does)"
        )
        return []
    if not args.names:  # a page named on the command line always runs
        if args.driver not in named:
            print(f"{_shown(path)}: skipped on {args.driver} (the page runs on {', '.join(named)})")
            return []
        if missing_modules(text):
            print(
                f"{_shown(path)}: skipped (it needs {', '.join(missing_modules(text))}, not installed here)"
            )
            return []
    return check(path, args.write, args.driver, vllm_cache)


if __name__ == "__main__":
    sys.exit(main())
