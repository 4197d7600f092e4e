"""``TransformerBridge``: the researcher-facing ``nn.Module`` over a local driver."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from tl_core._bridge_common import BridgeCommon, HookSpec, ModelInput, NamesFilter, next_token_loss
from tl_core._cache import ActivationCache
from tl_core._driver import validate_driver
from tl_core._errors import UnsupportedFeatureError, UserError
from tl_core._hook_point import HookHandle, HookPoint
from tl_core._local_driver import LocalDriver
from tl_core._model_info import ModelInfo
from tl_core._tokenizer import Tokenizer

__all__ = ["TransformerBridge"]

ReturnType = Literal["logits", "loss", "both"] | None


class TransformerBridge(nn.Module, BridgeCommon):
    """A model with named hook points, gradients and the TransformerLens-style API.

    Build one with ``TransformerBridge.boot_native(config)``,
    ``TransformerBridge.boot_transformers(model_name, ...)`` or ``tl_core.boot(...)``.
    Every hook name argument accepts canonical names and aliases.
    """

    def __init__(self, driver: LocalDriver) -> None:
        super().__init__()
        validate_driver(driver, name=getattr(driver, "name", None))
        self.driver = driver
        self.model = driver.module
        self._permanent: list[HookHandle] = []

    # -- construction -----------------------------------------------------------------

    @classmethod
    def boot(cls, model: Any = None, *, driver: str, **options: Any) -> TransformerBridge:
        """Boot a local driver found through the ``tl_core.drivers`` entry points."""
        from tl_core._boot import boot

        bridge = boot(model, driver=driver, **options)
        if not isinstance(bridge, TransformerBridge):
            raise UserError(
                f"driver {driver!r} is a remote engine; use RemoteBridge.boot_{driver}(...)"
            )
        return bridge

    @classmethod
    def boot_native(cls, config: Any = None, **overrides: Any) -> TransformerBridge:
        """A small random transformer in plain torch (see ``tl_core.native.NativeConfig``).

        Args:
            config: A ``NativeConfig``, a dict of TransformerLens-style keys, a preset name
                (``"gpt2"`` or ``"llama"``), or ``None`` for the GPT-2-style default.
            **overrides: Config fields to change.
        """
        return cls.boot(config, driver="native", **overrides)

    @classmethod
    def boot_transformers(cls, model_name: Any = None, **options: Any) -> TransformerBridge:
        """A HuggingFace transformers model (needs ``pip install tl-driver-hf``)."""
        return cls.boot(model_name, driver="hf", **options)

    # -- facts ------------------------------------------------------------------------

    @property
    def cfg(self) -> ModelInfo:
        """Sizes and structure of the model."""
        return self.driver.info

    @property
    def tokenizer(self) -> Tokenizer:
        """The driver's tokenizer."""
        return self.driver.tokenizer

    @property
    def hook_dict(self) -> dict[str, HookPoint]:
        """Canonical hook name -> HookPoint."""
        return dict(self.driver.hook_points)

    def _resolve_hook(self, name: str) -> str:
        return self.driver.resolve_hook(name)

    def __getattr__(self, name: str) -> Any:
        # Weight accessors (W_Q, W_U, ...) and sub-modules (blocks, embed) live on the
        # driver's module; reach them through the bridge as TransformerLens users expect.
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self._modules.get("model")
            if model is not None and not name.startswith("_"):
                return getattr(model, name)
            raise

    # -- running ----------------------------------------------------------------------

    def forward(
        self,
        input: ModelInput | None = None,
        return_type: ReturnType = "logits",
        *,
        intervene: Any = None,
        prepend_bos: bool = True,
        loss_per_token: bool = False,
        start_at_layer: int | None = None,
        stop_at_layer: int | None = None,
        residual: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
    ) -> Any:
        """Run the model.

        Args:
            input: Text, texts or token ids. Ragged batches are right-padded; padding never
                reaches the loss.
            return_type: ``"logits"``, ``"loss"``, ``"both"`` (a ``(logits, loss)`` pair)
                or ``None``.
            intervene: Specs (and callables) per hook, see ``tl_core.InterventionSpec``.
            prepend_bos: Put the BOS token before text input.
            loss_per_token: Return per-position losses.
            start_at_layer: Start at this block; pass its input as ``residual`` (``input``
                still supplies the token ids for the loss).
            stop_at_layer: Stop before this block and return the residual stream.
            residual: The residual stream entering ``start_at_layer``.
            tokens: Token ids for the loss when ``input`` is ``None`` (with ``residual``).

        Returns:
            Logits ``[batch, pos, d_vocab]``, the loss, both, the residual stream when
            ``stop_at_layer`` is set, or ``None``.
        """
        if return_type not in ("logits", "loss", "both", None):
            raise UserError(f"return_type must be 'logits', 'loss', 'both' or None, got {return_type!r}")
        if input is None and tokens is None and residual is None:
            raise UserError("forward needs input (text or ids), or residual with start_at_layer")
        if residual is not None and start_at_layer is None:
            raise UserError("residual is the input of a block: also pass start_at_layer")
        source = input if input is not None else tokens
        if source is None:
            batch_ids = torch.zeros(residual.shape[:2], dtype=torch.long)  # type: ignore[union-attr]
            batch = self.driver.batch(batch_ids)
        else:
            batch = self._token_batch(source, prepend_bos=prepend_bos)
        result = self.driver.forward(
            batch.ids if not batch.is_ragged else batch.rows(),
            intervene=intervene,
            max_new_tokens=0,
            start_at_layer=start_at_layer,
            stop_at_layer=stop_at_layer,
            residual=residual,
        )
        out = result.logits
        if stop_at_layer is not None or return_type == "logits":
            return out
        if return_type is None:
            return None
        if source is None:
            raise UserError("a loss needs the token ids: pass input or tokens")
        loss = next_token_loss(out, batch.ids, batch.lengths, per_token=loss_per_token)  # type: ignore[arg-type]
        return loss if return_type == "loss" else (out, loss)

    def loss(
        self,
        input: ModelInput,
        *,
        per_token: bool = False,
        intervene: Any = None,
        prepend_bos: bool = True,
    ) -> torch.Tensor:
        """Mean next-token cross-entropy over real positions (or per position)."""
        return self.forward(  # type: ignore[no-any-return]
            input, "loss", intervene=intervene, prepend_bos=prepend_bos, loss_per_token=per_token
        )

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
        stop_at_layer: int | None = None,
        incl_bwd: bool = False,
    ) -> tuple[Any, ActivationCache]:
        """Run and cache activations.

        Args:
            input: Text, texts or ids; ragged batches are right-padded and the cache keeps
                each prompt's length (``cache.lengths``; ``cache.prompt(i)`` trims).
            names_filter: ``None`` for every hook, a name, a list of names (aliases ok), or
                a predicate over canonical names.
            device: Where cached tensors go (default: where they were computed).
            remove_batch_dim: Drop the batch axis (batch of one only).
            intervene: Specs applied during the run; the cache holds edited values.
            return_type: As in ``forward``.
            prepend_bos: Put BOS before text input.
            stop_at_layer: Stop before this block (the first output is the residual).
            incl_bwd: Also cache gradients: computes the loss, calls ``backward()`` and
                stores each selected hook's gradient in ``cache.grads``.

        Returns:
            ``(output, cache)``.
        """
        names = self.select_hooks(names_filter)
        batch = self._token_batch(input, prepend_bos=prepend_bos)
        ids: Any = batch.ids if not batch.is_ragged else batch.rows()
        grads: dict[str, torch.Tensor] = {}
        bwd: list[HookSpec] = []
        if incl_bwd:
            if stop_at_layer is not None:
                raise UserError("incl_bwd needs the loss, which stop_at_layer skips")
            bwd = [(n, _GradCapture(grads, n, device)) for n in names]
        with self.hooks((), bwd):
            result = self.driver.forward(
                ids,
                capture=names,
                intervene=intervene,
                max_new_tokens=0,
                capture_device=device,
                stop_at_layer=stop_at_layer,
            )
            out: Any = result.logits
            if incl_bwd:
                loss = next_token_loss(out, batch.ids, batch.lengths)
                loss.backward()  # type: ignore[no-untyped-call]
                out = {"logits": out, "loss": loss, "both": (out, loss)}[return_type or "loss"]
            elif stop_at_layer is None and return_type in ("loss", "both"):
                loss = next_token_loss(out, batch.ids, batch.lengths)
                out = loss if return_type == "loss" else (out, loss)
            elif return_type is None:
                out = None
        cache = ActivationCache(
            result.captured, info=self.cfg, readout=self.driver.readout, lengths=batch.lengths
        )
        if incl_bwd:
            cache.grads = ActivationCache(grads, info=self.cfg, lengths=batch.lengths)
        if remove_batch_dim:
            cache = cache.remove_batch_dim()
        return out, cache

    @torch.no_grad()
    def generate(
        self,
        input: ModelInput,
        max_new_tokens: int = 10,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop_at_eos: bool = True,
        intervene: Any = None,
        prepend_bos: bool = True,
        return_type: Literal["str", "tokens"] | None = None,
    ) -> str | list[str] | torch.Tensor:
        """Continue the prompt(s) with hooks (``hooks()``) and specs active at every step.

        Returns:
            Text for text input, else ``[batch, n]`` new token ids (``return_type``
            overrides). Sequences that hit EOS are padded with EOS afterwards.
        """
        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        batch = self._token_batch(input, prepend_bos=prepend_bos)
        result = self.driver.forward(
            batch.rows(),
            intervene=intervene,
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stop_at_eos=stop_at_eos,
        )
        assert result.new_tokens is not None
        return self._generated(input, result.new_tokens, return_type)

    # -- weights ----------------------------------------------------------------------

    def enable_compatibility_mode(self, **options: Any) -> TransformerBridge:
        """Fold norms and centre weights so activations match HookedTransformer's.

        Raises:
            UnsupportedFeatureError: If the driver cannot rewrite its weights.
        """
        enable = getattr(self.driver, "enable_compatibility_mode", None)
        if enable is None:
            raise UnsupportedFeatureError(
                f"driver {self.driver.name!r} does not support enable_compatibility_mode()"
            )
        enable(**options)
        return self

    def close(self) -> None:
        """Release the driver."""
        self.driver.close()

    def __repr__(self) -> str:
        info = self.cfg
        return (
            f"TransformerBridge(driver={self.driver.name!r}, arch={info.architecture!r}, "
            f"n_layers={info.n_layers}, d_model={info.d_model}, hooks={len(self.hook_dict)})"
        )


class _GradCapture:
    def __init__(self, store: dict[str, torch.Tensor], name: str, device: Any) -> None:
        self._store, self._name, self._device = store, name, device

    def __call__(self, grad: torch.Tensor, *, hook: HookPoint) -> None:
        grad = grad.detach()
        self._store[self._name] = grad.to(self._device) if self._device is not None else grad



