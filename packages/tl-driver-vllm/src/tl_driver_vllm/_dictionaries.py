"""Sparse dictionaries across the process boundary: sent to the workers once, at attach time.

The driver packs an ``Attachment`` (the dictionary's tensors and settings, where it sits) as
plain data; every worker rebuilds it on its own device and keeps it until it is detached,
and each run's ``RunState`` runs it inside the forward pass (``tl_core.sae``'s stage), on
every row of the step, so it is batched across requests.

Under tensor parallelism every rank holds the whole dictionary and runs it on the whole
value (replicated): dictionaries sit on ``d_model``-wide sites (the residual stream,
attention and MLP outputs, norm outputs), which every rank holds whole. Head- and
neuron-level sites are split across ranks, so a dictionary there needs one rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from tl_core import UnsupportedFeatureError
from tl_core.driver_api import HookNamespace
from tl_core.sae import Attachment, DictionarySite, SparseDictionary
from tl_driver_vllm._wire import pack, unpack

__all__ = ["check_replicated", "pack_attachment", "unpack_attachment"]

_TENSORS = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip")


def check_replicated(namespace: HookNamespace, site: DictionarySite, tp_size: int) -> None:
    """Refuse a dictionary on a site that tensor-parallel ranks hold in pieces.

    Raises:
        UnsupportedFeatureError: ``tp_size > 1`` and a site is not ``d_model`` wide.
    """
    if tp_size <= 1:
        return
    for hook in dict.fromkeys((site.hook, site.output_hook)):
        if namespace.layout(hook) != "b p d":
            raise UnsupportedFeatureError(
                f"a dictionary at {hook!r} cannot run under tensor parallelism ({tp_size} ranks): "
                "each rank holds only its share of that site's heads or neurons, and the vllm "
                "driver runs dictionaries whole on every rank; attach it at a d_model-wide site "
                "(the residual stream, attn.hook_out, mlp.hook_out, a norm's output) or boot "
                "with tensor_parallel_size=1"
            )


def pack_attachment(attachment: Attachment, *, raw: bool) -> dict[str, Any]:
    """An attachment as plain data for ``collective_rpc`` (tensors as ``_wire.pack`` makes them)."""
    d = attachment.dictionary
    settings = {
        f.name: getattr(d, f.name) for f in dataclasses.fields(d) if f.name not in _TENSORS
    }
    tensors = {name: pack(t, raw=raw) for name in _TENSORS if (t := getattr(d, name)) is not None}
    return {
        "site": dataclasses.asdict(attachment.site),
        "use_error_term": attachment.use_error_term,
        "settings": settings,
        "tensors": tensors,
    }


def unpack_attachment(payload: dict[str, Any], device: torch.device) -> Attachment:
    """The attachment ``pack_attachment`` packed, its tensors on ``device``."""
    tensors: dict[str, Any] = {name: unpack(value).to(device) for name, value in payload["tensors"].items()}
    dictionary = SparseDictionary(**tensors, **payload["settings"])
    return Attachment(dictionary, DictionarySite(**payload["site"]), bool(payload["use_error_term"]))
