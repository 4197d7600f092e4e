"""What the hf driver's drivers of whole models share: an encoder-decoder's and a pixel or
audio model's (``Seq2SeqDriver``, ``SignalDriver``).

Such a model is booted whole, as the class its config names; every site is a torch hook on
one of its modules' inputs or outputs, installed only for the forward that needs it; every
check runs at boot, and a site that fails one is not served.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tl_core import HookPoint, UnsupportedFeatureError, UserError
from tl_core.certification import Certification
from tl_core.driver_api import LocalDriver, ModelInfo, Tokenizer
from tl_driver_hf._options import BootOptions
from tl_driver_hf._runtime._torch_hooks import (
    HeadView,
    _heads_hook,
    _input_hook,
    _input_of,
    _output_hook,
    _viewed_input_hook,
    _with_input,
)

__all__ = ["Site", "SiteKind", "WholeModelDriver", "plain_add", "refuse_unserved_options"]


#: A module's input or output, per head (``heads_*``), or the last element of the tuple it
#: returns (``weights``: the attention probabilities an eager attention module hands out).
SiteKind = Literal["in", "out", "heads_in", "heads_out", "weights"]


@dataclass(frozen=True)
class Site:
    """One canonical site: a module's input or output, per head where ``kind`` says so."""

    module: nn.Module
    kind: SiteKind


def _weights_hook(point: HookPoint) -> Any:
    """Read the attention probabilities an eager attention module returns last (read-only:
    the module has used them already)."""

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        weights = output[-1] if isinstance(output, tuple) else None
        if isinstance(weights, torch.Tensor):
            point(weights)

    return hook


class WholeModelDriver(LocalDriver):
    """A transformers model booted whole and certified at boot (see the module doc).

    Subclasses set ``_info`` and ``_tokenizer``, fill ``_sites`` (canonical name -> the
    module input or output it reads) and ``_points`` (a ``HookPoint`` per site), and run the
    model inside ``_wired()``.
    """

    _info: ModelInfo
    _tokenizer: Tokenizer
    _sites: dict[str, Site]

    name = "hf"

    def __init__(self, model: nn.Module, *, name: str = "") -> None:
        self._model_name = name or type(model).__name__
        self._hf_model = model
        self._points: dict[str, HookPoint] = {}
        self._refused: dict[str, str] = {}
        self._certification: Certification | None = None

    @property
    def module(self) -> nn.Module:
        """The transformers model."""
        return self._hf_model

    @property
    def hf_model(self) -> nn.Module:
        """The transformers model."""
        return self._hf_model

    @property
    def info(self) -> ModelInfo:
        """The model's sizes (an encoder-decoder's ``n_layers`` is its decoder's, and
        ``encoder_layers`` its encoder's; a pixel or audio model's ``d_vocab`` is its
        logits' width)."""
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        """The checkpoint's tokenizer (for a model that reads no text, one that decodes
        output ids to label names)."""
        return self._tokenizer

    @property
    def masks_padding(self) -> bool:
        """Padding never reaches a real position: an encoder's ragged batch is masked, and
        a pixel or audio batch has none."""
        return True

    @property
    def hook_points(self) -> Mapping[str, HookPoint]:
        """Canonical name -> HookPoint of every served site."""
        return self._served(self._points)

    @property
    def certification(self) -> Certification | None:
        """The certification report of the boot."""
        return self._certification

    @property
    def absent_reasons(self) -> Mapping[str, str]:
        """Sites certification refused, and sites this driver does not serve yet."""
        return self._refused

    @property
    def candidate_points(self) -> dict[str, HookPoint]:
        """Every site served now (before certification: every one the model offers)."""
        return dict(self._points)

    def certify(self) -> Certification:
        """The certification report (``tl certify``): every check already runs at boot.

        Raises:
            UnsupportedFeatureError: The driver was built without certifying (not by
                ``HFDriver.boot``).
        """
        if self._certification is None:
            raise UnsupportedFeatureError(
                "this driver was built without certification; boot it with HFDriver.boot, "
                "which certifies every site it serves"
            )
        return self._certification

    def set_certification(self, certification: Certification) -> None:
        """Keep the boot's certification report (certification served its verdict)."""
        self._certification = certification

    def serve(self, names: Mapping[str, str]) -> None:
        """Stop serving ``names`` (name -> why), as certification decided."""
        self._refused.update(names)
        self._points = {n: p for n, p in self._points.items() if n not in names}
        self.__dict__.pop("_namespace", None)
        self.__dict__.pop("_served_points", None)

    @contextmanager
    def _wired(self) -> Iterator[None]:
        """Torch hooks for the sites with something attached, for one forward."""
        handles: list[RemovableHandle] = []
        view = HeadView("flat", self._info.n_heads)
        for name, point in self._points.items():
            if not point.has_hooks:
                continue
            site = self._sites[name]
            if site.kind == "in":
                handles.append(
                    site.module.register_forward_pre_hook(_input_hook(point), with_kwargs=True)
                )
            elif site.kind == "out":
                handles.append(site.module.register_forward_hook(_output_hook(point)))
            elif site.kind == "weights":
                handles.append(site.module.register_forward_hook(_weights_hook(point)))
            elif site.kind == "heads_out":
                hook = _heads_hook(point, self._info.n_heads, self._info.d_head)
                handles.append(site.module.register_forward_hook(hook))
            else:
                handles.append(
                    site.module.register_forward_pre_hook(
                        _viewed_input_hook(point, view), with_kwargs=True
                    )
                )
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


@contextmanager
def plain_add(module: nn.Module, delta: torch.Tensor, *, at_input: bool) -> Iterator[None]:
    """Add ``delta`` to ``module``'s input (``at_input``) or output with a plain torch hook:
    the reference a certification's edit check compares tl's ``add`` with."""

    def add_in(m: nn.Module, a: tuple[Any, ...], k: dict[str, Any]) -> Any:
        return _with_input(a, k, _input_of(a, k) + delta)

    def add_out(m: nn.Module, a: tuple[Any, ...], out: Any) -> Any:
        return (out[0] + delta, *out[1:]) if isinstance(out, tuple) else out + delta

    handle = (
        module.register_forward_pre_hook(add_in, with_kwargs=True)
        if at_input
        else module.register_forward_hook(add_out)
    )
    try:
        yield
    finally:
        handle.remove()


def refuse_unserved_options(opts: BootOptions, kind: str, **more: bool) -> None:
    """Refuse boot options a whole model's driver does not serve, before any weight loads.

    Args:
        opts: The parsed options.
        kind: What the model is, plural, for the message (``"encoder-decoders"``).
        **more: Further options refused for this kind: their text -> whether given.

    Raises:
        UserError: Naming every such option given.
    """
    unsupported = {
        "load_weights=False": not opts.load_weights,
        "use_attn_result=True": opts.use_attn_result,
        "n_devices": opts.n_devices is not None,
        "n_ctx": opts.n_ctx is not None,
        "certify=False": not opts.certify,
        "a GGUF file": opts.gguf_path is not None,
        **more,
    }
    named = [k for k, v in unsupported.items() if v]
    if named:
        raise UserError(
            f"{', '.join(named)}: not served on {kind} yet (tl boots them whole and certifies "
            "every site it serves); drop the option"
        )
