"""What transformers reports after loading a checkpoint, turned into tl errors.

``from_pretrained`` fills every weight the checkpoint lacks (or holds in another shape) at
random and only logs a table. The hf driver loads with ``output_loading_info=True`` and
refuses such a model before certification: a "3-layer" config over 2-layer weights would
otherwise serve a random third block, and certification would pass (it compares the model
with itself).

What counts as missing is what transformers still reports after its own structural rules:
tied weights (``lm_head.weight`` tied to the embedding), non-persistent buffers (rotary
``inv_freq``, ``position_ids``: never part of a checkpoint) and a class's declared
``_keys_to_ignore_on_load_missing`` are not reported. A persistent buffer transformers
reports is a missing weight like a parameter: many are learned (DeepSeek-V3's
``e_score_correction_bias``), and initialising them gives another model.

Weights the checkpoint holds that the model has no place for (``unexpected_keys``) are
refused too: transformers drops them, so the model that runs is a part of the checkpoint's
(the decoder of a sequence-to-sequence model read as a causal LM, two of three layers).
What a class declares it never loads (``_keys_to_ignore_on_load_unexpected``: GPT-2's
causal-mask buffers, a multi-token-prediction layer, a speech generator beside the text
model) and stale buffers (rotary ``inv_freq``, ``position_ids``) are removed from the
report by transformers before tl reads it, so they are not refused.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import nn

from tl_core import ConfigError
from tl_driver_hf._architecture._kinds import SERVED_KINDS, class_kind, with_article

__all__ = ["check_loading_info", "held_load_report", "release"]

#: transformers' logger of the load report (``log_state_dict_report``).
_TRANSFORMERS_LOGGER = "transformers.modeling_utils"
#: Config fields named like a size or count, for pointing at the one that disagrees.
_SIZE_FIELD = re.compile(r"^(num|n)_|_(size|dim|embd|embed|positions|embeddings|heads|layers?)$")
#: A weight name inside a numbered list: ``model.layers.2.mlp.up_proj.weight``.
_NUMBERED = re.compile(r"^(?P<list>.+?)\.(?P<index>\d+)\.(?P<rest>.+)$")
_SHOWN = 6


class _Hold(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in str(record.msg):
            self.records.append(record)
            return False
        return True


@contextmanager
def held_load_report() -> Iterator[_Hold]:
    """Hold transformers' load report while loading; ``release`` logs it afterwards.

    The report of a model tl refuses would repeat the refusal as a table before it; a
    report tl accepts (weights left unused) is logged as transformers would have.
    """
    logger = logging.getLogger(_TRANSFORMERS_LOGGER)
    hold = _Hold()
    logger.addFilter(hold)
    try:
        yield hold
    finally:
        logger.removeFilter(hold)


def release(hold: _Hold) -> None:
    """Log the held report records (after the load was accepted)."""
    logger = logging.getLogger(_TRANSFORMERS_LOGGER)
    for record in hold.records:
        logger.handle(record)


def _indices(values: Iterable[int]) -> str:
    ordered = sorted(values)
    if len(ordered) > 1 and ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}-{ordered[-1]}"
    return ", ".join(map(str, ordered))


def _names(rests: Iterable[str], *, counted: bool = False) -> str:
    ordered = sorted(rests)
    shown = ", ".join(ordered[:_SHOWN])
    if len(ordered) <= _SHOWN:
        return shown
    return f"{shown}, ..." if counted else f"{shown}, ... ({len(ordered)} in all)"


def grouped(keys: Iterable[str], all_keys: Iterable[str] = ()) -> str:
    """``keys`` compactly: weights of numbered layers grouped by layer, the rest listed.

    ``model.layers.2.*`` and ``model.layers.3.*`` with the same names read
    ``model.layers.2-3: all 9 of its weights (input_layernorm.weight, ...)`` when ``all_keys``
    (the model's own names) shows those are all of the layer's weights.
    """
    per_layer: dict[tuple[str, int], set[str]] = defaultdict(set)
    plain: list[str] = []
    for key in keys:
        match = _NUMBERED.match(key)
        if match is None:
            plain.append(key)
        else:
            per_layer[(match["list"], int(match["index"]))].add(match["rest"])
    everything: dict[tuple[str, int], set[str]] = defaultdict(set)
    for key in all_keys:
        match = _NUMBERED.match(key)
        if match is not None and (match["list"], int(match["index"])) in per_layer:
            everything[(match["list"], int(match["index"]))].add(match["rest"])
    # Layers missing the same names are written once: "model.layers.2-3".
    by_names: dict[tuple[str, frozenset[str]], list[int]] = defaultdict(list)
    for (prefix, index), rests in per_layer.items():
        by_names[(prefix, frozenset(rests))].append(index)
    parts = []
    for (prefix, names), indices in sorted(by_names.items(), key=lambda kv: (kv[0][0], min(kv[1]))):
        whole = all(frozenset(everything.get((prefix, i), ())) == names for i in indices)
        what = (
            f"all {len(names)} of its weights ({_names(names, counted=True)})"
            if whole
            else _names(names)
        )
        parts.append(f"{prefix}.{_indices(indices)}: {what}")
    if plain:
        parts.append(_names(plain))
    return "; ".join(parts)


def _layer_hint(missing: set[str], model_keys: list[str], config: Any) -> str:
    """How to fix weights missing for whole trailing layers: the config's layer count."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_layers = getattr(text, "num_hidden_layers", None)
    if not isinstance(n_layers, int):
        return ""
    layered: dict[int, set[str]] = defaultdict(set)
    lacking: dict[int, set[str]] = defaultdict(set)
    prefixes = set()
    for key in model_keys:
        match = _NUMBERED.match(key)
        if match is not None:
            prefixes.add(match["list"])
            layered[int(match["index"])].add(key)
            if key in missing:
                lacking[int(match["index"])].add(key)
    if len(prefixes) != 1 or set(layered) != set(range(n_layers)):
        return ""
    gone = sorted(i for i in lacking if lacking[i] == layered[i])
    if not gone or set(lacking) != set(gone) or gone != list(range(gone[0], n_layers)):
        return ""
    if set(missing) != set().union(*lacking.values()):
        return ""
    field = (getattr(text, "attribute_map", None) or {}).get(
        "num_hidden_layers", "num_hidden_layers"
    )
    return (
        f" The config has {field}={n_layers}, but the weights hold {gone[0]} layers: set "
        f"{field} to {gone[0]} in config.json (or hf_config_overrides), or pair the config "
        f"with the weights it was written for."
    )


def _size_fields(config: Any, sizes: set[int], overrides: Mapping[str, Any]) -> str:
    """Config size fields whose value is one of the model's (not the weights') sizes."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    fields = {
        key: value
        for key, value in text.to_dict().items()
        if _SIZE_FIELD.search(key) and isinstance(value, int) and not isinstance(value, bool)
    }
    overridden = [k for k in overrides if k in fields or hasattr(text, k)]
    if overridden:
        shown = ", ".join(f"{k}={overrides[k]!r}" for k in overridden)
        return f" hf_config_overrides set {shown}, which the weights do not fit."
    named = [f"{k}={v}" for k, v in sorted(fields.items()) if v in sizes]
    if not named:
        return ""
    return f" Config fields with the model's size: {', '.join(named[:_SHOWN])}."


#: A module inside a numbered list: ``model.layers.2``.
_NUMBERED_MODULE = re.compile(r"^(?P<list>.+)\.(?P<index>\d+)$")


def _placeless(keys: Iterable[str], model_keys: Iterable[str]) -> dict[str, list[str]]:
    """``keys`` under the shortest prefix the model holds nothing under (``model.encoder``,
    ``model.layers.2``, or the key itself for a lone weight)."""
    held: set[str] = set()
    for key in model_keys:
        parts = key.split(".")
        held.update(".".join(parts[:n]) for n in range(1, len(parts) + 1))
    found: dict[str, list[str]] = defaultdict(list)
    for key in keys:
        parts = key.split(".")
        prefix = next(
            (".".join(parts[:n]) for n in range(1, len(parts)) if ".".join(parts[:n]) not in held),
            key,
        )
        found[prefix].append(key)
    return found


def _modules(placeless: Mapping[str, list[str]]) -> str:
    """The placeless modules compactly: ``model.encoder (34 weights), model.layers.2-3 (18
    weights), final_logits_bias``."""
    numbered: dict[str, dict[int, int]] = defaultdict(dict)
    plain: list[tuple[str, int]] = []
    for prefix, keys in placeless.items():
        match = _NUMBERED_MODULE.match(prefix)
        if match is not None:
            numbered[match["list"]][int(match["index"])] = len(keys)
        else:
            plain.append((prefix, len(keys)))
    for list_name, counts in numbered.items():
        plain.append((f"{list_name}.{_indices(counts)}", sum(counts.values())))

    def shown(prefix: str, n: int) -> str:
        if n == 1 and prefix in placeless:
            return placeless[prefix][0]
        return f"{prefix} ({n} weights)"

    ordered = sorted(plain, key=lambda item: (-item[1], item[0]))
    return ", ".join(shown(p, n) for p, n in ordered[:_SHOWN]) + (
        f", ... ({len(ordered)} modules in all)" if len(ordered) > _SHOWN else ""
    )


def _layer_field(config: Any) -> tuple[Any, str, int | None]:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    field = (getattr(text, "attribute_map", None) or {}).get(
        "num_hidden_layers", "num_hidden_layers"
    )
    n_layers = getattr(text, "num_hidden_layers", None)
    return text, field, n_layers if isinstance(n_layers, int) else None


def _extra_layer_hint(
    placeless: Mapping[str, list[str]],
    model_keys: list[str],
    config: Any,
    overrides: Mapping[str, Any],
) -> str:
    """How to fix weights of whole layers past the config's count: the layer count."""
    _, field, n_layers = _layer_field(config)
    lists = {m["list"] for m in map(_NUMBERED.match, model_keys) if m is not None}
    matches = [_NUMBERED_MODULE.match(p) for p in placeless]
    if n_layers is None or len(lists) != 1 or any(m is None for m in matches):
        return ""
    extra = sorted(int(m["index"]) for m in matches if m is not None)
    if {m["list"] for m in matches if m is not None} != lists or extra != list(
        range(n_layers, n_layers + len(extra))
    ):
        return ""
    held = n_layers + len(extra)
    if field in overrides or "num_hidden_layers" in overrides:
        return (
            f" hf_config_overrides set {field}={n_layers}, but the weights hold {held} layers: "
            f"tl boots a checkpoint whole, so leave the layer count as the checkpoint has it "
            f"(to read an early layer, capture blocks.{{i}}.hook_out of the whole model)."
        )
    return (
        f" The config has {field}={n_layers}, but the weights hold {held} layers: set {field} "
        f"to {held} in config.json, or pair the weights with the config they were written for."
    )


def _unplaced_message(
    model: nn.Module,
    unexpected: set[str],
    missing: set[str],
    model_keys: list[str],
    *,
    name: str,
    overrides: Mapping[str, Any],
    config: Any,
) -> str:
    """Why a checkpoint whose file holds weights the built model has no place for is refused."""
    built = type(model).__name__
    placeless = _placeless(unexpected, model_keys)
    # Named parts of the checkpoint's model the built one lacks as a whole: its encoder.
    parts = sorted({p.rsplit(".", 1)[-1] for p in placeless if p.endswith("encoder")})
    whose = f", its {' and '.join(parts)} among them" if parts else ""
    count = f"{len(unexpected)} of its weights" if len(unexpected) > 1 else "one of its weights"
    also = (
        f", and {len(missing)} weights the file lacks would be initialised at random "
        f"({grouped(missing, model_keys)})"
        if missing
        else ""
    )
    dropped = (
        f"the {built} transformers builds for it has no place for {count}{whose}: "
        f"{_modules(placeless)}. Booting it would drop them{also}, so the model would not be "
        f"the checkpoint's."
    )
    named = [str(a) for a in getattr(config, "architectures", None) or ()]
    other = next((a for a in named if a != built), None)
    if other is not None:
        kind = class_kind(other)
        return (
            f"the checkpoint {name!r} is not the model transformers builds for it: its "
            f"config's architectures name {other}"
            + (f", {with_article(kind)}" if kind else "")
            + f", and {dropped} "
            + (
                f"The hf driver serves {kind}s whole: boot it without model_class= (tl then "
                f"builds {other})."
                if kind in SERVED_KINDS
                else f"The hf driver serves decoder-only causal LMs, masked LMs, "
                f"vision-language models and encoder-decoders; {kind}s are not served yet."
                if kind is not None
                else f"Boot a checkpoint of {built} itself, or pair the config with the "
                f"weights it was written for."
            )
        )
    hint = _extra_layer_hint(placeless, model_keys, config, overrides)
    return f"the checkpoint {name!r} holds weights its model does not use: {dropped}" + (
        hint
        or " Pair the config with the weights it was written for. If these weights are a "
        "part the model never runs (another task's head), load the model yourself and "
        "pass it as hf_model= (tl does not check the weights of a model it is given)."
    )


def check_loading_info(
    model: nn.Module,
    info: Mapping[str, Any],
    *,
    name: str,
    overrides: Mapping[str, Any],
    config: Any = None,
) -> None:
    """Refuse a model whose checkpoint lacks weights, holds them in other shapes, or holds
    weights the model has no place for.

    Args:
        model: The model ``from_pretrained`` built.
        info: Its ``output_loading_info`` (``missing_keys``, ``mismatched_keys``,
            ``unexpected_keys``, after transformers removed what the class declares it
            never loads).
        name: The checkpoint, for the message.
        overrides: The boot's ``hf_config_overrides`` (named when the weights do not fit).
        config: The checkpoint's config (``None``: the model's; a model built from a
            multimodal config may hold its text part only).

    Raises:
        ConfigError: Weights the model needs are not in the checkpoint, have another shape
            there, or have no place in the model (each named, grouped by layer or module,
            with what the checkpoint is and how to proceed).
    """
    missing = set(info.get("missing_keys") or ())
    mismatched = sorted(info.get("mismatched_keys") or ())
    unexpected = set(info.get("unexpected_keys") or ())
    if not missing and not mismatched and not unexpected:
        return
    config = model.config if config is None else config
    model_keys = list(model.state_dict().keys())
    if mismatched:
        shapes: dict[tuple[tuple[int, ...], tuple[int, ...]], list[str]] = defaultdict(list)
        model_sizes: set[int] = set()
        for key, in_weights, in_model in mismatched:
            pair = (tuple(in_weights), tuple(in_model))
            shapes[pair].append(key)
            model_sizes |= {m for w, m in zip(pair[0], pair[1], strict=False) if w != m}
        described = "; ".join(
            f"{grouped(keys)}: {list(w)} in the weights, {list(m)} in the model"
            for (w, m), keys in sorted(shapes.items(), key=lambda kv: sorted(kv[1])[0])
        )
        also = "".join(
            f" ({len(keys)} weights {why} too: {text})"
            for keys, why, text in (
                (missing, "are missing", grouped(missing, model_keys)),
                (
                    unexpected,
                    "have no place in the model",
                    _modules(_placeless(unexpected, model_keys)),
                ),
            )
            if keys
        )
        raise ConfigError(
            f"the weights of {name!r} do not fit the model its config describes: {described}{also}. "
            f"The config's sizes and the weights disagree, so transformers would replace "
            f"these weights with random ones.{_size_fields(config, model_sizes, overrides)} "
            f"Set the config's sizes (hidden_size, vocab_size, intermediate_size, head counts) "
            f"to the weights', or pair the weights with the config they were written with."
        )
    if unexpected:
        raise ConfigError(
            _unplaced_message(
                model,
                unexpected,
                missing,
                model_keys,
                name=name,
                overrides=overrides,
                config=config,
            )
        )
    raise ConfigError(
        f"the checkpoint {name!r} lacks {len(missing)} weights the model its config describes "
        f"needs: {grouped(missing, model_keys)}. transformers would initialise them at random, "
        f"so the model would not be the checkpoint's; the config and the weights disagree."
        f"{_layer_hint(missing, model_keys, config) or ' Pair the config with the weights it was written for (or add the missing weights).'}"
    )
