"""``CaptureConfig``: everything that decides what a capture store holds.

A store records its config in its manifest; resuming compares the requested config with
the recorded one field by field and refuses any difference, naming it, so a store never
mixes two jobs.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from tl_core._errors import UserError
from tl_core.capture._model_files import resolved_path

__all__ = ["CaptureConfig", "InputFormat", "Separator", "fingerprint"]

InputFormat = Literal["text", "jsonl", "datasets"]
#: What joins two documents inside a packed context.
Separator = Literal["bos", "eos", "none"]

_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class CaptureConfig:
    """What to capture, from which input, with which model, and how to cut it into shards.

    Attributes:
        model: What the driver loads (a folder, a hub id, a native preset); a path object
            is stored as its absolute path.
        hooks: Hook names to capture (canonical names or aliases).
        input: The input: a text file (one document per line), a JSONL file, or a
            folder written by ``datasets.Dataset.save_to_disk``.
        driver: A driver name from ``tl drivers``.
        boot_options: The driver's boot options (JSON values), e.g. ``{"dtype": "float32"}``.
        input_format: ``"text"``, ``"jsonl"`` or ``"datasets"``; ``None`` picks by the path
            (a folder is a dataset, ``.jsonl`` is JSONL, anything else text).
        text_field: The field holding each document's text (JSONL, datasets).
        context_size: Tokens per context (the model's input length).
        pack: Concatenate documents into full contexts (``separator`` between them);
            otherwise each document starts a new context and long ones continue in the next.
        prepend_bos: Start every context with the BOS token.
        separator: The token between two documents in a packed context.
        drop_bos: Leave positions holding the BOS token out of the store.
        drop_padding: Leave padding positions out; with ``False`` a short context is padded
            to ``context_size`` with the pad token and every position is stored (fixed-size
            contexts, as an export to sae-lens needs).
        batch_size: Contexts per forward pass.
        shard_contexts: Contexts per shard (a multiple of ``batch_size``); ``None`` sizes a
            shard to about 256 MiB of activations.
        dtype: Storage dtype of floating activations (``None``: as the driver returns them).
        max_tokens: Stop after the context that reaches this many input tokens.
        intervene: Specs applied while capturing (JSON, as ``run_with_cache(intervene=)``).
        dictionaries: Sparse dictionaries attached while capturing, so their sites
            (``<hook>.hook_sae_top_indices``, ...) can be captured: one mapping each with
            ``path`` (a sae-lens folder) and optionally ``hook_name``, ``output_hook_name``,
            ``top_k`` and ``use_error_term`` (default ``True``: the model downstream stays
            as it is, so later hooks hold the model's own values).
    """

    model: str
    hooks: tuple[str, ...]
    input: str
    driver: str = "hf"
    boot_options: Mapping[str, Any] = field(default_factory=dict)
    input_format: InputFormat | None = None
    text_field: str = "text"
    context_size: int = 128
    pack: bool = True
    prepend_bos: bool = True
    separator: Separator = "bos"
    drop_bos: bool = False
    drop_padding: bool = True
    batch_size: int = 8
    shard_contexts: int | None = None
    dtype: str | None = None
    max_tokens: int | None = None
    intervene: Any = None
    dictionaries: tuple[Mapping[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.hooks, str) or not isinstance(self.hooks, Sequence) or not self.hooks:
            raise UserError(
                f"hooks must be a non-empty list of hook names, got {self.hooks!r}; e.g. "
                f"['blocks.0.hook_resid_post']"
            )
        object.__setattr__(self, "hooks", tuple(self.hooks))
        _checked_names(self)
        if isinstance(self.model, os.PathLike):  # a folder given as a path; a str may be a hub id
            object.__setattr__(self, "model", str(Path(self.model).expanduser().resolve()))
        object.__setattr__(self, "input", str(Path(self.input).expanduser().resolve()))
        object.__setattr__(self, "boot_options", dict(self.boot_options))
        if self.driver != "native":  # a native model is a preset name, never a path
            # A relative path names another model from another working folder: the store
            # records (and every part of a job boots) the absolute one.
            object.__setattr__(self, "model", resolved_path(self.model))
            tokenizer = self.boot_options.get("tokenizer")
            if isinstance(tokenizer, str):
                options = {**self.boot_options, "tokenizer": resolved_path(tokenizer)}
                object.__setattr__(self, "boot_options", options)
        for name in ("pack", "prepend_bos", "drop_bos", "drop_padding"):
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not self.pack and self.separator != "bos":
            raise UserError(
                f"separator={self.separator!r} (--separator) joins documents inside a packed "
                f"context, but pack=False (--no-pack) starts each document in its own context, "
                f"so it would be ignored; drop it, or pack the documents"
            )
        object.__setattr__(
            self,
            "dictionaries",
            tuple(_dictionary_entry(d, i) for i, d in enumerate(self.dictionaries)),
        )
        for name in ("context_size", "batch_size"):
            _positive(name, getattr(self, name))
        if self.shard_contexts is not None:
            _positive("shard_contexts", self.shard_contexts)
            if self.shard_contexts % self.batch_size:
                raise UserError(
                    f"shard_contexts={self.shard_contexts} must be a multiple of "
                    f"batch_size={self.batch_size}: a batch never spans two shards, so every "
                    f"shard computes the same way whichever process runs it"
                )
        if self.max_tokens is not None:
            _positive("max_tokens", self.max_tokens)
        if self.input_format not in (None, "text", "jsonl", "datasets"):
            raise UserError(
                f"input_format must be 'text', 'jsonl' or 'datasets', got {self.input_format!r}"
            )
        if self.separator not in ("bos", "eos", "none"):
            raise UserError(f"separator must be 'bos', 'eos' or 'none', got {self.separator!r}")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise UserError(f"dtype must be one of {list(_DTYPES)} or None, got {self.dtype!r}")
        if self.context_size < 2 and self.prepend_bos:
            raise UserError("context_size must be at least 2 with prepend_bos (BOS plus a token)")
        try:
            json.dumps(self.to_json())
        except TypeError as error:
            raise UserError(
                f"boot_options and intervene must be JSON values (they are recorded in the "
                f"store's manifest): {error}"
            ) from None

    def to_json(self) -> dict[str, Any]:
        """The config as JSON values (hooks as a list)."""
        data = asdict(self)
        data["hooks"] = list(self.hooks)
        data["dictionaries"] = [dict(d) for d in self.dictionaries]
        return data


_DICTIONARY_KEYS = ("path", "hook_name", "output_hook_name", "top_k", "use_error_term")


def _checked_names(config: CaptureConfig) -> None:
    """Refuse a model, driver, hook, input or text field that is not a name."""
    if not isinstance(config.model, (str, os.PathLike)) or not os.fspath(config.model):
        raise UserError(
            f"model must be a folder, .gguf file, hub id or native preset, got {config.model!r}"
        )
    if not isinstance(config.driver, str) or not config.driver:
        raise UserError(f"driver must be a driver name from `tl drivers`, got {config.driver!r}")
    odd = [h for h in config.hooks if not isinstance(h, str) or not h]
    if odd:
        raise UserError(
            f"hooks must be hook names (strings), got {odd[0]!r} in {list(config.hooks)!r}"
        )
    if not isinstance(config.input, (str, os.PathLike)) or not os.fspath(config.input):
        raise UserError(f"input must be a file or folder path, got {config.input!r}")
    if not isinstance(config.text_field, str) or not config.text_field:
        raise UserError(
            f"text_field must be the name of the records' text field, got {config.text_field!r}"
        )
    if not isinstance(config.boot_options, Mapping):
        raise UserError(
            f"boot_options must be a mapping of option name to value, got "
            f"{type(config.boot_options).__name__}: {config.boot_options!r}"
        )


def _dictionary_entry(entry: object, index: int) -> dict[str, Any]:
    """One ``dictionaries`` entry, checked, its path absolute and ``use_error_term`` set."""
    if not isinstance(entry, Mapping) or "path" not in entry:
        raise UserError(
            f"dictionaries[{index}] must be a mapping with a 'path' (a sae-lens folder), got {entry!r}"
        )
    unknown = sorted(set(entry) - set(_DICTIONARY_KEYS))
    if unknown:
        raise UserError(
            f"dictionaries[{index}] has unknown keys {unknown}; its keys are {', '.join(_DICTIONARY_KEYS)}"
        )
    out = dict(entry)
    out["path"] = str(Path(str(entry["path"])).expanduser().resolve())
    out.setdefault("use_error_term", True)
    top_k = out.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise UserError(
            f"dictionaries[{index}]['top_k'] (--sae-top-k) must be an int >= 1: the features "
            f"per token that hook_sae_top_indices keeps, got {top_k!r}"
        )
    if not isinstance(out["use_error_term"], bool):
        raise UserError(
            f"dictionaries[{index}]['use_error_term'] must be True or False, got "
            f"{out['use_error_term']!r}"
        )
    for key in ("hook_name", "output_hook_name"):
        if key in out and out[key] is not None and (not isinstance(out[key], str) or not out[key]):
            raise UserError(f"dictionaries[{index}][{key!r}] must be a hook name, got {out[key]!r}")
    return out


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{name} must be an int >= 1, got {value!r}")


def fingerprint(identity: Mapping[str, Any]) -> str:
    """A short stable hash of a JSON mapping (the store's identity)."""
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
