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
``e_score_correction_bias``), and initialising them gives another model. Weights the
checkpoint holds that the model has no place for (``unexpected_keys``) are left alone here.
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


def check_loading_info(
    model: nn.Module,
    info: Mapping[str, Any],
    *,
    name: str,
    overrides: Mapping[str, Any],
) -> None:
    """Refuse a model whose checkpoint lacks weights or holds them in other shapes.

    Args:
        model: The model ``from_pretrained`` built.
        info: Its ``output_loading_info`` (``missing_keys``, ``mismatched_keys``, ...).
        name: The checkpoint, for the message.
        overrides: The boot's ``hf_config_overrides`` (named when the weights do not fit).

    Raises:
        ConfigError: Weights the model needs are not in the checkpoint, or have another
            shape there (each named, grouped by layer, with how to fix it).
    """
    missing = set(info.get("missing_keys") or ())
    mismatched = sorted(info.get("mismatched_keys") or ())
    if not missing and not mismatched:
        return
    config: Any = model.config
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
        also = (
            f" ({len(missing)} weights are missing too: {grouped(missing, model_keys)})"
            if missing
            else ""
        )
        raise ConfigError(
            f"the weights of {name!r} do not fit the model its config describes: {described}{also}. "
            f"The config's sizes and the weights disagree, so transformers would replace "
            f"these weights with random ones.{_size_fields(config, model_sizes, overrides)} "
            f"Set the config's sizes (hidden_size, vocab_size, intermediate_size, head counts) "
            f"to the weights', or pair the weights with the config they were written with."
        )
    unexpected = set(info.get("unexpected_keys") or ())
    other = ""
    if unexpected:
        # A checkpoint of another class (a sequence-to-sequence model read as a causal LM).
        named = list(getattr(config, "architectures", None) or ())
        other = (
            f" The file also holds {len(unexpected)} weights this {type(model).__name__} has "
            f"no place for ({grouped(unexpected)}): it was likely written for another class"
            + (f" (its config names {named})" if named else "")
            + "."
        )
    raise ConfigError(
        f"the checkpoint {name!r} lacks {len(missing)} weights the model its config describes "
        f"needs: {grouped(missing, model_keys)}. transformers would initialise them at random, "
        f"so the model would not be the checkpoint's; the config and the weights disagree."
        f"{other}"
        f"{_layer_hint(missing, model_keys, config) or ' Pair the config with the weights it was written for (or add the missing weights).'}"
    )
