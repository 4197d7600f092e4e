"""Sparse dictionaries across the process boundary: sent to the workers once, at attach time.

The driver packs an ``Attachment`` (the dictionary's tensors and settings, where it sits) as
plain data; every worker rebuilds it on its own device and keeps it until it is detached,
and each run's ``RunState`` runs it inside the forward pass (``tl_core.driver_api.DictionaryRun``), on
every row of the step, so it is batched across requests.

Under tensor parallelism every rank holds the whole dictionary and runs it on the whole
value (replicated): dictionaries sit on ``d_model``-wide sites (the residual stream,
attention and MLP outputs, norm outputs), which every rank holds whole. Head- and
neuron-level sites are split across ranks, so a dictionary there needs one rank.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from tl_core import UnsupportedFeatureError
from tl_core.driver_api import Attachment, HookNamespace, Linear
from tl_core.sae import DictionarySite, SparseDictionary
from tl_driver_vllm._wire import pack, unpack

__all__ = ["check_replicated", "pack_attachment", "release_retired_handles", "unpack_attachment"]

#: oneDNN matmul handles whose dictionary is gone, freed at the next attach or detach. vLLM's
#: handle frees itself by reading a tensor, which raises when garbage collection happens to
#: collect it while torch.compile traces the model with fake tensors (a later engine's boot).
_RETIRED: list[Any] = []

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
    settings = {f.name: getattr(d, f.name) for f in dataclasses.fields(d) if f.name not in _TENSORS}
    tensors = {name: pack(t, raw=raw) for name in _TENSORS if (t := getattr(d, name)) is not None}
    return {
        "site": dataclasses.asdict(attachment.site),
        "use_error_term": attachment.use_error_term,
        "settings": settings,
        "tensors": tensors,
    }


def unpack_attachment(payload: dict[str, Any], device: torch.device) -> Attachment:
    """The attachment ``pack_attachment`` packed, its tensors on ``device``, its two
    matrices multiplied by the engine's own kernels where it has faster ones."""
    tensors: dict[str, Any] = {
        name: unpack(value).to(device) for name, value in payload["tensors"].items()
    }
    dictionary = SparseDictionary(**tensors, **payload["settings"])
    encoder, decoder = engine_linears(dictionary)
    return Attachment(
        dictionary,
        DictionarySite(**payload["site"]),
        bool(payload["use_error_term"]),
        encoder,
        decoder,
    )


def engine_linears(dictionary: SparseDictionary) -> tuple[Linear, Linear]:
    """vLLM's CPU GEMM (oneDNN, weight prepacked once) for the encoder and decoder, as its
    own linear layers use: about twice torch's speed on this machine's CPU (SmolLM2's
    16x SAE, 4096 tokens: 160 ms against 300 ms for the encoder). ``(None, None)`` on
    GPUs (torch's matmul is the engine's there) and where vLLM lacks it."""
    if dictionary.W_enc.device.type != "cpu" or dictionary.dtype != torch.float32:
        return None, None
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return None, None
    if not getattr(ops, "_supports_onednn", False) or not hasattr(ops, "create_onednn_mm"):
        return None, None
    release_retired_handles()
    enc = ops.create_onednn_mm(dictionary.W_enc, 32)
    dec = ops.create_onednn_mm(dictionary.W_dec, 32)
    b_enc, b_dec = dictionary.b_enc, dictionary.b_dec

    def encoder(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        return ops.onednn_mm(enc, flat, b_enc).view(*x.shape[:-1], -1)  # type: ignore[no-any-return]

    def decoder(acts: torch.Tensor) -> torch.Tensor:
        flat = acts.reshape(-1, acts.shape[-1]).contiguous()
        return ops.onednn_mm(dec, flat, b_dec).view(*acts.shape[:-1], -1)  # type: ignore[no-any-return]

    # The finalizers hold the handles past their functions' end, then retire them.
    weakref.finalize(encoder, _RETIRED.append, enc)
    weakref.finalize(decoder, _RETIRED.append, dec)
    return encoder, decoder


def release_retired_handles() -> None:
    """Free the oneDNN handles of dictionaries no longer used (call outside any forward)."""
    while _RETIRED:
        _RETIRED.pop()
