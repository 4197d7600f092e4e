"""Write docs/architectures.md: which model types of six transformers task mappings the hf
driver serves, and how.

For every model type in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``,
``MODEL_FOR_MASKED_LM_MAPPING_NAMES``, ``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES``,
``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``, ``MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES``
and ``MODEL_FOR_CTC_MAPPING_NAMES`` (the *kinds*, ``_tiny_builds.KINDS``) the script builds a
tiny random checkpoint of the class the mapping names (``scripts/_tiny_builds.py``: 2 layers,
width 64), runs it in transformers on the kind's inputs, boots the saved folder with
``HFDriver.boot`` and gives one verdict:

* **full hooks**: tl serves it with certified attention and MLP sites;
* **sublayers**: tl serves attention and MLP outputs but not their insides;
* **residual**: tl serves it at the residual-stream level only;
* **text only**: a vision-language or speech model tl booted and that passes the checks on
  token ids, whose image or audio input tl does not serve (not counted as served; a
  vision-language model whose image tl takes gets one of the levels above);
* **refused**: tl refuses it at boot (a ``UserError``; the note is its first sentence);
* **not runnable in transformers**: transformers itself cannot build, run or reload it
  from the kind's inputs (the note is transformers' error);
* **WRONG**: tl booted it but an independent check failed, it booted with weights dropped,
  it refused a checkpoint transformers' causal-LM class would drop weights from without
  naming them, or tl raised an error that is no refusal. This must never happen: the
  script lists them and exits 1.

The independent checks (``_report_checks.py``) use transformers alone, never tl's own
claims: every ``blocks.{i}.hook_in`` equals what a plain forward passes to the i-th
decoder layer (recorded by a forward pre-hook), tl's logits equal transformers', and adding
a vector at ``blocks.1.hook_in`` (an ``add`` spec) gives the logits of a plain forward
whose second decoder layer gets the same vector added to its input by a forward pre-hook;
all within 1e-4 relative. A vision-language model that ran with an image in transformers
and whose image tl takes (``images=``) must give the plain model's logits on the same ids
and pixels. The weights: every tensor of the checkpoint, as the class that
wrote it loads it in plain transformers, equals a tensor of the model tl booted, and every
tensor of that model equals one of the checkpoint's. A causal or masked
checkpoint tl refuses is loaded with ``AutoModelForCausalLM`` too; the modules of the
weights that class would drop must be named by the refusal (a sequence-to-sequence one is
built whole, ``AutoModelForSeq2SeqLM``, and refused for its blocks' form). An
encoder-decoder's checks are the same per stack: ``encoder_blocks.{i}.hook_in`` and
``decoder_blocks.{i}.hook_in`` against each block's input, the logits on the build's decoder
ids, and an add at block 1 of each stack. The level
(full, sublayers, residual) is the driver's ``certification``.

The tiny checkpoints are cached, one folder per model type and kind, under
``$TL_CACHE_DIR/tiny-architectures/<transformers version>/`` when ``TL_CACHE_DIR`` is set,
else ``$XDG_CACHE_HOME/tl/...``, else ``~/.cache/tl/...`` (or ``--cache DIR``); a folder is
reused while the builder is unchanged, also for the types transformers cannot run, so a
rerun only boots tl. ``--check`` writes nothing and fails when the page differs from what
the script would write: a stale page, or one written with another transformers version
(rewrite it with the version CI installs, ``constraints.txt``); with or without it, any
WRONG verdict fails the run.

Usage: ``python scripts/architecture_report.py`` (rewrite), ``... --check``, or
``... --only llama gpt2 [--kind masked-lm]`` (those types, printed, nothing written).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report_checks as checks
import _tiny_builds as builds
import _tiny_checkpoints as tiny
from _report_checks import RTOL, independent_check
from _report_page import (
    FULL,
    LEVELS,
    NOT_RUNNABLE,
    REFUSED,
    RESIDUAL,
    SUBLAYERS,
    TEXT_ONLY,
    VERDICTS,
    WRONG,
    Totals,
    Verdict,
    page_version,
    render as _render,
    summary,
)

__all__ = [
    "FULL",
    "NOT_RUNNABLE",
    "REFUSED",
    "RESIDUAL",
    "RTOL",
    "SUBLAYERS",
    "TEXT_ONLY",
    "VERDICTS",
    "WRONG",
    "Totals",
    "Verdict",
    "default_cache",
    "first_sentence",
    "judge",
    "main",
    "model_types",
    "page_version",
    "render",
    "scan",
    "summary",
]

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architectures.md"
COMMAND = "python scripts/architecture_report.py"
GENERATED = (
    f"<!-- Generated by scripts/architecture_report.py: edit the script, then run `{COMMAND}`. "
    f"`{COMMAND} --check` (the docs session) fails when this page is stale. -->"
)
#: Seconds one model type may take to build, or to boot and check.
TIME_LIMIT_S = 120.0
#: The sites whose service makes a model "full hooks" when the driver has no certification.
_FULL_SITES = ("blocks.{i}.attn.hook_pattern", "blocks.{i}.mlp.hook_out")
#: Kinds whose refusals must name the weights transformers' causal-LM class would drop
#: (issue #43: every causal, masked and sequence-to-sequence type).
_NAMING_KINDS = ("", "masked-lm")


def default_cache() -> Path:
    """Where the tiny checkpoints of this transformers version live (see the module doc)."""
    import transformers

    if os.environ.get("TL_CACHE_DIR"):
        base = Path(os.environ["TL_CACHE_DIR"]).expanduser()
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tl"
    return base / "tiny-architectures" / transformers.__version__


def model_types(kind: builds.Kind = builds.CAUSAL) -> list[str]:
    """Every model type transformers maps in ``kind``'s mapping, sorted."""
    return builds.model_types(kind)


def render(verdicts: Sequence[Verdict], transformers_version: str) -> str:
    """The Markdown of docs/architectures.md."""
    return _render(verdicts, transformers_version, GENERATED)


# -- the verdict --------------------------------------------------------------------------


def first_sentence(text: str) -> str:
    """The first sentence of a message, on one line: up to the first ``". "`` outside
    brackets (a failed check quoted in parentheses may hold full stops)."""
    text = " ".join(text.split())
    depth = 0
    for i, char in enumerate(text):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth = max(0, depth - 1)
        elif char in ".!?" and depth == 0 and text[i + 1 : i + 2] == " ":
            return text[: i + 1]
    return text


def _level(driver: Any) -> tuple[str, str]:
    """The driver's certification level (``LEVELS``) and what the note says of it; for a
    driver without a certification, "full" when the attention pattern and the MLP output
    are served, else "residual"."""
    family = getattr(getattr(driver, "adapter", None), "family", None)
    source = f"adapter {family!r}" if family else "adapter"
    certification = getattr(driver, "certification", None)
    n_layers = driver.info.n_layers
    if certification is None:
        if all(
            any(site.format(i=i) in driver.hook_points for i in range(n_layers))
            for site in _FULL_SITES
        ):
            return "full", source
        return "residual", f"{source}; no attention pattern or MLP output site"
    level = str(getattr(certification, "level", "residual"))
    level = level if level in LEVELS else "residual"
    note = "architecture inferred" if getattr(certification, "inferred", False) else source
    if level != "full":
        statuses: Mapping[str, Any] = getattr(certification, "statuses", {}) or {}
        reasons = []
        for site in _FULL_SITES:
            kinds = []
            for i in range(n_layers):
                status = statuses.get(site.format(i=i))
                kind = getattr(status, "status", "?") if status is not None else "not checked"
                if kind not in kinds:
                    kinds.append(kind)
            if not set(kinds) <= {"real", "derived"}:
                reasons.append(f"{site.split('.', 2)[2]} {'/'.join(kinds)}")
        if reasons:
            note += "; " + ", ".join(reasons)
        mixer = statuses.get("blocks.0.mixer.hook_out")
        if getattr(mixer, "status", None) == "real":
            note += "; mixer sites (mixer.hook_in/hook_out) served"
    return level, note


@contextlib.contextmanager
def _quiet_tl() -> Iterator[None]:
    """Without the driver's boot warnings (the progress line says what they say)."""
    logger = logging.getLogger("tl_driver_hf")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _scrubbed(text: str, cache: Path) -> str:
    """``text`` without the cache folder, home folder or a failed check's error and tolerance
    (the page must not depend on them: float32 errors differ in their last digits between
    processors, and the equation names the failure)."""
    text = text.replace(str(cache), "<cache>").replace(str(Path.home()), "~")
    text = re.sub(r"\s*\[err [^\]]*\]", "", text)
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def _weights_problem(driver: Any, built: builds.Built) -> str | None:
    """What the booted model lacks of the checkpoint, or holds that is not the checkpoint's."""
    assert built.folder is not None
    dropped, foreign = checks.weights_not_held(driver.hf_model, built.folder, built.kind.auto_class)
    problems = []
    if dropped:
        problems.append(f"booted with {len(dropped)} weights dropped: {', '.join(dropped[:6])}")
    if foreign:
        problems.append(
            f"{len(foreign)} weights are not the checkpoint's: {', '.join(foreign[:6])}"
        )
    return "; ".join(problems) or None


def _refusal_problem(message: str, built: builds.Built) -> str | None:
    """A refusal of a checkpoint transformers' causal-LM class would drop weights from must
    name their modules."""
    if built.kind.key not in _NAMING_KINDS or built.folder is None:
        return None
    dropped = checks.weights_a_causal_lm_drops(built.folder, built.kind.auto_class)
    unnamed = checks.names_every_module(message, dropped)
    if not unnamed:
        return None
    return (
        f"refused without naming the {len(dropped)} weights transformers' causal-LM class "
        f"would drop (of {', '.join(unnamed[:6])}): {first_sentence(message)}"
    )


def judge(built: builds.Built, cache: Path, time_limit_s: float = TIME_LIMIT_S) -> Verdict:
    """Boot one built type with tl and give its verdict (never raises for the model)."""
    import torch

    from tl_core import UserError
    from tl_driver_hf import HFDriver

    def row(verdict: str, note: str) -> Verdict:
        return Verdict(
            built.model_type, built.class_name, verdict, _scrubbed(note, cache), built.kind.key
        )

    if built.folder is None:
        return row(NOT_RUNNABLE, built.error or "")
    driver = None
    step = "boot"
    took_image, image_problem, refused_images = False, None, None
    encoder_decoder = False
    reads = None
    try:
        with tiny.time_limit(time_limit_s), tiny.quiet(), _quiet_tl():
            try:
                driver = HFDriver.boot(str(built.folder), dtype=torch.float32)
            except UserError as refusal:
                message = str(refusal)
                step = "the weights check of the refusal"
                problem = _refusal_problem(message, built)
                if problem:
                    return row(WRONG, problem)
                return row(REFUSED, f"{type(refusal).__name__}: {first_sentence(message)}")
            step = "the weights check"
            weights = _weights_problem(driver, built)
            if weights:
                return row(WRONG, weights)
            step = "the checks"
            encoder_decoder = bool(getattr(driver, "encoder_decoder", False))
            reads = getattr(driver, "signal_input", None)
            if not built.kind.takes_ids and reads is None:
                return row(WRONG, f"tl booted {built.class_name}, whose inputs it cannot give")
            if reads is not None:
                checked = checks.independent_signal_check(driver, builds.tensors(built.inputs))
            elif encoder_decoder:
                ids = torch.tensor(built.ids)
                decoder_ids = built.inputs.get("decoder_input_ids")
                checked = checks.independent_seq2seq_check(
                    driver,
                    ids,
                    ids[:, :4] if decoder_ids is None else torch.tensor(decoder_ids),
                )
            else:
                checked = independent_check(driver, torch.tensor(built.ids))
            level, note = _level(driver)
            step = "the image check"
            took_image, image_problem = checks.image_check(driver, built.inputs)
            refused_images = getattr(driver, "images_refused", None)
    except Exception as error:  # a crash inside tl is no refusal
        return row(WRONG, f"tl raised in {step}: {tiny.describe(error)}")
    finally:
        if driver is not None:
            with contextlib.suppress(Exception):
                driver.close()
    if checked.problems or image_problem:
        problems = (*checked.problems, *([image_problem] if image_problem else []))
        return row(WRONG, "; ".join(problems + checked.remarks))
    if took_image:
        return row(LEVELS[level], "; ".join((note, *checked.remarks, "images served")))
    if built.kind.key not in ("", "masked-lm") and not encoder_decoder and reads is None:
        # A vision-language or speech model read from token ids: its other input is not served.
        other = built.remark or "tl gives it no image or audio"
        if refused_images and "pixel_values" in built.inputs:
            other = f"tl takes no image from it: {refused_images}"
        return row(
            TEXT_ONLY, "; ".join((f"{LEVELS[level]} on token ids", note, *checked.remarks, other))
        )
    return row(LEVELS[level], "; ".join((note, *checked.remarks)))


def scan(
    types: Sequence[str],
    cache: Path,
    *,
    kind: builds.Kind = builds.CAUSAL,
    rebuild: bool = False,
    time_limit_s: float = TIME_LIMIT_S,
    progress: Callable[[str], None] = print,
) -> list[Verdict]:
    """Build (or reuse), boot and judge every type in ``types`` of ``kind``, printing one
    line each."""
    import torch

    verdicts = []
    label = f"{kind.key}/" if kind.key else ""
    for n, model_type in enumerate(types, 1):
        start = time.perf_counter()
        torch.manual_seed(0)
        built = builds.build(model_type, cache, kind, time_limit_s=time_limit_s, rebuild=rebuild)
        verdict = judge(built, cache, time_limit_s)
        verdicts.append(verdict)
        took = time.perf_counter() - start
        note = f": {verdict.note}" if verdict.note else ""
        progress(
            f"[{n:3d}/{len(types)}] {label + model_type:40s} {took:5.1f}s {verdict.verdict}{note}"[
                :220
            ]
        )
    return verdicts


#: Issue #18's targets for causal LMs: the share of runnable types served, and the types
#: with full hooks.
SERVED_TARGET = 0.85
FULL_TARGET = 60


def _check_targets(totals: Totals) -> int:
    """1 (and why) when tl serves less causal LMs than the targets, else 0."""
    short = []
    if totals.served < SERVED_TARGET * totals.runnable:
        short.append(
            f"{totals.served} of {totals.runnable} runnable types served (target {SERVED_TARGET:.0%})"
        )
    if totals.full < FULL_TARGET:
        short.append(f"{totals.full} types with full hooks (target {FULL_TARGET})")
    if short:
        print("causal-LM coverage below target: " + "; ".join(short), file=sys.stderr)
        return 1
    return 0


def _compare(text: str, version: str) -> int:
    """``--check``: 0 when the page on disk is ``text``, else 1 with how to fix it."""
    on_disk = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
    written = page_version(on_disk)
    where = PAGE.relative_to(ROOT)
    if written and written != version:
        # Another release maps other types: a page of another version compares nothing, so
        # a check that skipped it could never fail.
        print(
            f"{where} was written with transformers {written}, and this is {version}: "
            f"run this under transformers {written} (the docs session installs the release the "
            f"page names), or move the page to {version} by rewriting it with {COMMAND} and "
            f"committing it (within constraints.txt's range)",
            file=sys.stderr,
        )
        return 1
    if on_disk != text:
        print(
            f"{where} is stale: it differs from what the scan gives now. Run {COMMAND} to rewrite it.",
            file=sys.stderr,
        )
        return 1
    print(f"{where} is up to date")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` verify) docs/architectures.md; return the exit code."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="fail if docs/architectures.md is stale; write nothing"
    )
    parser.add_argument(
        "--cache", type=Path, help="the tiny checkpoints' folder (default: see the module doc)"
    )
    parser.add_argument(
        "--only", nargs="+", metavar="TYPE", help="judge these model types only; write nothing"
    )
    parser.add_argument(
        "--kind",
        choices=[k.key or "causal" for k in builds.KINDS],
        help="with --only: the kind of the types (default causal); without: scan this kind only",
    )
    parser.add_argument(
        "--rebuild", action="store_true", help="rebuild the tiny checkpoints, ignoring the cache"
    )
    parser.add_argument(
        "--time-limit", type=float, default=TIME_LIMIT_S, help="seconds per type and step"
    )
    args = parser.parse_args(argv)

    import transformers

    cache = (args.cache.expanduser() if args.cache else default_cache()).resolve()
    cache.mkdir(parents=True, exist_ok=True)
    kinds = [builds.kind(args.kind or "causal")] if args.kind or args.only else list(builds.KINDS)
    plan = [(kind, model_types(kind)) for kind in kinds]
    if args.only:
        ((kind, known),) = plan
        unknown = [t for t in args.only if t not in known]
        if unknown:
            print(
                f"not model types of {kind.mapping} in transformers {transformers.__version__}: "
                f"{', '.join(unknown)}",
                file=sys.stderr,
            )
            return 2
        plan = [(kind, sorted(args.only))]
    total = sum(len(types) for _, types in plan)
    print(f"{total} model types of {len(plan)} kinds, tiny checkpoints in {cache}", flush=True)
    start = time.perf_counter()
    verdicts: list[Verdict] = []
    for kind, types in plan:
        began = time.perf_counter()
        found = scan(
            types,
            cache,
            kind=kind,
            rebuild=args.rebuild,
            time_limit_s=args.time_limit,
            progress=lambda s: print(s, flush=True),
        )
        print(f"{kind.title}: {summary(found)} in {time.perf_counter() - began:.0f} s", flush=True)
        verdicts += found
    print(f"all kinds: {summary(verdicts)} in {time.perf_counter() - start:.0f} s")
    status = 0
    wrong = [v for v in verdicts if v.verdict == WRONG]
    if wrong:
        print(
            f"WRONG: tl booted {len(wrong)} model type(s) whose independent checks failed "
            "(or crashed with an error that is no refusal):",
            *(f"{v.kind + '/' if v.kind else ''}{v.model_type}: {v.note}" for v in wrong),
            sep="\n  ",
            file=sys.stderr,
        )
        status = 1
    if args.only or args.kind:
        return status
    text = render(verdicts, transformers.__version__)
    if args.check:
        causal = [v for v in verdicts if v.kind == builds.CAUSAL.key]
        status = max(status, _check_targets(Totals.of(causal)))
        return max(status, _compare(text, transformers.__version__))
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return status


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)  # tiny models: threads cost more than they give
    sys.exit(main())
