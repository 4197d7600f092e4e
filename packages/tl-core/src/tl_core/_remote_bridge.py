"""``RemoteBridge``: the bridge API over engines that run elsewhere and return captures.

Captured tensors replay through local ``HookPoint``s after the engine returns, so code
that reads activations through hooks or a cache works unchanged. Values cannot be changed
after the fact: a hook that tries is an error that points to ``intervene=``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from tl_core._aliases import canonical_name, suggest_names
from tl_core._bridge_common import BridgeCommon, ModelInput, NamesFilter, next_token_loss
from tl_core._cache import ActivationCache
from tl_core._driver import ForwardResult, validate_driver
from tl_core._errors import (
    HookNameError,
    RemoteHookMutationError,
    UnsupportedFeatureError,
    UserError,
)
from tl_core._hook_point import HookHandle, HookPoint
from tl_core._model_info import ModelInfo
from tl_core._order import forward_order
from tl_core._tokenizer import Tokenizer

__all__ = ["RemoteBridge"]

ReturnType = Literal["logits", "loss", "both"] | None


class RemoteBridge(BridgeCommon):
    """The bridge API for serving engines (``vllm``, ``inspect``).

    The driver must also expose ``tokenizer`` and ``info`` (a ``ModelInfo``); ``readout()``
    is optional (it enables ``logit_attrs`` on caches).
    """

    def __init__(self, driver: Any) -> None:
        validate_driver(driver, name=getattr(driver, "name", None))
        self.driver = driver
        self._points = {n: HookPoint(n) for n in forward_order(driver.supported_hook_points)}
        self._permanent: list[HookHandle] = []

    @classmethod
    def boot(cls, model: Any = None, *, driver: str, **options: Any) -> RemoteBridge:
        """Boot a remote driver found through the ``tl_core.drivers`` entry points."""
        from tl_core._boot import boot

        bridge = boot(model, driver=driver, **options)
        if not isinstance(bridge, RemoteBridge):
            raise UserError(f"driver {driver!r} runs locally; use TransformerBridge.boot(...)")
        return bridge

    @classmethod
    def boot_vllm(cls, model: Any, **options: Any) -> RemoteBridge:
        """A vLLM engine (needs ``pip install tl-driver-vllm``)."""
        return cls.boot(model, driver="vllm", **options)

    @classmethod
    def boot_inspect(cls, model: Any, **options: Any) -> RemoteBridge:
        """An inspect_ai model provider (needs ``pip install tl-driver-inspect``)."""
        return cls.boot(model, driver="inspect", **options)

    # -- facts ------------------------------------------------------------------------

    @property
    def cfg(self) -> ModelInfo:
        """Sizes and structure of the served model."""
        return self.driver.info  # type: ignore[no-any-return]

    @property
    def tokenizer(self) -> Tokenizer:
        """The engine's tokenizer."""
        return self.driver.tokenizer  # type: ignore[no-any-return]

    @property
    def hook_dict(self) -> dict[str, HookPoint]:
        """Canonical hook name -> replay HookPoint, for every hook the engine serves."""
        return dict(self._points)

    def _resolve_hook(self, name: str) -> str:
        canonical = canonical_name(name)
        if canonical in self._points:
            return canonical
        if canonical in self.driver.non_fireable_hook_points:
            reasons: Mapping[str, str] = getattr(self.driver, "non_fireable_reasons", {})
            why = reasons.get(canonical, "the engine does not compute it as a separate tensor")
            shown = repr(name) if name == canonical else f"{name!r} ({canonical!r})"
            raise HookNameError(f"driver {self._name!r} cannot serve {shown}: {why}")
        close = suggest_names(canonical, self._points)
        hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise HookNameError(f"driver {self._name!r} does not serve hook {name!r}.{hint}")

    @property
    def _name(self) -> str:
        return str(getattr(self.driver, "name", type(self.driver).__name__))

    def add_hook(
        self,
        name: Any,
        hook: Any,
        dir: Literal["fwd", "bwd"] = "fwd",
        *,
        is_permanent: bool = False,
    ) -> list[HookHandle]:
        """Attach a read-only hook (backward hooks only where the engine has gradients)."""
        if dir == "bwd" and not self.driver.supports("gradients"):
            raise UnsupportedFeatureError(
                f"driver {self._name!r} has no gradients, so backward hooks cannot fire; "
                f"use a local driver (native, hf) for gradient work"
            )
        return super().add_hook(name, hook, dir, is_permanent=is_permanent)

    # -- running ----------------------------------------------------------------------

    def _run(
        self,
        input: ModelInput,
        *,
        capture: Sequence[str],
        intervene: Any,
        prepend_bos: bool,
        need_logits: bool,
        max_new_tokens: int = 0,
        **kwargs: Any,
    ) -> tuple[ForwardResult, Any]:
        if need_logits and not self.driver.provides_sequence_logits:
            raise UnsupportedFeatureError(
                f"driver {self._name!r} does not return logits at every position, so it "
                f"cannot compute a loss or return sequence logits"
            )
        batch = self._token_batch(input, prepend_bos=prepend_bos)
        hooked = [n for n, p in self._points.items() if p.has_hooks]
        names = list(dict.fromkeys([*capture, *hooked]))
        result = self.driver.forward(
            batch.rows(),
            capture=names,
            intervene=intervene,
            max_new_tokens=max_new_tokens,
            return_logits=need_logits,
            **kwargs,
        )
        self._replay(result.captured, hooked)
        return result, batch

    def _replay(self, captured: Mapping[str, torch.Tensor], hooked: Sequence[str]) -> None:
        for name in forward_order(hooked):
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

    def forward(
        self,
        input: ModelInput,
        return_type: ReturnType = "logits",
        *,
        intervene: Any = None,
        prepend_bos: bool = True,
        loss_per_token: bool = False,
    ) -> Any:
        """Run prompts in the engine; see ``TransformerBridge.forward``."""
        result, batch = self._run(
            input,
            capture=(),
            intervene=intervene,
            prepend_bos=prepend_bos,
            need_logits=return_type is not None,
        )
        return self._output(result, batch, return_type, loss_per_token)

    __call__ = forward

    def _output(self, result: ForwardResult, batch: Any, return_type: ReturnType, per_token: bool = False) -> Any:
        if return_type is None:
            return None
        if return_type == "logits":
            return result.logits
        loss = next_token_loss(result.logits, batch.ids, batch.lengths, per_token=per_token)  # type: ignore[arg-type]
        return loss if return_type == "loss" else (result.logits, loss)

    def loss(self, input: ModelInput, *, per_token: bool = False, intervene: Any = None) -> torch.Tensor:
        """Mean next-token loss (needs a driver with sequence logits)."""
        return self.forward(input, "loss", intervene=intervene, loss_per_token=per_token)  # type: ignore[no-any-return]

    def run_with_cache(
        self,
        input: ModelInput,
        *,
        names_filter: NamesFilter = None,
        device: torch.device | str | None = None,
        remove_batch_dim: bool = False,
        intervene: Any = None,
        return_type: ReturnType = "logits",
        prepend_bos: bool = True,
    ) -> tuple[Any, ActivationCache]:
        """Run in the engine and cache the selected hooks (see ``TransformerBridge``)."""
        names = self.select_hooks(names_filter)
        result, batch = self._run(
            input,
            capture=names,
            intervene=intervene,
            prepend_bos=prepend_bos,
            need_logits=return_type is not None,
        )
        captured = {n: result.captured[n] for n in names}
        if device is not None:
            captured = {n: t.to(device) for n, t in captured.items()}
        # Fetched from the engine only when an analysis method needs it.
        readout = getattr(self.driver, "readout", None)
        cache = ActivationCache(captured, info=self.cfg, readout=readout, lengths=batch.lengths)
        out = self._output(result, batch, return_type)
        return out, (cache.remove_batch_dim() if remove_batch_dim else cache)

    def generate(
        self,
        input: ModelInput,
        max_new_tokens: int = 10,
        *,
        intervene: Any = None,
        prepend_bos: bool = True,
        return_type: Literal["str", "tokens"] | None = None,
        **sampling: Any,
    ) -> str | list[str] | torch.Tensor:
        """Generate in the engine with specs active (steering)."""
        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        result, _ = self._run(
            input,
            capture=(),
            intervene=intervene,
            prepend_bos=prepend_bos,
            need_logits=False,
            max_new_tokens=max_new_tokens,
            **sampling,
        )
        assert result.new_tokens is not None
        return self._generated(input, result.new_tokens, return_type)

    def close(self) -> None:
        """Shut the engine down."""
        self.driver.close()

    def __enter__(self) -> RemoteBridge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
