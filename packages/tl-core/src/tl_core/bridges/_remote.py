"""``RemoteBridge``: the bridge API over engines that run elsewhere and return captures.

Captured tensors replay through local ``HookPoint``s after the engine returns, so code
that reads activations through hooks or a cache works unchanged. Values cannot be changed
after the fact: a hook that tries is an error that points to ``intervene=``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from tl_core._errors import RemoteHookMutationError, UnsupportedFeatureError
from tl_core.bridges._base import Bridge
from tl_core.bridges._stopping import reached
from tl_core.driver_api._request import ForwardRequest, ForwardResult
from tl_core.hooks._hook_point import HookPoint

__all__ = ["RemoteBridge"]


class RemoteBridge(Bridge):
    """The bridge API for serving engines (``vllm``, ``inspect``).

    The same ``forward``, ``loss``, ``run_with_cache`` and ``generate`` as
    ``TransformerBridge``; what an engine cannot do (start from a residual stream,
    gradients) is refused before it runs. ``stop_at_layer`` returns the residual stream
    entering that block, as on local drivers, though the engine runs the whole model.
    """

    kind = "remote"

    def __init__(self, driver: Any) -> None:
        self._adopt(driver)
        self._points = {n: HookPoint(n) for n in self.namespace.ordered}

    @classmethod
    def boot_vllm(cls, model: Any, **options: Any) -> RemoteBridge:
        """A vLLM engine (needs ``pip install tl-driver-vllm``).

        Args:
            model: A checkpoint folder, a hub id, or a GGUF file (dequantised once into a
                cached folder; extra ``tl-driver-vllm[gguf]``).
            **options: The vllm driver's boot options (see ``tl_driver_vllm.VLLMDriver.boot``).
        """
        return cls.boot(model, driver="vllm", **options)

    @classmethod
    def boot_inspect(cls, model: Any, **options: Any) -> RemoteBridge:
        """An inspect_ai model provider (needs ``pip install tl-driver-inspect``)."""
        return cls.boot(model, driver="inspect", **options)

    @property
    def hook_dict(self) -> dict[str, HookPoint]:
        """Canonical hook name -> replay HookPoint, for every hook the engine serves (the
        sites of dictionaries attached since boot included)."""
        served = self.namespace.ordered
        if len(served) != len(self._points) or any(n not in self._points for n in served):
            self._points = {n: self._points.get(n) or HookPoint(n) for n in served}
        return dict(self._points)

    def _execute(self, request: ForwardRequest) -> ForwardResult:
        if request.start_at_layer is not None or request.residual is not None:
            raise UnsupportedFeatureError(
                f"driver {self._name!r} runs the model inside an engine, which starts from "
                f"token ids, not from a residual stream (start_at_layer/residual); use a "
                f"local driver (native, hf) to run part of a model"
            )
        stop = request.stop_at_layer
        stop_hook = None if stop is None else self._stop_hook(stop)
        logits_wanted = request.logits != "none" and stop_hook is None
        if logits_wanted and not self.driver.provides_sequence_logits:
            raise UnsupportedFeatureError(
                f"driver {self._name!r} does not return logits at every position, so it "
                f"cannot compute a loss or return sequence logits"
            )
        # Points are in forward order, so the replay fires hooks in that order too.
        hooked = [n for n, p in self.hook_dict.items() if p.has_hooks]
        if stop is not None:
            hooked = [n for n in hooked if reached(n, stop, self.namespace.dictionaries)]
        capture = request.capture
        names = tuple(dict.fromkeys([*capture, *hooked, *([stop_hook] if stop_hook else [])]))
        engine_request = replace(
            request,
            capture=names,
            logits=request.logits if logits_wanted else "none",
            stop_at_layer=None,
            capture_device=None,
        )
        result = self.driver.run(engine_request)
        self._replay(result.captured, hooked)
        captured = {n: result.captured[n] for n in capture}
        if request.capture_device is not None:
            captured = {n: t.to(request.capture_device) for n, t in captured.items()}
        logits = result.captured[stop_hook] if stop_hook is not None else result.logits
        return ForwardResult(logits, captured, result.new_tokens, result.raw_output, result.lengths)

    def _stop_hook(self, stop: int) -> str:
        """The hook holding the residual stream that enters block ``stop`` (``0..n_layers``)."""
        info = self.driver.info
        if stop < info.n_layers:
            name = f"blocks.{stop}.hook_in"
        elif info.normalization_type in ("LN", "RMS"):
            name = "ln_final.hook_in"
        else:
            name = f"blocks.{info.n_layers - 1}.hook_out"
        return self.namespace.lookup(name)

    def _replay(self, captured: Mapping[str, torch.Tensor], hooked: Sequence[str]) -> None:
        for name in hooked:
            value = captured[name]
            before = value.clone()
            out = self._points[name](value)
            returned_new = out is not value and not torch.equal(out, before)
            if returned_new or not torch.equal(before, value):
                raise RemoteHookMutationError(
                    f"a hook on {name!r} changed the value, but driver {self._name!r} already "
                    f"computed this forward pass in its engine, so the change would be lost. "
                    f"Hooks on remote drivers are read-only; to edit activations pass "
                    f"intervene={{{name!r}: {{'op': 'set', 'value': ...}}}} (ops: suppress, "
                    f"scale, add, set)."
                )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Same as ``forward`` (a RemoteBridge is not an ``nn.Module``)."""
        return self.forward(*args, **kwargs)
