"""The Markdown of docs/architectures.md, from the architecture report's verdicts."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import _tiny_builds as builds

__all__ = [
    "FULL",
    "LEVELS",
    "NOT_RUNNABLE",
    "REFUSED",
    "RESIDUAL",
    "SUBLAYERS",
    "TEXT_ONLY",
    "VERDICTS",
    "WRONG",
    "Totals",
    "Verdict",
    "page_version",
    "render",
    "summary",
]

FULL, SUBLAYERS, RESIDUAL, TEXT_ONLY, REFUSED, NOT_RUNNABLE, WRONG = (
    "full hooks",
    "sublayers",
    "residual",
    "text only",
    "refused",
    "not runnable in transformers",
    "WRONG",
)
VERDICTS = (FULL, SUBLAYERS, RESIDUAL, TEXT_ONLY, REFUSED, NOT_RUNNABLE, WRONG)
#: The driver's certification level -> the verdict of a model served at it.
LEVELS = {"full": FULL, "sublayers": SUBLAYERS, "residual": RESIDUAL}


@dataclass(frozen=True)
class Verdict:
    """The report's row of one model type of one kind.

    Attributes:
        model_type: The transformers model type.
        class_name: The class the kind's mapping gives it.
        verdict: One of ``VERDICTS``.
        note: The refusal, transformers' error, what failed, or how it is served.
        kind: The kind's key (``""``: causal LMs).
    """

    model_type: str
    class_name: str
    verdict: str
    note: str
    kind: str = ""


@dataclass(frozen=True)
class Totals:
    """The counts the page and the script's summary report."""

    mapped: int
    runnable: int
    served: int
    full: int
    sublayers: int
    residual: int
    text_only: int
    refused: int
    not_runnable: int
    wrong: int

    @classmethod
    def of(cls, verdicts: Sequence[Verdict]) -> Totals:
        """Count ``verdicts``."""
        count = {v: sum(1 for r in verdicts if r.verdict == v) for v in VERDICTS}
        return cls(
            mapped=len(verdicts),
            runnable=len(verdicts) - count[NOT_RUNNABLE],
            served=count[FULL] + count[SUBLAYERS] + count[RESIDUAL],
            full=count[FULL],
            sublayers=count[SUBLAYERS],
            residual=count[RESIDUAL],
            text_only=count[TEXT_ONLY],
            refused=count[REFUSED],
            not_runnable=count[NOT_RUNNABLE],
            wrong=count[WRONG],
        )


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _cell(text: str) -> str:
    # Brackets too: "[err 1e-3 <= 1e-4]" in a note reads as a reference link to the site.
    escaped = text.replace("\\", "\\\\").replace("|", "\\|").replace("[", "\\[").replace("]", "\\]")
    return escaped.replace("<", "&lt;").replace(">", "&gt;")


#: What each kind's models run on, in the page's words.
_INPUTS = {
    "ids": "a batch of 2 x 7 token ids",
    "seq2seq": "2 x 7 token ids and 2 x 5 decoder ids (token ids alone where the model "
    "takes no decoder ids: the decoder-only speech models of this mapping)",
    "image-text": "token ids holding the image tokens of one random image of the config's "
    "`image_size` where the model takes it (`get_image_features` counts the tokens), else "
    "token ids alone (the note says which)",
    "pixels": "2 random images of the config's `image_size` and `num_channels` (224 x 224 "
    "where it names no size)",
    "audio": f"2 x {builds.AUDIO_SAMPLES} random samples (`input_values`), or 2 x "
    f"{builds.AUDIO_FRAMES} frames of the config's feature size (`input_features`)",
}


def _totals_table(t: Totals) -> list[str]:
    lines = [
        "| | types | share |",
        "|---|---:|---:|",
        f"| mapped by transformers | {t.mapped} | |",
        f"| runnable in transformers | {t.runnable} | {_pct(t.runnable, t.mapped)} of mapped |",
        f"| served by tl | {t.served} | {_pct(t.served, t.runnable)} of runnable |",
        f"| &nbsp;&nbsp;{FULL} | {t.full} | {_pct(t.full, t.runnable)} of runnable |",
        f"| &nbsp;&nbsp;{SUBLAYERS} | {t.sublayers} | {_pct(t.sublayers, t.runnable)} of runnable |",
        f"| &nbsp;&nbsp;{RESIDUAL} | {t.residual} | {_pct(t.residual, t.runnable)} of runnable |",
    ]
    if t.text_only:
        lines.append(
            f"| {TEXT_ONLY} (booted, its other inputs not served) | {t.text_only} | "
            f"{_pct(t.text_only, t.runnable)} of runnable |"
        )
    lines += [
        f"| {REFUSED} | {t.refused} | {_pct(t.refused, t.runnable)} of runnable |",
        f"| {NOT_RUNNABLE} | {t.not_runnable} | {_pct(t.not_runnable, t.mapped)} of mapped |",
    ]
    if t.wrong:
        lines.append(f"| {WRONG} (tl booted, a check failed or tl crashed) | {t.wrong} | |")
    return lines


def _summary_table(by_kind: Sequence[tuple[builds.Kind, Sequence[Verdict]]]) -> list[str]:
    lines = [
        "| kind | mapping | mapped | runnable | served | text only | refused | not runnable "
        "| served of runnable |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    everything: list[Verdict] = []
    for kind, verdicts in by_kind:
        everything += verdicts
        t = Totals.of(verdicts)
        lines.append(
            f"| [{kind.title}](#{_anchor(kind.title)}) | `{kind.mapping}` | {t.mapped} | "
            f"{t.runnable} | {t.served} | {t.text_only} | {t.refused} | {t.not_runnable} | "
            f"{_pct(t.served, t.runnable)} |"
        )
    t = Totals.of(everything)
    lines.append(
        f"| **all kinds** | | {t.mapped} | {t.runnable} | {t.served} | {t.text_only} | "
        f"{t.refused} | {t.not_runnable} | {_pct(t.served, t.runnable)} |"
    )
    return lines


def _anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")


def _section(kind: builds.Kind, verdicts: Sequence[Verdict]) -> list[str]:
    runs = _INPUTS[kind.inputs]
    if kind is builds.CAUSAL:
        refused = ""
    elif kind.key == "masked-lm":
        refused = (
            " tl's hf driver boots a masked LM's checkpoint as its masked-LM class, with one "
            "bidirectional stack (its ragged batches carry the padding mask); a checkpoint "
            "this mapping lists that is an encoder-decoder (BART's sequence-to-sequence "
            "class) boots whole as one (see the sequence-to-sequence kind)."
        )
    elif kind.key == "seq2seq":
        refused = (
            " tl's hf driver boots an encoder-decoder checkpoint whole as its "
            "`AutoModelForSeq2SeqLM` class and serves both stacks (`encoder_blocks.{i}.*`, "
            "`decoder_blocks.{i}.*` with `cross_attn.*`): each block's input in both stacks "
            "must equal what a plain forward passes it, the logits on the same ids and "
            "decoder ids must be equal, and an `add` at block 1 of each stack must equal the "
            "same add by a forward pre-hook. Blocks of a form tl does not know, and models "
            "filed here that read audio into a decoder-only LM (they take no decoder ids), "
            "are refused by name."
        )
    elif kind.inputs == "image-text":
        refused = (
            " tl's hf driver boots a vision-language checkpoint as the class its config names, "
            "whole (vision tower, projector, language model), serves its language stack's "
            "hooks, and takes its images (`images=`) where its tower runs on pixels alone and "
            "the image checks of its certification pass: tl's logits with the image must then "
            "equal the plain model's on the same ids and pixels. Most types here need inputs "
            "their processor computes (image sizes, patch grids) that a random image of the "
            "config's size does not give: transformers itself does not run them with one, "
            "and the note gives its error."
        )
    else:
        refused = (
            " tl's hf driver serves decoder-only causal LMs, masked LMs, vision-language "
            "models and encoder-decoders: a model of this "
            "kind is refused with a `ConfigError` naming its kind, or, where transformers' "
            "causal-LM class of the same model type reads the checkpoint whole, booted as "
            "that class."
        )
    lines = [
        f"## {kind.title}",
        "",
        f"`{kind.mapping}`: the `{kind.auto_class}` class of every model type, run on "
        f"{runs}.{refused}",
        "",
        *_totals_table(Totals.of(verdicts)),
        "",
        "| model type | class | verdict | note |",
        "|---|---|---|---|",
    ]
    for v in sorted(verdicts, key=lambda r: r.model_type):
        lines.append(f"| `{v.model_type}` | `{v.class_name}` | {v.verdict} | {_cell(v.note)} |")
    return lines


def render(verdicts: Sequence[Verdict], transformers_version: str, generated: str) -> str:
    """The Markdown of docs/architectures.md (``generated``: the page's first comment)."""
    by_kind = [
        (kind, [v for v in verdicts if v.kind == kind.key])
        for kind in builds.KINDS
        if any(v.kind == kind.key for v in verdicts)
    ]
    lines = [
        "# Architecture coverage",
        "",
        generated,
        "",
        f"Every model type that transformers {transformers_version} maps in the task mappings "
        "below, built from its default config shrunk to a tiny random checkpoint (2 layers, "
        "width 64, sliding windows of 4 tokens; `scripts/_tiny_checkpoints.py`) of the class "
        "the mapping names, run in transformers, saved, then booted with the `hf` driver "
        "(`HFDriver.boot(folder)`). A model type counts once in each mapping that lists it. "
        "A type tl serves is checked against transformers alone, not against tl's own "
        "certification: each `blocks.{i}.hook_in` equals the input of the i-th decoder layer "
        "in a plain forward (`hidden_states[i]` in most models), the logits are equal, and an "
        "`add` spec at `blocks.1.hook_in` gives the logits of a plain forward whose second "
        "decoder layer gets the same vector added by a forward pre-hook, all within 1e-04 "
        "relative.",
        "",
        "No checkpoint boots with weights dropped: every tensor of the checkpoint, as the "
        "class that wrote it loads it in plain transformers, equals a tensor of the model tl "
        "booted, and every tensor of that model equals one of the checkpoint's. A causal or "
        "masked checkpoint from which transformers' causal-LM class would drop weights is "
        "refused, and the refusal names their modules. Any other "
        "outcome is WRONG.",
        "",
        f"- **{FULL}**: served, with certified attention and MLP sites.",
        f"- **{SUBLAYERS}**: served with certified attention and MLP outputs, not their insides.",
        f"- **{RESIDUAL}**: served at the residual-stream level (`blocks.{{i}}.hook_in`, "
        "`hook_out`, ...) only.",
        f"- **{TEXT_ONLY}**: a vision-language or speech model booted and checked on token "
        "ids, whose image or audio input tl does not serve (not counted as served).",
        f"- **{REFUSED}**: the driver refuses it at boot; the note is its reason.",
        f"- **{NOT_RUNNABLE}**: transformers itself cannot build or run it from the inputs "
        "of its section (default config, `use_cache=False`); the note is its error.",
        "",
        "## Summary",
        "",
        *_summary_table(by_kind),
    ]
    for kind, rows in by_kind:
        lines += ["", *_section(kind, rows)]
    return "\n".join(lines) + "\n"


def page_version(text: str) -> str | None:
    """The transformers version a page was written with (``None`` for no page)."""
    match = re.search(r"Every model type that transformers (\S+) maps", text)
    return match.group(1) if match else None


def summary(verdicts: Sequence[Verdict]) -> str:
    """The totals as the script prints them."""
    t = Totals.of(verdicts)
    text_only = f", {t.text_only} {TEXT_ONLY}" if t.text_only else ""
    return (
        f"{t.mapped} mapped, {t.runnable} runnable in transformers, "
        f"{t.served} served ({_pct(t.served, t.runnable)} of runnable: {t.full} {FULL}, "
        f"{t.sublayers} {SUBLAYERS}, {t.residual} {RESIDUAL}){text_only}, {t.refused} refused, "
        f"{t.not_runnable} not runnable, "
        f"{t.wrong} WRONG"
    )
