"""Backward Lens (Katz et al. 2024): dense MLP weight gradients as rank-one terms, read as tokens.

For an MLP ``out = act(x @ W_in + b_in) @ W_out + b_out`` applied at every position, the
gradient of a loss is a sum over positions ``t`` of outer products::

    dL/dW_in  = sum_t x_t (x) delta_t     x_t = mlp.hook_in,    delta_t = dL/d mlp.hook_pre
    dL/dW_out = sum_t a_t (x) g_t         a_t = mlp.hook_post,  g_t     = dL/d mlp.hook_out

``backward_lens`` collects the four factors in one forward and one backward pass, without
touching any parameter's ``.grad``; ``BackwardLensResult`` rebuilds either gradient in the
model's own weight layout and projects the ``d_model``-sized factors (``g_t``, ``x_t``) onto
the vocabulary with the unembedding.

The weight a gradient belongs to is found by what it computes, not by the model's class:
among the parameters shaped ``(d_model, d_mlp)`` or ``(d_mlp, d_model)`` of a block, the one
(and the orientation) that maps ``mlp.hook_in`` to ``mlp.hook_pre`` (``mlp.hook_post`` to
``mlp.hook_out``) up to a constant bias at every sampled position. So GPT-2's ``Conv1D``
(``[in, out]``), ``nn.Linear`` (``[out, in]``) and the native model are told apart from the
numbers, and a block whose hooks are not the real input and output of its projections is
refused instead of decomposed wrongly.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from tl_core._errors import UnsupportedFeatureError, UserError
from tl_core.analysis._metrics import call_metric, describe_metric, non_finite
from tl_core.analysis._weight_sites import (
    WeightSite,
    candidates_of,
    module_of,
    recognise,
    wide,
)
from tl_core.bridges._loss import next_token_loss

if TYPE_CHECKING:
    from tl_core.bridges._base import ModelInput
    from tl_core.bridges._transformer import TransformerBridge

__all__ = ["BackwardLensResult", "WeightSite", "backward_lens"]

Which = Literal["in", "out"]
Factor = Literal["g", "x"]

_SITES = ("hook_in", "hook_pre", "hook_post", "hook_out")


@dataclass(frozen=True, eq=False)
class BackwardLensResult:
    """The rank-one factors of each selected block's MLP weight gradients.

    Every factor is ``[batch, pos, ...]`` over the right-padded batch, zero at padding, so
    sums over positions are sums over real tokens. Factors are detached, on the device the
    model computed them on, in the model's dtype.

    Attributes:
        layers: The blocks analysed, ascending.
        tokens: ``[batch, pos]`` token ids (right-padded).
        lengths: Real length of each prompt.
        loss: The loss that was differentiated (detached scalar).
        x: Layer -> MLP input ``mlp.hook_in``, ``[batch, pos, d_model]``.
        delta: Layer -> gradient at the pre-activation ``mlp.hook_pre``, ``[batch, pos, d_mlp]``.
        a: Layer -> MLP hidden activation ``mlp.hook_post``, ``[batch, pos, d_mlp]``.
        g: Layer -> gradient at the MLP output ``mlp.hook_out``, ``[batch, pos, d_model]``.
        sites: ``(layer, "in" | "out")`` -> the parameter holding ``W_in`` / ``W_out``.
        W_U: Unembedding ``[d_model, d_vocab]`` used by the projections (detached).
        ln_final_weight: The final norm's weight (``None``: no weight).
        normalization_type: The final norm's kind (``"LN"``, ``"RMS"`` or ``None``).
    """

    layers: tuple[int, ...]
    tokens: torch.Tensor
    lengths: tuple[int, ...]
    loss: torch.Tensor
    x: Mapping[int, torch.Tensor]
    delta: Mapping[int, torch.Tensor]
    a: Mapping[int, torch.Tensor]
    g: Mapping[int, torch.Tensor]
    sites: Mapping[tuple[int, str], WeightSite]
    W_U: torch.Tensor
    ln_final_weight: torch.Tensor | None
    normalization_type: Literal["LN", "RMS"] | None

    @property
    def mask(self) -> torch.Tensor:
        """``[batch, pos]`` bool, True at real (unpadded) positions (on the factors' device)."""
        return _real_mask(self.lengths, self.tokens.shape[1], self.g[self.layers[0]].device)

    def weight_grad(
        self, layer: int, which: Which, *, layout: Literal["model", "tl"] = "model"
    ) -> torch.Tensor:
        """The loss's gradient with respect to ``W_in`` or ``W_out``, summed from the factors.

        Args:
            layer: A block in ``layers``.
            which: ``"in"`` (``sum_t x_t (x) delta_t``) or ``"out"`` (``sum_t a_t (x) g_t``).
            layout: ``"model"``: the shape of the model's own parameter (``sites``), so the
                result compares directly with its ``.grad``; ``"tl"``: TransformerLens
                shapes, ``[d_model, d_mlp]`` for ``W_in`` and ``[d_mlp, d_model]`` for ``W_out``.

        Returns:
            The gradient, in float32 or wider.

        Raises:
            UserError: A layer that was not analysed, or an unknown ``which``/``layout``.
        """
        self._check_layer(layer)
        _check_choice("which", which, ("in", "out"))
        _check_choice("layout", layout, ("model", "tl"))
        if which == "in":
            grad = torch.einsum("bpd,bpm->dm", wide(self.x[layer]), wide(self.delta[layer]))
        else:
            grad = torch.einsum("bpm,bpd->md", wide(self.a[layer]), wide(self.g[layer]))
        if layout == "model" and self.sites[(layer, which)].transposed:
            grad = grad.T
        return grad.contiguous()

    def bias_grad(self, layer: int, which: Which) -> torch.Tensor:
        """The gradient a bias of ``W_in`` (``sum_t delta_t``) or ``W_out`` (``sum_t g_t``)
        has, or would have if the model has none.

        Raises:
            UserError: A layer that was not analysed, or an unknown ``which``.
        """
        self._check_layer(layer)
        _check_choice("which", which, ("in", "out"))
        factor = self.delta[layer] if which == "in" else self.g[layer]
        return wide(factor).sum(dim=(0, 1))

    def vocab_projection(
        self, layer: int, factor: Factor = "g", *, fold_norm: bool = False, negate: bool = False
    ) -> torch.Tensor:
        """Read a ``d_model``-sized factor at every position as logits over the vocabulary.

        Args:
            layer: A block in ``layers``.
            factor: ``"g"`` (gradient at the MLP output: the directions ``W_out``'s gradient
                writes) or ``"x"`` (the MLP input: the directions ``W_in``'s gradient reads).
            fold_norm: Apply the final norm's weight first (centring the vector too for
                LayerNorm), as the model reads the residual stream; per-position norm scale
                and biases are left out, since a direction is read, not a point.
            negate: Project ``-factor``. For ``"g"`` that is what one gradient-descent step
                adds through ``W_out`` (the "shift" of the paper): its top tokens are the
                ones the update promotes.

        Returns:
            ``[batch, pos, d_vocab]`` scores in float32 or wider, zero at padding.

        Raises:
            UserError: A layer that was not analysed or an unknown ``factor``.
        """
        self._check_layer(layer)
        _check_choice("factor", factor, ("g", "x"))
        vectors = wide(self.g[layer] if factor == "g" else self.x[layer])
        if negate:
            vectors = -vectors
        if fold_norm:
            if self.normalization_type == "LN":
                vectors = vectors - vectors.mean(dim=-1, keepdim=True)
            if self.ln_final_weight is not None:
                vectors = vectors * self.ln_final_weight.to(vectors)
        scores = vectors @ self.W_U.to(vectors)
        return scores * self.mask[..., None].to(scores)

    def top_tokens(
        self,
        layer: int,
        k: int = 10,
        factor: Factor = "g",
        *,
        fold_norm: bool = False,
        negate: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` highest-scoring tokens of ``vocab_projection`` at every position.

        Decode one position with ``bridge.to_str_tokens(indices[i, t])``. A position whose
        vector is zero has no top tokens: padding, and for ``"g"`` every position the loss
        does not reach (the last token of each prompt under the next-token loss).

        Returns:
            ``(values, indices)``, each ``[batch, pos, k]``; where there are no top tokens
            the values are NaN and the indices -1.

        Raises:
            UserError: ``k`` outside ``1..d_vocab``, or as ``vocab_projection``.
        """
        d_vocab = self.W_U.shape[1]
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= d_vocab:
            raise UserError(f"top_tokens: k must be an int from 1 to d_vocab={d_vocab}, got {k!r}")
        scores = self.vocab_projection(layer, factor, fold_norm=fold_norm, negate=negate)
        values, indices = scores.topk(k, dim=-1)
        empty = (scores == 0).all(dim=-1, keepdim=True) | ~self.mask[..., None].to(values.device)
        return values.masked_fill(empty, float("nan")), indices.masked_fill(empty, -1)

    def _check_layer(self, layer: object) -> None:
        if layer not in self.layers or isinstance(layer, bool):
            raise UserError(
                f"layer {layer!r} was not analysed; this result holds layers {list(self.layers)} "
                f"(pass layers=... to backward_lens to choose)"
            )


def backward_lens(
    model: TransformerBridge,
    input: ModelInput,
    *,
    loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    layers: int | Sequence[int] | None = None,
    prepend_bos: bool = True,
) -> BackwardLensResult:
    """Factor the gradients of dense MLP weights into per-position rank-one terms.

    Runs one forward and one backward pass. The backward stops at the earliest selected
    block and computes no parameter gradients: every ``.grad`` is left as it was.

    Args:
        model: A bridge whose driver has gradients (``native``, ``hf``).
        input: Text, texts or token ids; ragged batches are right-padded.
        loss: ``fn(logits) -> scalar`` on the ``[batch, pos, d_vocab]`` logits; default the
            mean next-token cross-entropy over real positions (``model.loss``). Its
            gradient must not reach padded positions (index real positions only); a loss
            with a ``lengths`` keyword gets each prompt's real length.
        layers: A block index, several, or ``None`` for every block; negatives count from
            the end.
        prepend_bos: Put BOS before text input.

    Returns:
        The factors, weight layouts and unembedding (see ``BackwardLensResult``).

    Raises:
        UnsupportedFeatureError: Before any pass: a driver without gradients, a gated or
            mixture-of-experts MLP, a block without the four MLP hooks or without
            parameters of the MLP's shapes. After the pass: a block whose hooks are not the
            input and output of one of its weights (a norm or scale inside the MLP).
        UserError: Before any pass: bad ``layers``, ``input`` or ``loss``, forward hooks
            on ``mlp.hook_pre``/``mlp.hook_out``, inference mode. After it: a loss that is
            not a finite scalar with a gradient, a gradient that is not finite, or one
            that reaches padding.
    """
    chosen = _check_model(model, layers)
    if loss is not None and not callable(loss):
        raise UserError(
            f"backward_lens: loss must be a callable on the logits, got {type(loss).__name__}"
        )
    module = module_of(model)
    candidates = {layer: candidates_of(module, model, layer) for layer in chosen}
    batch = model._token_batch(input, prepend_bos=prepend_bos)
    if loss is None and batch.ids.shape[1] < 2:
        raise UserError(
            "backward_lens: the default next-token loss needs a prompt of at least two tokens; "
            "pass a longer input or your own loss=fn(logits)"
        )
    if torch.is_inference_mode_enabled():
        raise UserError("backward_lens needs gradients; call it outside torch.inference_mode()")

    seen: dict[str, torch.Tensor] = {}
    fwd = [(name, _Keep(seen, name)) for layer in chosen for name in _names(layer)]
    # Drivers that fire a hook on a view they build hand that view on to the model only
    # when a backward hook is attached, so the gradient read below reaches it.
    bwd = [
        (f"blocks.{layer}.mlp.{site}", _no_op)
        for layer in chosen
        for site in ("hook_pre", "hook_out")
    ]
    ids: Any = batch.rows() if batch.is_ragged else batch.ids
    with torch.enable_grad(), model.hooks(fwd, bwd):
        logits = model.forward(ids, "logits")
        value = (
            next_token_loss(logits, batch.ids, batch.lengths)
            if loss is None
            else call_metric(loss, logits, batch.lengths)
        )
        silent = [n for layer in chosen for n in _names(layer) if n not in seen]
        if silent:
            raise UnsupportedFeatureError(
                f"backward_lens: driver {model.driver.name!r} lists {silent[0]!r} but did not "
                f"fire it during the forward, so the factors of that block cannot be read"
            )
        names = _target_names(chosen)
        targets = [seen[name] for name in names]
        frozen = [n for n, t in zip(names, targets, strict=True) if not t.requires_grad]
        if frozen:
            raise UserError(
                f"backward_lens: no gradient flows to {frozen[0]!r}: the parameters before it "
                "do not require grad (frozen with requires_grad_(False)?); unfreeze them"
            )
        value = _check_loss_value(value, loss)
        grads = torch.autograd.grad(value, targets, allow_unused=True)
    for name, grad in zip(names, grads, strict=True):
        found = None if grad is None else non_finite(grad)
        if found is not None:
            raise UserError(
                f"backward_lens: the gradient of {_loss_name(loss)} at {name!r} is not finite "
                f"(it holds {found}), so every factor there would be too; avoid operations "
                f"with infinite slopes in the loss (sqrt or log at 0)"
            )

    mask = _real_mask(batch.lengths, batch.ids.shape[1], targets[0].device)
    factors: dict[str, dict[int, torch.Tensor]] = {"x": {}, "delta": {}, "a": {}, "g": {}}
    for index, layer in enumerate(chosen):
        pre, out = targets[2 * index], targets[2 * index + 1]
        delta, g = grads[2 * index], grads[2 * index + 1]
        values = {
            "x": seen[f"blocks.{layer}.mlp.hook_in"],
            "delta": torch.zeros_like(pre) if delta is None else delta,
            "a": seen[f"blocks.{layer}.mlp.hook_post"],
            "g": torch.zeros_like(out) if g is None else g,
        }
        for key, tensor in values.items():
            factors[key][layer] = _on_real_positions(tensor.detach(), mask, key, layer)

    sites: dict[tuple[int, str], WeightSite] = {}
    for layer in chosen:
        real = mask.to(factors["x"][layer].device).nonzero(as_tuple=True)
        x, pre = factors["x"][layer][real], seen[f"blocks.{layer}.mlp.hook_pre"].detach()[real]
        a, out = factors["a"][layer][real], seen[f"blocks.{layer}.mlp.hook_out"].detach()[real]
        sites[(layer, "in")] = recognise(candidates[layer], x, pre, layer, "in")
        sites[(layer, "out")] = recognise(candidates[layer], a, out, layer, "out")

    readout = _readout(model)
    return BackwardLensResult(
        layers=chosen,
        tokens=batch.ids,
        lengths=tuple(batch.lengths),
        loss=value.detach(),
        x=factors["x"],
        delta=factors["delta"],
        a=factors["a"],
        g=factors["g"],
        sites=sites,
        W_U=readout[0],
        ln_final_weight=readout[1],
        normalization_type=readout[2],
    )


# -- checks before the pass -------------------------------------------------------------


def _check_model(model: Any, layers: int | Sequence[int] | None) -> tuple[int, ...]:
    driver = getattr(model, "driver", None)
    if driver is None or not hasattr(model, "hook_dict"):
        raise UserError(
            f"backward_lens takes a bridge (tl_core.TransformerBridge), got {type(model).__name__}"
        )
    name = str(getattr(driver, "name", type(driver).__name__))
    if not driver.supports("gradients"):
        raise UnsupportedFeatureError(
            f"backward_lens needs gradients, and driver {name!r} has none; use a local "
            f"driver (native, hf)"
        )
    info = model.cfg
    if info.n_experts:
        raise UnsupportedFeatureError(
            f"backward_lens decomposes dense MLPs; {info.architecture!r} routes each token "
            f"through {info.experts_per_token or 'some'} of {info.n_experts} experts, so no "
            f"single W_in/W_out gradient exists. Nothing was run."
        )
    if info.gated_mlp:
        raise UnsupportedFeatureError(
            f"backward_lens decomposes dense MLPs (act(x @ W_in) @ W_out); {info.architecture!r} "
            f"has a gated MLP (act(x @ W_gate) * (x @ W_in)), whose weight gradients need a "
            f"third factor this version does not collect. Nothing was run."
        )
    chosen = _layers(layers, info.n_layers)
    hooks = model.hook_dict
    for layer in chosen:
        missing = [n for n in _names(layer) if n not in hooks]
        if missing:
            raise UnsupportedFeatureError(
                f"backward_lens needs {', '.join(map(repr, missing))} on driver {name!r}, which "
                f"does not fire them (see `tl hooks`); nothing was run"
            )
        for site in ("hook_pre", "hook_out"):
            point = hooks[f"blocks.{layer}.mlp.{site}"]
            if point.has_forward_hooks:
                raise UserError(
                    f"backward_lens reads the gradient at {point.name!r}, which has a forward "
                    f"hook attached: an edit there would make the factors describe the edited "
                    f"value, not the weight's output. Remove it (model.reset_hooks("
                    f"including_permanent=True)) and call again"
                )
    return chosen


def _layers(layers: int | Sequence[int] | None, n_layers: int) -> tuple[int, ...]:
    if layers is None:
        return tuple(range(n_layers))
    if isinstance(layers, Sequence) and not isinstance(layers, str):
        items: list[object] = list(layers)
    else:
        items = [layers]
    if not items:
        raise UserError(
            "backward_lens: layers is empty; pass a block index, several, or None for all"
        )
    chosen: set[int] = set()
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or not -n_layers <= item < n_layers:
            raise UserError(
                f"backward_lens: layers holds {item!r}, which is not a block of this "
                f"{n_layers}-block model; use ints from {-n_layers} to {n_layers - 1}"
            )
        chosen.add(item % n_layers)
    return tuple(sorted(chosen))


def _names(layer: int) -> list[str]:
    return [f"blocks.{layer}.mlp.{site}" for site in _SITES]


def _target_names(layers: Sequence[int]) -> list[str]:
    return [f"blocks.{layer}.mlp.{site}" for layer in layers for site in ("hook_pre", "hook_out")]


# -- the pass ---------------------------------------------------------------------------


class _Keep:
    """A forward hook keeping the value (graph attached) under its canonical name."""

    def __init__(self, store: dict[str, torch.Tensor], name: str) -> None:
        self._store, self._name = store, name

    def __call__(self, tensor: torch.Tensor, *, hook: Any) -> None:
        self._store[self._name] = tensor


def _no_op(grad: torch.Tensor, *, hook: Any) -> None:
    return None


def _loss_name(loss: Callable[..., torch.Tensor] | None) -> str:
    return "the default next-token loss" if loss is None else f"loss {describe_metric(loss)}"


def _check_loss_value(value: object, loss: Callable[..., torch.Tensor] | None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        found = (
            f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        raise UserError(
            f"backward_lens: loss(logits) must return a float scalar tensor, got {found}; reduce it with .sum() or .mean()"
        )
    bad = non_finite(value)
    if bad is not None:
        cause = (
            "The model's logits are not finite (NaN or inf weights or inputs?)"
            if loss is None
            else "Check the logits it reads and its arithmetic (log of 0, division by 0)"
        )
        raise UserError(
            f"backward_lens: {_loss_name(loss)} is {bad}, not a finite number, so every "
            f"gradient factor would be NaN; nothing was decomposed. {cause}"
        )
    if not value.requires_grad:
        raise UserError(
            "backward_lens: loss(logits) returned a value with no gradient; compute it from the logits without .detach() or torch.no_grad()"
        )
    return value.reshape(())


def _real_mask(lengths: Sequence[int], width: int, device: torch.device) -> torch.Tensor:
    cols = torch.arange(width, device=device)
    return cols[None, :] < torch.tensor(list(lengths), device=device)[:, None]


def _on_real_positions(
    tensor: torch.Tensor, mask: torch.Tensor, key: str, layer: int
) -> torch.Tensor:
    """Zero a factor at padding; a gradient there means the loss read padded logits."""
    mask = mask.to(tensor.device)
    if key in ("delta", "g") and not mask.all():
        leaked = tensor[~mask]
        if leaked.numel() and bool((leaked != 0).any()):
            raise UserError(
                f"backward_lens: the loss's gradient reaches padded positions (at "
                f"blocks.{layer}.mlp.{'hook_pre' if key == 'delta' else 'hook_out'}), so the "
                f"weight gradient would include padding; index each prompt's real positions "
                f"in loss(logits) (prompt i has its first lengths[i] columns), or pass prompts "
                f"of equal length"
            )
    return tensor * mask[..., None].to(tensor.dtype)


def _readout(model: Any) -> tuple[torch.Tensor, torch.Tensor | None, Literal["LN", "RMS"] | None]:
    read = getattr(model.driver, "readout", None)
    if callable(read):
        out = read()
        weight = out.ln_final_weight
        return (
            out.W_U.detach(),
            None if weight is None else weight.detach(),
            out.normalization_type,
        )
    return model.W_U.detach(), None, None


def _check_choice(what: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserError(f"{what} must be one of {', '.join(map(repr, choices))}, got {value!r}")
