"""Names from other tools, and how each one resolves to the canonical vocabulary.

Four families besides the canonical names are accepted wherever a hook name is:

* ``legacy``: HookedTransformer names (``blocks.3.hook_resid_pre``, ``hook_embed``).
* ``tl_bridge``: TransformerLens 4.x ``TransformerBridge`` sub-module names
  (``blocks.3.attn.q.hook_out``, ``blocks.3.mlp.out.hook_in``, ``unembed.hook_in``).
* ``nnterp``: ``StandardizedTransformer`` accessors (``layers_output[3]``, ``logits``).
* ``interp_engine``: interp-engine point addresses (``resid_post.3``, ``embeddings``).

Each name resolves to a canonical name or to an honest status:

* ``alias``: the same tensor as a canonical site (possibly laid out differently by the
  other tool, e.g. flattened heads; tl always serves the canonical layout).
* ``derived``: no site of its own; a function of canonical sites or of the inputs (a
  broadcast, a softmax, token ids). ``canonical`` names the site it is computed from, if one.
* ``reconstructed_read_only``: a real value inside the model that no tl hook fires at; it
  can only be rebuilt after the pass from captured sites plus the model's weights or config,
  so it can be read that way but never intervened on.
* ``structurally_absent``: a site this kind of model does not have (encoders,
  cross-attention, multi-stream residuals; with ``info``, e.g. ``pos_embed`` on a rotary model).

Some names mean different tensors on different architectures (``hook_attn_out`` on
sandwich-norm models, ``mlp.in.hook_out`` on gated MLPs). Without ``info`` they resolve to
the common meaning and their ``note`` says so; with ``info`` they resolve per model.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from tl_core._errors import ConfigError, HookNameError
from tl_core.hooks._alias_tables import (
    FAMILY_TABLES,
    MULTI_STREAM,
    HookFamily,
    HookStatus,
    Rule,
    Target,
)
from tl_core.hooks._model_info import ModelInfo
from tl_core.hooks._requirements import requirement_unknown
from tl_core.hooks._vocabulary import (
    CANONICAL_TEMPLATES,
    MISSING_BECAUSE,
    HookTemplate,
    requirement_met,
    split_canonical,
)

__all__ = [
    "HookFamily",
    "HookResolution",
    "HookStatus",
    "block_index",
    "canonical_name",
    "known_alias_templates",
    "layout_of",
    "resolve_hook_name",
    "suggest_names",
    "template_of",
]


@dataclass(frozen=True)
class HookResolution:
    """What a hook name means in the canonical vocabulary.

    Attributes:
        query: The name as given.
        canonical: The concrete canonical name (``"blocks.3.hook_out"``). For ``derived`` and
            ``reconstructed_read_only`` it is the site the value is computed from, if there is
            exactly one; ``None`` when there is none.
        status: ``"canonical"``, ``"alias"``, ``"derived"``, ``"reconstructed_read_only"`` or
            ``"structurally_absent"``.
        family: Which naming scheme ``query`` belongs to.
        note: For every status but ``canonical``: what differs, how a derived value is
            computed, or why the site is absent.
    """

    query: str
    canonical: str | None
    status: HookStatus
    family: HookFamily
    note: str


def _build_table() -> dict[str, Rule]:
    table: dict[str, Rule] = {
        t.template: Rule("canonical", Target(t.template, "canonical")) for t in CANONICAL_TEMPLATES
    }
    for family in FAMILY_TABLES:
        clash = table.keys() & family.keys()
        if clash:  # a name must mean one thing
            raise RuntimeError(f"hook alias tables define {sorted(clash)} twice")
        table.update(family)
    # A template's HookedTransformer name that no table lists is a plain alias of it.
    for t in CANONICAL_TEMPLATES:
        if t.legacy is not None and t.legacy not in table:
            table[t.legacy] = Rule("legacy", Target(t.template, "alias"))
    return table


_TABLE = _build_table()


def known_alias_templates() -> dict[str, tuple[HookFamily, HookStatus, str | None]]:
    """Every accepted name template (``{i}`` = block index) with its default resolution.

    Returns:
        ``{template: (family, status, canonical template or None)}``, canonical names
        included, as resolved without a ``ModelInfo``.
    """
    return {k: (r.family, r.target.status, r.target.canonical) for k, r in _TABLE.items()}


_BLOCK = re.compile(r"blocks\.([0-9]+)\.(.+)")
_STACKED = re.compile(r"(encoder_blocks|decoder_blocks)\.([0-9]+)\.(.+)")
_BARE_BLOCKS = re.compile(r"(?<![A-Za-z0-9_])blocks\.")
# TransformerLens 4.3 names a decoder block's self-attention ``self_attn`` (its ``attn`` is
# tl's); its ln1/ln2/ln3 numbering is tl's too.
_STACK_SEGMENTS = {"self_attn": "attn"}
# TransformerLens 4.3's block-level names for cross-attention's output and the stream after it.
_STACK_ALIASES = {"hook_cross_attn_out": "cross_attn.hook_out", "hook_resid_mid2": "ln3.hook_in"}
# TransformerLens 4.3's name of an encoder-decoder's final norm (tl's ``ln_final``).
_DECODER_FINAL = "decoder_ln_final."
_BRACKET = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\[([0-9]+)\]")
_DOTTED = re.compile(r"([a-z_]+)\.([0-9]+)")
_STREAM = re.compile(r"([a-z_]+)\.([0-9]+)\.stream-([0-9]+)")
_NEGATIVE = re.compile(r"^blocks\.-[0-9]+\.|\[-[0-9]+\]$|\.-[0-9]+(?:$|\.)")
# Segments of TransformerLens names for encoder, encoder-decoder and BERT-style models.
_NOT_DECODER_ONLY = frozenset(
    {
        "encoder",
        "decoder",
        "encoder_final_ln",
        "decoder_final_ln",
        "cross_attn",
        "hook_cross_attn_in",
        "hook_cross_attn_out",
        "hook_resid_mid_cross",
        "hook_pooler_out",
        "pooler",
        "hook_nsp_out",
        "nsp_head",
    }
)


# First segments of TransformerLens 4.3's (and DESIGN's) vision-tower and projector names.
_VISION_TOWER = frozenset({"vision_encoder", "vision_projector", "vision_blocks"})


def _index(digits: str, name: str) -> int:
    if len(digits) > 1 and digits[0] == "0":
        raise HookNameError(
            f"hook name {name!r} has block index {digits!r} with a leading zero; write "
            f"{name.replace(digits, str(int(digits)), 1)!r}."
        )
    return int(digits)


def _parse(name: str) -> tuple[str, int | None]:
    """``(template key, block index)``, e.g. ``("blocks.{i}.hook_out", 3)``."""
    if name.startswith("blocks."):
        match = _BLOCK.fullmatch(name)
        if match:
            return f"blocks.{{i}}.{match.group(2)}", _index(match.group(1), name)
    elif name.endswith("]"):
        match = _BRACKET.fullmatch(name)
        if match:
            return f"{match.group(1)}[{{i}}]", _index(match.group(2), name)
    elif name[-1:].isdigit():
        match = _DOTTED.fullmatch(name)
        if match:
            return f"{match.group(1)}.{{i}}", _index(match.group(2), name)
    return name, None


def _fill(text: str, layer: int | None, info: ModelInfo | None) -> str:
    if layer is not None:
        text = text.replace("{i}", str(layer))
    if info is not None:
        text = text.replace("{last}", str(info.n_layers - 1))
    return text


@lru_cache(maxsize=8192)
def _resolve(name: str, info: ModelInfo | None) -> HookResolution:
    if "{" in name or "}" in name:
        # A table row itself (``attn_in.{i}``) would match its own rule with no index.
        example = name.replace("{i}", "0").replace("{last}", "0")
        raise HookNameError(
            f"hook name {name!r} holds a placeholder in braces, so it names no hook: write "
            f"a block index in its place (e.g. {example!r})."
        )
    if name == "encoder_ln_final.hook_in" and info is not None and info.encoder_layers:
        # TransformerLens 4.3's encoder final norm reads the encoder's last block output.
        last = f"encoder_blocks.{info.encoder_layers - 1}.hook_out"
        return HookResolution(name, last, "alias", "tl_bridge", "")
    if name.startswith(_DECODER_FINAL) and (info is None or info.encoder_layers is not None):
        inner = _resolve("ln_final." + name[len(_DECODER_FINAL) :], info)
        renamed: HookStatus = "alias" if inner.status == "canonical" else inner.status
        return HookResolution(name, inner.canonical, renamed, "tl_bridge", inner.note)
    stacked = _STACKED.fullmatch(name)
    if stacked is not None:
        prefix, digits, rest = stacked.groups()
        return _resolve_stacked(name, prefix, digits, rest, info)
    key, layer = _parse(name)
    rule = _TABLE.get(key)
    if rule is None:
        return _unlisted(name, key, layer)
    if info is not None and info.encoder_layers is not None and layer is not None:
        raise HookNameError(_unstacked_message(name, info))
    if info is not None and layer is not None and layer >= info.n_layers:
        raise HookNameError(
            f"hook {name!r} names block {layer}, but this {info.architecture or 'model'} has "
            f"{info.n_layers} blocks (indices 0 to {info.n_layers - 1})."
        )
    target = rule.target
    if info is not None:
        target = next((alt for cond, alt in rule.by_model if cond(info)), target)
    canonical = None if target.canonical is None else _fill(target.canonical, layer, info)
    status, note = target.status, _fill(target.note, layer, info)
    if info is not None and canonical is not None and status in ("canonical", "alias"):
        requires = template_of(canonical).requires
        if not requirement_met(requires, info, include_attn_result=True) and not (
            requirement_unknown(requires, info)
        ):
            assert requires is not None
            status = "structurally_absent"
            model = info.architecture or "model"
            note = f"This {model} has no {canonical!r}: {MISSING_BECAUSE[requires]}."
    return HookResolution(name, canonical, status, rule.family, note)


def _restacked(text: str, prefix: str) -> str:
    return _BARE_BLOCKS.sub(f"{prefix}.", text)


def _resolve_stacked(
    name: str, prefix: str, digits: str, rest: str, info: ModelInfo | None
) -> HookResolution:
    """A name in one stack of an encoder-decoder (``decoder_blocks.1.cross_attn.hook_z``):
    resolved as the same name in a one-stack model with that stack's facts, then put back
    in its stack."""
    rest = _STACK_ALIASES.get(rest, rest)
    head, dot, tail = rest.partition(".")
    inner_name = f"blocks.{digits}.{_STACK_SEGMENTS.get(head, head)}{dot}{tail}"
    cross = head == "cross_attn" and split_canonical(inner_name) is None
    if cross:
        # TransformerLens's module-level names (cross_attn.q.hook_out, cross_attn.o.hook_in)
        # mean for cross-attention what the same names mean for attention.
        inner_name = f"blocks.{digits}.attn{dot}{tail}"
    if info is not None and info.encoder_layers is None:
        note = (
            f"{prefix}.{{i}} names a stack of an encoder-decoder model; this "
            f"{info.architecture or 'model'} has one stack, whose blocks are blocks.{{i}}."
        )
        return HookResolution(name, None, "structurally_absent", "tl_bridge", note)
    try:
        inner = _resolve(inner_name, None if info is None else info.stack(prefix))
    except HookNameError as error:
        raise HookNameError(_restacked(str(error), prefix)) from None
    canonical = None if inner.canonical is None else _restacked(inner.canonical, prefix)
    if cross and canonical is not None:
        canonical = canonical.replace(".attn.", ".cross_attn.", 1)
        if canonical.endswith(".cross_attn.hook_in") and tail.startswith(("k.", "v.")):
            note = (
                "cross-attention's keys and values read the encoder's output (after its final "
                "norm), which tl does not serve as a site yet; cross_attn.hook_k and hook_v are "
                "their projections"
            )
            return HookResolution(name, None, "structurally_absent", inner.family, note)
        if split_canonical(canonical) is None:
            note = f"cross-attention has no site {canonical.split('.', 2)[2]!r} in tl's vocabulary"
            return HookResolution(name, None, "structurally_absent", inner.family, note)
    family, status = inner.family, inner.status
    if canonical != name and family == "canonical":
        # Only TransformerLens 4.3's stack names (``self_attn``) differ from tl's here.
        family, status = "tl_bridge", "alias"
    return HookResolution(name, canonical, status, family, _restacked(inner.note, prefix))


def _unstacked_message(name: str, info: ModelInfo) -> str:
    model = info.architecture or "model"
    return (
        f"hook name {name!r} names a block, but this {model} is an encoder-decoder: its blocks "
        f"are encoder_blocks.{{i}} ({info.encoder_layers} blocks) and decoder_blocks.{{i}} "
        f"({info.n_layers} blocks), e.g. 'encoder_blocks.0.hook_out' or "
        f"'decoder_blocks.0.cross_attn.hook_z'."
    )


def _unlisted(name: str, key: str, layer: int | None) -> HookResolution:
    """A name outside the tables: structurally absent, a malformed index, or unknown."""
    stream = _STREAM.fullmatch(name)
    if stream and f"{stream.group(1)}.{{i}}" in _TABLE:
        note = (
            "A stream coordinate selects one residual stream of a hyper-connection trunk. "
            + MULTI_STREAM
        )
        return HookResolution(name, None, "structurally_absent", "interp_engine", note)
    if name.split(".", 1)[0] in _VISION_TOWER:
        raise HookNameError(
            f"{name!r} names a site of a vision-language model's vision tower or projector "
            "(TransformerLens 4.3's names); tl serves such models' language stack "
            "(blocks.{i}.*), not yet their vision tower's sites: the projected image features "
            "are blocks.0.hook_in at the image positions (bridge.architecture.vision names the "
            "image token)."
        )
    if _NOT_DECODER_ONLY.intersection(name.split(".")):
        note = (
            "An encoder, encoder-decoder or masked-LM site; decoder-only language models have "
            "no encoder, cross-attention or pooler."
        )
        return HookResolution(name, None, "structurally_absent", "legacy", note)
    if _NEGATIVE.search(name):
        raise HookNameError(
            f"hook name {name!r} has a negative block index; block indices run from 0 to "
            f"n_layers - 1 (write blocks.<n_layers - 1> for the last block)."
        )
    if layer is None:
        bare = name[len("blocks.") :] if name.startswith("blocks.") else name
        for candidate in (f"blocks.{{i}}.{bare}", f"{name}[{{i}}]", f"{name}.{{i}}"):
            if candidate in _TABLE:
                raise HookNameError(
                    f"hook name {name!r} needs a block index: write e.g. "
                    f"{candidate.replace('{i}', '0')!r} (indices run from 0 to n_layers - 1)."
                )
    raise HookNameError(_unknown_message(name, layer))


def _unknown_message(name: str, layer: int | None) -> str:
    if layer is None:
        digits = re.search(r"[0-9]+", name)
        layer = int(digits.group(0)) if digits else 0
    concrete = {key.replace("{i}", str(layer)): key for key in _TABLE}
    hints = []
    for candidate in suggest_names(name, concrete):
        target = _TABLE[concrete[candidate]].target
        canonical = None if target.canonical is None else _fill(target.canonical, layer, None)
        if target.status == "canonical" or canonical is None:
            hints.append(repr(candidate))
        elif target.status == "alias":
            hints.append(f"{candidate!r} (= {canonical!r})")
        else:
            hints.append(f"{candidate!r} ({target.status})")
    hint = f" Did you mean {', '.join(hints)}?" if hints else ""
    return (
        f"unknown hook name {name!r}: it is not a canonical name nor a HookedTransformer, "
        f"TransformerBridge, nnterp or interp-engine name.{hint} "
        f"tl_core.canonical_hook_names(info) lists a model's canonical names."
    )


def resolve_hook_name(name: str, *, info: ModelInfo | None = None) -> HookResolution:
    """Resolve a hook name from any supported family to the canonical vocabulary.

    Args:
        name: A concrete name: ``"blocks.3.hook_resid_post"``, ``"layers_output[3]"``,
            ``"resid_post.3"``, ``"blocks.3.hook_out"``, ...
        info: The model, when known. Names whose meaning depends on the architecture then
            resolve per model, block indices are range-checked, and canonical sites the
            model lacks come back ``structurally_absent``.

    Returns:
        The resolution; its ``status`` says whether a canonical site holds the tensor.

    Raises:
        HookNameError: ``name`` is not a string, is unknown (the message lists up to three
            nearest names), or has a negative, missing, zero-padded or out-of-range index.
        ConfigError: ``info`` is not a ``ModelInfo``.
    """
    if not isinstance(name, str):
        raise HookNameError(f"hook names are strings, got {type(name).__name__}: {name!r}")
    if info is not None and not isinstance(info, ModelInfo):
        raise ConfigError(f"info must be a ModelInfo or None, got {type(info).__name__}")
    return _resolve(name, info)


_REFUSAL: dict[HookStatus, str] = {
    "derived": "is not a hook site: it is derived from other values",
    "reconstructed_read_only": "has no tl hook: it can only be reconstructed, read-only, "
    "after the forward pass",
    "structurally_absent": "is structurally absent",
}


def canonical_name(name: str, *, info: ModelInfo | None = None) -> str:
    """The canonical name of ``name``, for names that denote a canonical site.

    Args:
        name: A hook name in any family.
        info: The model, when known (see ``resolve_hook_name``).

    Returns:
        The concrete canonical name (``"blocks.3.hook_out"`` for ``"resid_post.3"``).

    Raises:
        HookNameError: As ``resolve_hook_name``, and when the name is derived, only
            reconstructable or structurally absent; the message carries the reason and what
            to use instead.
    """
    resolution = resolve_hook_name(name, info=info)
    if resolution.status in ("canonical", "alias") and resolution.canonical is not None:
        return resolution.canonical
    computed = resolution.status != "structurally_absent" and resolution.canonical is not None
    source = f" (computed from {resolution.canonical!r})" if computed else ""
    raise HookNameError(
        f"hook {name!r} ({resolution.family} name) {_REFUSAL[resolution.status]}{source}. "
        f"{resolution.note}"
    )


def template_of(name: str) -> HookTemplate:
    """The vocabulary row of a canonical or alias name.

    Args:
        name: A concrete hook name in any family (``"blocks.3.hook_resid_pre"``).

    Returns:
        The template of the canonical name it resolves to.

    Raises:
        HookNameError: Unknown name, or one with no canonical site (derived,
            reconstructed or structurally absent; the message says which and why).
    """
    split = split_canonical(name) if isinstance(name, str) else None
    if split is not None:
        return split[0]
    split = split_canonical(canonical_name(name))
    assert split is not None  # canonical_name only returns canonical names
    return split[0]


def layout_of(name: str) -> str:
    """The tensor layout of a canonical or alias name.

    Args:
        name: A concrete hook name in any family.

    Returns:
        One of ``LAYOUTS``, e.g. ``"b p h dh"``.

    Raises:
        HookNameError: As ``template_of``.
    """
    return template_of(name).layout


def block_index(name: str) -> int | None:
    """The block index a hook name points into.

    Args:
        name: A concrete hook name in any family.

    Returns:
        ``"blocks.3.attn.hook_q"`` -> 3, ``"resid_post.5"`` -> 5; ``None`` for global hooks
        (``"hook_embed"``).

    Raises:
        HookNameError: A name no vocabulary family knows.
    """
    split = split_canonical(name) if isinstance(name, str) else None
    if split is not None:
        return split[1]
    resolution = resolve_hook_name(name)
    if resolution.canonical is not None:
        split = split_canonical(resolution.canonical)
        if split is not None:
            return split[1]
    digits = re.search(r"(?:^blocks\.|\[|\.)([0-9]+)(?:\.|\]|$)", name)
    return int(digits.group(1)) if digits else None


def suggest_names(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """Up to ``n`` candidates closest to ``name``, best first (case-insensitive).

    Args:
        name: What the user typed.
        candidates: Names to choose from (any iterable of strings, e.g. a dict's keys).
        n: How many to return at most.

    Returns:
        Candidates similar enough to be a plausible typo, or an empty list.
    """
    if not isinstance(name, str) or n <= 0:
        return []
    by_lower: dict[str, str] = {}
    for candidate in candidates:
        if isinstance(candidate, str):
            by_lower.setdefault(candidate.lower(), candidate)
    matches = difflib.get_close_matches(name.lower(), list(by_lower), n=n, cutoff=0.6)
    return [by_lower[m] for m in matches]
