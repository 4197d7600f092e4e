"""The torch hooks at each kind of physical site inside vLLM's model.

Every hook hands a value to ``RunState.visit`` (edits, then captures, in forward order)
and, when an edit came back, passes the edited value on so it propagates downstream. Values
are ``[tokens, ...]`` rows of the step's flat batch; head sites are shown to the state as
``[tokens, heads, d_head]`` views of the engine's ``[tokens, heads * d_head]`` tensors.

Residual-stream sites on families with fused add-norm (``(delta, residual)`` pairs) read
``delta + residual``; an edit passes ``(edited, zeros)`` on, which the next fused add turns
back into exactly ``edited``.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

from tl_core.architecture import NormKind
from tl_core.driver_api import norm_statistics
from tl_driver_vllm._worker_side._run_state import RunState

__all__ = [
    "AttentionInput",
    "GateUpSplit",
    "InputSite",
    "NormSite",
    "OutputProjection",
    "OutputSite",
    "QKVSplit",
    "ResidualSite",
    "RouterSite",
    "normalized",
]


def normalized(x: torch.Tensor, norm: NormKind, eps: float) -> torch.Tensor:
    """A norm's value before its weight (and bias), from its input (over the last axis)."""
    return norm_statistics(x, norm, eps)[1].to(x.dtype)


def _scale(x: torch.Tensor, norm: NormKind, eps: float) -> torch.Tensor:
    return norm_statistics(x, norm, eps)[0].to(x.dtype)


def _visit_views(
    state: RunState, names: Sequence[str | None], views: Sequence[torch.Tensor]
) -> None:
    """Capture and edit views of one module output, one hook per view (``None``: not served).

    The views alias a projection's fresh output, so an edit written into a view reaches
    every later use of that output.
    """
    for name, view in zip(names, views, strict=True):
        if name is None:
            continue
        edited = state.visit((name,), view)
        if edited is not view:
            view.copy_(edited)


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output  # type: ignore[no-any-return]


def _with_first(output: Any, value: torch.Tensor) -> Any:
    return (value, *output[1:]) if isinstance(output, tuple) else value


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[tokens, heads * d]`` (or already ``[tokens, heads, d]``) as ``[tokens, heads, d]``."""
    return x.view(x.shape[0], heads, -1)


class ResidualSite:
    """Pre-hook at the residual stream entering a layer (or the final norm).

    Args:
        state: The run.
        names: Hooks of this value, in forward order.
        index: Position of the hidden-states argument.
        pair: Whether a ``residual`` argument comes with it (fused add-norm families).
        final: ``(norm kind, eps)`` at the final norm, whose derived sites are read here.
        residual_at: Position of the ``residual`` argument (default: right after the hidden
            states; gpt-oss passes the positions between them).
    """

    def __init__(
        self,
        state: RunState,
        names: tuple[str, ...],
        index: int,
        pair: bool,
        final: tuple[NormKind, float] | None,
        residual_at: int | None = None,
    ) -> None:
        self.state, self.names, self.index, self.pair, self.final = state, names, index, pair, final
        self.residual_at = index + 1 if residual_at is None else residual_at

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        first, second = self.index, self.residual_at
        hidden = args[first]
        residual = args[second] if self.pair and len(args) > second else None
        x = hidden if residual is None else hidden + residual
        edited = self.state.visit(self.names, x)
        if self.final is not None:
            norm, eps = self.final
            if "ln_final.hook_scale" in self.state.captured:
                self.state.capture("ln_final.hook_scale", edited, lambda t: _scale(t, norm, eps))
            if "ln_final.hook_normalized" in self.state.captured:
                self.state.capture(
                    "ln_final.hook_normalized", edited, lambda t: normalized(t, norm, eps)
                )
        if edited is x:
            return None
        new = list(args)
        new[first] = edited
        if residual is not None:
            new[second] = torch.zeros_like(edited)
        return tuple(new), kwargs


class NormSite:
    """Pre- and forward hook on one norm: its input, the values derived from it, its output.

    ``mode`` says what an edit of the input reaches. ``"residual"`` (``ln2.hook_in``, the
    residual between attention and MLP): the residual stream itself, so the MLP's output
    is added to the edited value. ``"norm"`` (``ln1.hook_in``, QK-norm inputs): only the
    norm, as a pre-hook on the hf driver's norm module does; under a fused add-norm the
    residual the kernel hands on is restored to the unedited sum.

    Args:
        state: The run.
        prefix: The norm's canonical prefix (``"blocks.0.ln1"``, ``"blocks.0.attn.q_norm"``).
        mode: ``"residual"``, ``"norm"``, or ``None`` (the input is read elsewhere).
        pair: Whether the norm may be called ``norm(delta, residual)`` (fused add-norm).
        kind: The norm's kind (``tl_core.architecture.NormKind``).
        eps: Its epsilon.
        heads: For QK-norms, the heads on this rank (values are shown ``[tokens, heads, d]``).
        flat: For QK-norms, whether the norm normalises all heads of a position together.
    """

    def __init__(
        self,
        state: RunState,
        prefix: str,
        *,
        mode: Literal["residual", "norm"] | None,
        pair: bool,
        kind: NormKind,
        eps: float,
        heads: int | None = None,
        flat: bool = False,
    ) -> None:
        self.state, self.mode, self.pair, self.kind, self.eps = state, mode, pair, kind, eps
        self.heads, self.flat = heads, flat
        self.input = (f"{prefix}.hook_in",)
        self.scale, self.normed = f"{prefix}.hook_scale", f"{prefix}.hook_normalized"
        self.output = (f"{prefix}.hook_out",)
        self._restore: torch.Tensor | None = None

    def _view(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.heads is None else _heads(x, self.heads)

    def pre(self, module: nn.Module, args: tuple[Any, ...]) -> Any:
        """Read (and edit) the input; derive the scale and normalized value from it."""
        self._restore = None
        fused = self.pair and len(args) > 1 and args[1] is not None
        x = args[0] + args[1] if fused else args[0]
        seen = self._view(x)
        edited = self.state.visit(self.input, seen) if self.mode is not None else seen
        self._derive(edited)
        if edited is seen:
            return None
        if fused:
            # The fused kernel norms delta + residual and hands that sum on as the residual.
            if self.mode == "norm":
                self._restore = x
            return (edited, torch.zeros_like(edited), *args[2:])
        if self.mode == "residual":
            # Unfused families keep this very tensor as the block's residual: edit in place.
            x.copy_(edited)
            return None
        return (edited.view(args[0].shape), *args[1:])

    def post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Read (and edit) the output; put back the residual a norm-only edit changed."""
        value = _first(output)
        seen = self._view(value)
        edited = self.state.visit(self.output, seen)
        result = output if edited is seen else _with_first(output, edited.view(value.shape))
        restore, self._restore = self._restore, None
        if restore is not None:
            result = (_first(result), restore, *result[2:])
        return None if result is output else result

    def _derive(self, x: torch.Tensor) -> None:
        captured = self.state.captured
        if self.scale not in captured and self.normed not in captured:
            return
        kind, eps, heads = self.kind, self.eps, self.heads
        if self.flat and heads is not None:
            # One scale per position over all heads, served repeated for every head.
            def scale(t: torch.Tensor) -> torch.Tensor:
                return (
                    _scale(t.flatten(1), kind, eps).unsqueeze(1).expand(-1, heads, 1).contiguous()
                )

            def normed(t: torch.Tensor) -> torch.Tensor:
                return normalized(t.flatten(1), kind, eps).view(t.shape)
        else:

            def scale(t: torch.Tensor) -> torch.Tensor:
                return _scale(t, kind, eps)

            def normed(t: torch.Tensor) -> torch.Tensor:
                return normalized(t, kind, eps)

        if self.scale in captured:
            self.state.capture(self.scale, x, scale)
        if self.normed in captured:
            self.state.capture(self.normed, x, normed)


class OutputSite:
    """Forward hook on a module whose output tensor is the site (or its first element)."""

    def __init__(self, state: RunState, names: tuple[str, ...]) -> None:
        self.state, self.names = state, names

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        value = _first(output)
        edited = self.state.visit(self.names, value)
        return None if edited is value else _with_first(output, edited)


class InputSite:
    """Pre-hook on a module's hidden-states input (``hidden_states=`` or positional).

    Args:
        state: The run.
        names: Hooks of this value.
        position: Index of the positional argument when not passed by keyword
            (``-1``: attention blocks take ``(positions, hidden_states)``).
    """

    def __init__(self, state: RunState, names: tuple[str, ...], position: int) -> None:
        self.state, self.names, self.position = state, names, position

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if "hidden_states" in kwargs:
            x = kwargs["hidden_states"]
            edited = self.state.visit(self.names, x)
            return None if edited is x else (args, {**kwargs, "hidden_states": edited})
        index = self.position % len(args)
        x = args[index]
        edited = self.state.visit(self.names, x)
        if edited is x:
            return None
        return (*args[:index], edited, *args[index + 1 :]), kwargs


class QKVSplit:
    """Forward hook on the fused QKV projection: per-head queries and keys before rotary.

    Args:
        state: The run.
        names: ``(query hook or None, key hook or None)``.
        heads: Query heads on this rank.
        kv_heads: Key/value heads on this rank.
        head_dim: Width of one head.
        layout: ``"blocks"`` (``[q | k | v]``) or ``"heads"`` (``[q_h | k_h | v_h]``).
    """

    def __init__(
        self, state: RunState, names: tuple[str | None, str | None], heads: int, kv_heads: int,
        head_dim: int, layout: str,
    ) -> None:  # fmt: skip
        self.state, self.names, self.layout = state, names, layout
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        qkv = _first(output)
        n, h, kv, dh = qkv.shape[0], self.heads, self.kv_heads, self.head_dim
        if self.layout == "heads":
            fused = qkv.view(n, h, 3, dh)
            parts = (fused[:, :, 0], fused[:, :, 1])
        else:
            parts = (
                qkv[:, : h * dh].view(n, h, dh),
                qkv[:, h * dh : (h + kv) * dh].view(n, kv, dh),
            )
        _visit_views(self.state, self.names, parts)
        return None


class AttentionInput:
    """Pre-hook on vLLM's ``Attention`` layer: the queries, keys and values it receives.

    Args:
        state: The run.
        names: Hooks of ``(query, key, value)``; ``None`` where not served.
        heads: Query heads on this rank.
        kv_heads: Key/value heads on this rank.
    """

    _KEYS = ("query", "key", "value")

    def __init__(
        self, state: RunState, names: tuple[str | None, ...], heads: int, kv_heads: int
    ) -> None:
        self.state, self.names = state, names
        self.counts = (heads, kv_heads, kv_heads)

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        new_args, new_kwargs = list(args), dict(kwargs)
        changed = False
        for index, (key, name, count) in enumerate(
            zip(self._KEYS, self.names, self.counts, strict=True)
        ):
            in_args = index < len(args)
            value = args[index] if in_args else kwargs.get(key)
            if name is None or value is None:
                continue
            seen = _heads(value, count)
            edited = self.state.visit((name,), seen)
            if edited is seen:
                continue
            changed = True
            if in_args:
                new_args[index] = edited.view(value.shape)
            else:
                new_kwargs[key] = edited.view(value.shape)
        return (tuple(new_args), new_kwargs) if changed else None


class OutputProjection:
    """Hooks on the attention output projection: ``hook_z`` (its input), ``hook_result``.

    ``hook_result`` is each head's ``z_h @ W_O[h]``, without the projection's bias, computed
    from this rank's weight shard. An edited request's rows of the projection's output are
    rebuilt as ``sum_h edited_h`` (summed across tensor-parallel ranks) plus the bias, as the
    hf driver rebuilds them, so a suppressed head sum is exactly zero there; other rows keep
    the projection's own output.

    Args:
        state: The run.
        z: The ``hook_z`` name, or ``None``.
        result: The ``hook_result`` name, or ``None``.
        heads: Query heads on this rank.
        tp_size: Tensor-parallel ranks.
    """

    def __init__(
        self, state: RunState, z: str | None, result: str | None, heads: int, tp_size: int
    ) -> None:
        self.state, self.z, self.result, self.heads, self.tp_size = state, z, result, heads, tp_size

    def pre(self, module: nn.Module, args: tuple[Any, ...]) -> Any:
        """Read (and edit) ``hook_z``."""
        assert self.z is not None
        x = args[0]
        seen = _heads(x, self.heads)
        edited = self.state.visit((self.z,), seen)
        return None if edited is seen else (edited.reshape(x.shape), *args[1:])

    def post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Read (and edit) ``hook_result`` from the (possibly edited) ``z``."""
        assert self.result is not None
        z = _heads(args[0], self.heads)
        weight = dense_weight(module)
        heads = self.heads

        def per_head(rows: torch.Tensor) -> torch.Tensor:
            w = weight.view(weight.shape[0], heads, -1)
            return torch.einsum("the,dhe->thd", rows, w.to(rows.dtype))

        if self.result not in self.state.tables:
            if self.result in self.state.captured:
                self.state.capture(self.result, z, per_head)
            return None
        result = per_head(z)
        edited = self.state.visit((self.result,), result)
        if edited is result:
            return None
        # Adding sum_h (edited_h - result_h) to the output instead would leave rounding
        # residue where a spec zeroes the sum, which a following norm (OLMo 2's post-norm)
        # amplifies by 1/sqrt(eps).
        total = edited.sum(dim=1)
        if self.tp_size > 1:
            from vllm.distributed import tensor_model_parallel_all_reduce

            # Every rank runs this hook with the same rows: the collective stays in step.
            total = tensor_model_parallel_all_reduce(total)
        value = _first(output)
        bias = getattr(module, "bias", None)
        if isinstance(bias, torch.Tensor) and not getattr(module, "skip_bias_add", False):
            total = total + bias
        step = self.state.step
        assert step is not None
        rows, _ = step.edit_rows(self.result, self.state.plans, value.device)
        new = value.clone()
        new[rows] = total[rows].to(value.dtype)
        return _with_first(output, new)


_WEIGHTS: weakref.WeakKeyDictionary[nn.Module, torch.Tensor] = weakref.WeakKeyDictionary()


def dense_weight(module: nn.Module) -> torch.Tensor:
    """A vLLM linear layer's ``[out, in]`` weight (this rank's shard), as it computes with it.

    vLLM's CPU build repacks linear weights for its GEMM kernels and frees ``weight``; the
    weight is then read back once through the layer's own kernel, applied to the identity
    (exact: every output is one weight times 1), and kept for the worker's lifetime.
    """
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.numel() > 0 and weight.dim() == 2:
        return weight
    cached = _WEIGHTS.get(module)
    if cached is None:
        layer: Any = module
        ref = next(module.parameters())
        eye = torch.eye(
            int(layer.input_size_per_partition),
            dtype=getattr(layer, "params_dtype", ref.dtype),
            device=ref.device,
        )
        with torch.no_grad():
            cached = layer.quant_method.apply(layer, eye).T.contiguous()
        _WEIGHTS[module] = cached
    return cached


class GateUpSplit:
    """Forward hook on a fused ``[gate | up]`` projection: ``hook_pre`` and ``hook_pre_linear``."""

    def __init__(self, state: RunState, names: tuple[str | None, str | None]) -> None:
        self.state, self.names = state, names

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        fused = _first(output)
        half = fused.shape[-1] // 2
        _visit_views(self.state, self.names, (fused[:, :half], fused[:, half:]))
        return None


class RouterSite:
    """Forward hook on a mixture-of-experts router: logits, and the routing derived from them.

    The expert weights and indices are what the family's routing computes from the logits
    (softmax in float32, the top ``k`` experts, weights renormalised to sum to 1 where the
    family does), served as
    the hf driver serves them: weights per expert (0 where not chosen), indices in top-k order.
    """

    def __init__(self, state: RunState, prefix: str, top_k: int, renormalize: bool = True) -> None:
        self.state, self.top_k, self.renormalize = state, top_k, renormalize
        self.logits = f"{prefix}.hook_router_logits"
        self.weights = f"{prefix}.hook_expert_weights"
        self.indices = f"{prefix}.hook_expert_indices"

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits.float(), dim=-1)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return torch.zeros_like(probs).scatter(1, index, top), index

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        logits = _first(output)
        self.state.visit((self.logits,), logits)
        if self.weights in self.state.captured:
            self.state.capture(self.weights, logits, lambda t: self._route(t)[0])
        if self.indices in self.state.captured:
            self.state.capture(self.indices, logits, lambda t: self._route(t)[1])
