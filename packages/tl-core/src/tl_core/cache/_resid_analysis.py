"""Residual-stream analysis behind ``ActivationCache``: decompositions, norms, logit attribution.

``ResidualAnalysisMixin`` holds the TransformerLens-style analysis methods. It reads tensors
through a few primitives that ``ActivationCache`` provides (``_tensor``, ``_has``,
``n_layers``, ...), so the maths here never deals with alias resolution or error listings.

Conventions:

* A residual stack is ``[component, batch, pos, d_model]``; the batch dimension is absent when
  the cache has none, and the pos dimension is absent after an ``int`` ``pos_slice``.
* On a cache of prompts of different lengths (``lengths``; right padding) ``pos_slice``
  counts within each prompt, negatives from its own end, so ``-1`` is every prompt's last
  token, never padding (``None`` still keeps every column).
* ``layer`` counts residual points: ``0 .. n_layers - 1`` is the input of that block,
  ``n_layers`` (also ``None`` or ``-1``) is the final residual, and other negative values
  count back from it (``-2`` = the input of the last block).
* "Normalised" values are taken after the norm's centring and scaling and before its weight
  and bias (the ``hook_normalized`` convention).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Literal, overload

import torch

from tl_core._errors import UserError
from tl_core.cache._readout import ModelReadout
from tl_core.cache._resid_math import (
    DEFAULT_EPS,
    NormType,
    Plan,
    PosSlice,
    accumulated_plan,
    broadcasts_to,
    decompose_plan,
    logit_directions,
    normalize_components,
    normalize_layer,
    readout_logits,
    recompute_scale,
    slice_positions,
)
from tl_core.hooks._model_info import ModelInfo

__all__ = ["PosSlice", "ResidualAnalysisMixin"]


class ResidualAnalysisMixin(ABC):
    """Residual-stream analysis on a cache; see ``ActivationCache`` for the primitives."""

    @property
    @abstractmethod
    def n_layers(self) -> int:
        """Number of blocks of the model."""

    @property
    @abstractmethod
    def info(self) -> ModelInfo | None:
        """Shape facts about the model, if known."""

    @property
    @abstractmethod
    def readout(self) -> ModelReadout | None:
        """Final norm and unembedding, if known."""

    @property
    @abstractmethod
    def lengths(self) -> tuple[int, ...] | None:
        """Real length of each prompt, when known (right padding)."""

    @property
    @abstractmethod
    def has_batch_dim(self) -> bool:
        """Whether cached tensors have a leading batch dimension."""

    @abstractmethod
    def _tensor(self, name: str, purpose: str) -> torch.Tensor:
        """The cached tensor of a canonical name; a missing one is an error naming ``purpose``."""

    @abstractmethod
    def _has(self, name: str) -> bool:
        """Whether a canonical name is cached."""

    # -- helpers -------------------------------------------------------------------------

    def _pos_dim(self) -> int:
        return 1 if self.has_batch_dim else 0

    def _positions(self, tensor: torch.Tensor, pos_slice: PosSlice) -> torch.Tensor:
        """``pos_slice`` of a cached tensor, read within each prompt of a ragged batch."""
        lengths = self.lengths if self.has_batch_dim else None
        return slice_positions(tensor, pos_slice, self._pos_dim(), lengths)

    def _stack_plan(self, plan: Plan, pos_slice: PosSlice, purpose: str) -> torch.Tensor:
        if not plan:
            raise UserError(
                f"{purpose} selects no components; include the embeddings or pick a later layer."
            )
        tensors = [self._positions(self._tensor(name, purpose), pos_slice) for _, name in plan]
        return torch.stack(tensors)

    def _norm_type(self, final: bool, purpose: str) -> NormType:
        if final and self.readout is not None:
            return self.readout.normalization_type
        if self.info is not None:
            if self.info.normalization_type == "unknown":
                raise UserError(
                    f"{purpose} needs the model's normalisation, but tl did not establish it "
                    f"for {self.info.architecture or 'this model'!r} (its blocks are read from "
                    "outside only); normalise the stack yourself, or, for the final norm, pass "
                    "readout=ModelReadout(...)"
                )
            return self.info.normalization_type
        if self.readout is not None:
            return self.readout.normalization_type
        raise UserError(
            f"{purpose} needs to know the model's normalisation (LayerNorm, RMSNorm or none): "
            "build the ActivationCache with info=ModelInfo(...) or readout=ModelReadout(...)."
        )

    def _require_additive_blocks(self, purpose: str) -> None:
        """Refuse an analysis that reads the residual stream as a running sum on a model
        whose blocks renormalise it (post-LN, BERT)."""
        if self.info is not None and self.info.post_residual_norm:
            raise UserError(
                f"{purpose} reads the residual stream as a sum of the outputs added to it, but "
                f"{self.info.architecture or 'this model'!r} normalises it after every "
                "sublayer (post-LN blocks: h = ln1(x + attn(x)), out = ln2(h + mlp(h))), so "
                "no block's input is a sum of earlier outputs. Read the sites themselves "
                "(blocks.{i}.attn.hook_out, blocks.{i}.ln1.hook_in, ...) instead"
            )

    def _is_parallel(self) -> bool:
        return self.info is not None and self.info.parallel_attn_mlp

    def _scale_name(self, layer: int, mlp_input: bool) -> str:
        if layer == self.n_layers:
            return "ln_final.hook_scale"
        name = f"blocks.{layer}.ln{2 if mlp_input else 1}.hook_scale"
        if mlp_input and self._is_parallel() and not self._has(name):
            # Both norms of a parallel block read the block input, so ln1's scale is ln2's.
            return f"blocks.{layer}.ln1.hook_scale"
        return name

    def _embed_plan(self) -> Plan:
        if self.info is not None:
            learned = self.info.positional_embedding_type == "standard"
        else:
            learned = self._has("pos_embed.hook_out")
        if learned:
            return [("embed", "embed.hook_out"), ("pos_embed", "pos_embed.hook_out")]
        if self._has("blocks.0.hook_in"):
            # Without a position term the residual entering block 0 is the embedding after
            # any scaling the model applies (Gemma), which ``embed.hook_out`` precedes.
            return [("embed", "blocks.0.hook_in")]
        return [("embed", "embed.hook_out")]

    def _require_readout(self, purpose: str) -> ModelReadout:
        if self.readout is None:
            raise UserError(
                f"{purpose} needs the model's final norm and unembedding: build the "
                "ActivationCache with readout=ModelReadout(...) (bridges pass it for you)."
            )
        return self.readout

    # -- public analysis -----------------------------------------------------------------

    @overload
    def accumulated_resid(
        self,
        layer: int | None = ...,
        *,
        incl_mid: bool = ...,
        mlp_input: bool = ...,
        apply_ln: bool = ...,
        pos_slice: PosSlice = ...,
        return_labels: Literal[False] = ...,
    ) -> torch.Tensor: ...

    @overload
    def accumulated_resid(
        self,
        layer: int | None = ...,
        *,
        incl_mid: bool = ...,
        mlp_input: bool = ...,
        apply_ln: bool = ...,
        pos_slice: PosSlice = ...,
        return_labels: Literal[True],
    ) -> tuple[torch.Tensor, list[str]]: ...

    def accumulated_resid(
        self,
        layer: int | None = None,
        *,
        incl_mid: bool = False,
        mlp_input: bool = False,
        apply_ln: bool = False,
        pos_slice: PosSlice = None,
        return_labels: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, list[str]]:
        """Stack the residual stream as it stands at successive points of the forward pass.

        Entries are the inputs of blocks ``0 .. layer`` (``blocks.{i}.hook_in``, labels
        ``"{i}_pre"``), with each block's mid residual (``ln2.hook_in``, ``"{i}_mid"``) when
        asked, and the final residual (``blocks.{n_layers-1}.hook_out``, ``"final_post"``)
        when ``layer`` is the final point.

        Args:
            layer: Last residual point to include: a block index (its input is included),
                or ``None``/``-1``/``n_layers`` for everything up to the final residual.
            incl_mid: Include the mid residual of each block before ``layer``.
            mlp_input: Also include the mid residual of block ``layer`` (the MLP's input);
                with ``apply_ln`` the ``ln2`` scale is used.
            apply_ln: Normalise every entry with the cached scale of the norm that reads the
                residual at ``layer`` (see ``apply_ln_to_stack``), as TransformerLens does.
            pos_slice: Positions to keep (an ``int`` drops the position dimension), within
                each prompt on a ragged cache.
            return_labels: Also return the labels.

        Returns:
            ``[component, batch, pos, d_model]``, and the labels if asked.

        Raises:
            UserError: A bad argument, or a needed hook is not cached (``HookNameError``).
        """
        n_layers = self.n_layers
        index = normalize_layer(layer, n_layers, method="accumulated_resid")
        if mlp_input and index == n_layers:
            raise UserError("accumulated_resid: mlp_input=True needs a block index below n_layers.")
        plan = accumulated_plan(
            n_layers, index, incl_mid=incl_mid, mlp_input=mlp_input, parallel=self._is_parallel()
        )
        stack = self._stack_plan(plan, pos_slice, "accumulated_resid")
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, index, mlp_input=mlp_input, pos_slice=pos_slice)
        return (stack, [label for label, _ in plan]) if return_labels else stack

    @overload
    def decompose_resid(
        self,
        layer: int | None = ...,
        *,
        mlp_input: bool = ...,
        mode: Literal["all", "mlp", "attn"] = ...,
        incl_embeds: bool = ...,
        apply_ln: bool = ...,
        pos_slice: PosSlice = ...,
        return_labels: Literal[False] = ...,
    ) -> torch.Tensor: ...

    @overload
    def decompose_resid(
        self,
        layer: int | None = ...,
        *,
        mlp_input: bool = ...,
        mode: Literal["all", "mlp", "attn"] = ...,
        incl_embeds: bool = ...,
        apply_ln: bool = ...,
        pos_slice: PosSlice = ...,
        return_labels: Literal[True],
    ) -> tuple[torch.Tensor, list[str]]: ...

    def decompose_resid(
        self,
        layer: int | None = None,
        *,
        mlp_input: bool = False,
        mode: Literal["all", "mlp", "attn"] = "all",
        incl_embeds: bool = True,
        apply_ln: bool = False,
        pos_slice: PosSlice = None,
        return_labels: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, list[str]]:
        """Split the residual at ``layer`` into the outputs that were added to make it.

        Components: ``"embed"`` and ``"pos_embed"`` (learned positions only), then
        ``"{i}_attn_out"`` and ``"{i}_mlp_out"`` for each block before ``layer``. With all
        components included they sum to the residual at ``layer``. Without learned
        positions the ``"embed"`` component is ``blocks.0.hook_in`` when cached (it includes
        any embedding scaling, e.g. Gemma's ``sqrt(d_model)``). On sandwich-norm models the
        sublayer components are the post-norm outputs (``ln1_post``/``ln2_post.hook_out``),
        which are what the residual stream receives.

        Args:
            layer: Residual point to decompose: a block index (its input), or
                ``None``/``-1``/``n_layers`` for the final residual.
            mlp_input: Decompose the input of block ``layer``'s MLP instead (adds that block's
                attention output; nothing on parallel attention/MLP blocks).
            mode: ``"all"``, ``"attn"`` or ``"mlp"``: which sublayer outputs to include.
            incl_embeds: Include the embedding components.
            apply_ln: Normalise the components with the cached scale at ``layer``
                (see ``apply_ln_to_stack``).
            pos_slice: Positions to keep (an ``int`` drops the position dimension), within
                each prompt on a ragged cache.
            return_labels: Also return the labels.

        Returns:
            ``[component, batch, pos, d_model]``, and the labels if asked.

        Raises:
            UserError: A bad argument, no component selected, or a needed hook is not cached.
        """
        self._require_additive_blocks("decompose_resid")
        n_layers = self.n_layers
        index = normalize_layer(layer, n_layers, method="decompose_resid")
        if mlp_input and index == n_layers:
            raise UserError("decompose_resid: mlp_input=True needs a block index below n_layers.")
        sandwich = self.info is not None and self.info.sandwich_norm
        plan = decompose_plan(
            index,
            embeds=self._embed_plan() if incl_embeds else [],
            mode=mode,
            mlp_input=mlp_input,
            sandwich=sandwich,
            parallel=self._is_parallel(),
        )
        stack = self._stack_plan(plan, pos_slice, "decompose_resid")
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, index, mlp_input=mlp_input, pos_slice=pos_slice)
        return (stack, [label for label, _ in plan]) if return_labels else stack

    @overload
    def stack_head_results(
        self,
        layer: int | None = ...,
        *,
        pos_slice: PosSlice = ...,
        apply_ln: bool = ...,
        return_labels: Literal[False] = ...,
    ) -> torch.Tensor: ...

    @overload
    def stack_head_results(
        self,
        layer: int | None = ...,
        *,
        pos_slice: PosSlice = ...,
        apply_ln: bool = ...,
        return_labels: Literal[True],
    ) -> tuple[torch.Tensor, list[str]]: ...

    def stack_head_results(
        self,
        layer: int | None = -1,
        *,
        pos_slice: PosSlice = None,
        apply_ln: bool = False,
        return_labels: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, list[str]]:
        """Stack each attention head's output (``attn.hook_result``) of the blocks before ``layer``.

        Args:
            layer: Stop before this block; ``None``/``-1``/``n_layers`` for all blocks.
            pos_slice: Positions to keep (an ``int`` drops the position dimension), within
                each prompt on a ragged cache.
            apply_ln: Normalise with the cached scale at ``layer`` (see ``apply_ln_to_stack``).
            return_labels: Also return labels ``"L{layer}H{head}"``.

        Returns:
            ``[layer * n_heads, batch, pos, d_model]``, and the labels if asked.

        Raises:
            UserError: ``blocks.{i}.attn.hook_result`` is not cached (it is opt-in), or
                ``layer`` is 0.
        """
        index = normalize_layer(layer, self.n_layers, method="stack_head_results")
        if index == 0:
            raise UserError("stack_head_results: layer=0 selects no blocks; use layer >= 1.")
        pieces: list[torch.Tensor] = []
        labels: list[str] = []
        for block in range(index):
            name = f"blocks.{block}.attn.hook_result"
            if not self._has(name):
                raise UserError(
                    f"stack_head_results needs the per-head outputs {name!r} "
                    "[batch, pos, head, d_model], which this cache lacks. They are opt-in: "
                    "capture 'blocks.{i}.attn.hook_result' for every block you stack "
                    "(enable attn_result on the bridge, or list the names in capture=...)."
                )
            result = self._tensor(name, "stack_head_results")
            result = self._positions(result, pos_slice)
            pieces.append(result.movedim(-2, 0))
            labels.extend(f"L{block}H{head}" for head in range(result.shape[-2]))
        stack = torch.cat(pieces)
        if apply_ln:
            stack = self.apply_ln_to_stack(stack, index, pos_slice=pos_slice)
        return (stack, labels) if return_labels else stack

    def apply_ln_to_stack(
        self,
        residual_stack: torch.Tensor,
        layer: int | None = None,
        *,
        mlp_input: bool = False,
        pos_slice: PosSlice = None,
        recompute_ln: bool = False,
        has_batch_dim: bool | None = None,
    ) -> torch.Tensor:
        """Normalise each component with the norm the residual at ``layer`` went through.

        For LayerNorm each component is centred (its mean over ``d_model`` removed) and
        divided by the cached scale; for RMSNorm it is only divided; without a norm the stack
        comes back unchanged. The scale is ``ln_final.hook_scale`` for the final residual,
        ``blocks.{layer}.ln1.hook_scale`` for a block input, and ``ln2`` with ``mlp_input``.
        Because the scale is held fixed, the results sum to the normalised residual when the
        stack sums to the residual. The result is pre-weight (``hook_normalized``
        convention): the norm's weight and bias are not applied.

        Args:
            residual_stack: ``[component, batch, pos, d_model]``, already position-sliced
                with ``pos_slice``.
            layer: Residual point whose norm to use (``None``/``-1`` = final norm).
            mlp_input: Use block ``layer``'s ``ln2`` (the MLP input norm).
            pos_slice: The ``pos_slice`` that built the stack; applied to the cached scale.
            recompute_ln: Compute the scale from the sum of the stack instead of the cache
                (only meaningful when the components sum to the residual). Epsilon is the
                readout's ``eps`` (``1e-5`` without a readout).
            has_batch_dim: Whether the stack has a batch dimension; ``None`` = like the cache.
                A stack without one on a batched cache needs batch size 1.

        Returns:
            The normalised stack, same shape.

        Raises:
            UserError: The normalisation type is unknown, the scale is not cached (the
                message names the hook to capture), or its shape does not fit the stack.
        """
        purpose = "apply_ln_to_stack"
        self._require_additive_blocks(purpose)
        index = normalize_layer(layer, self.n_layers, method=purpose)
        final = index == self.n_layers
        if mlp_input and final:
            raise UserError(f"{purpose}: mlp_input=True needs a block index below n_layers.")
        norm = self._norm_type(final, purpose)
        if norm is None:
            return residual_stack
        if recompute_ln:
            eps = self.readout.eps if self.readout is not None else DEFAULT_EPS
            scale = recompute_scale(residual_stack.sum(dim=0), norm, eps)
            return normalize_components(residual_stack, scale, norm)
        name = self._scale_name(index, mlp_input)
        scale = self._positions(self._tensor(name, purpose), pos_slice)
        stack_batched = self.has_batch_dim if has_batch_dim is None else has_batch_dim
        if self.has_batch_dim and not stack_batched:
            if scale.shape[0] != 1:
                raise UserError(
                    f"{purpose}: the stack has no batch dimension but the cache holds "
                    f"{scale.shape[0]} prompts; use cache.prompt(i) or keep the batch dimension."
                )
            scale = scale[0]
        scale = scale.to(device=residual_stack.device, dtype=residual_stack.dtype)
        if not broadcasts_to(tuple(scale.shape), tuple(residual_stack.shape[1:])):
            raise UserError(
                f"{purpose}: the cached scale {name!r} has shape {tuple(scale.shape)} after "
                f"pos_slice={pos_slice!r}, which does not fit a stack of shape "
                f"{tuple(residual_stack.shape)} ([component, batch, pos, d_model]); pass the "
                "same pos_slice that built the stack."
            )
        return normalize_components(residual_stack, scale, norm)

    def logit_attrs(
        self,
        residual_stack: torch.Tensor,
        tokens: int | torch.Tensor | Sequence[int],
        incorrect_tokens: int | torch.Tensor | Sequence[int] | None = None,
        *,
        pos_slice: PosSlice = None,
        has_batch_dim: bool | None = None,
    ) -> torch.Tensor:
        """Each component's linear contribution to the logit of ``tokens``.

        The stack is normalised with the cached final-norm scale (``apply_ln_to_stack`` at
        the final residual), multiplied by the final norm's weight and dotted with
        ``W_U[:, tokens]`` (minus ``W_U[:, incorrect_tokens]``). For a stack that sums to
        the final residual, the attributions sum to the logit (difference) up to constant
        offsets that are not attributed to any component: the final norm's bias times the
        unembedding direction, and ``b_U[tokens]`` (minus ``b_U[incorrect_tokens]``).
        Logit soft-capping, where the model has it, is not applied (pre-cap logits).

        Args:
            residual_stack: ``[component, batch, pos, d_model]`` (sliced with ``pos_slice``).
            tokens: One token id, or ids broadcastable to the stack's ``[batch, pos]`` dims
                (e.g. ``[batch]`` with an ``int`` ``pos_slice``).
            incorrect_tokens: Ids whose logit to subtract, same shape as ``tokens``.
            pos_slice: The ``pos_slice`` that built the stack.
            has_batch_dim: Whether the stack has a batch dimension; ``None`` = like the cache.

        Returns:
            ``[component, batch, pos]`` attributions (dims as in the stack).

        Raises:
            UserError: No readout, ids outside the vocabulary, shapes that do not fit, or the
                final-norm scale is not cached.
        """
        readout = self._require_readout("logit_attrs")
        if residual_stack.shape[-1] != readout.W_U.shape[0]:
            raise UserError(
                f"logit_attrs: the stack's last dimension is {residual_stack.shape[-1]}, but "
                f"W_U expects d_model={readout.W_U.shape[0]}."
            )
        directions = logit_directions(readout, tokens, incorrect_tokens, like=residual_stack)
        token_shape = tuple(directions.shape[:-1])
        target = tuple(residual_stack.shape[1:-1])
        if token_shape and (
            len(token_shape) != len(target) or not broadcasts_to(token_shape, target)
        ):
            raise UserError(
                f"logit_attrs: tokens of shape {token_shape} do not fit the stack's "
                f"[batch, pos] dimensions {target}; pass one id, or ids shaped like those "
                "dimensions (an int pos_slice drops the pos dimension)."
            )
        normalized = self.apply_ln_to_stack(
            residual_stack, None, pos_slice=pos_slice, has_batch_dim=has_batch_dim
        )
        return (normalized * directions).sum(dim=-1)

    @overload
    def logit_lens(
        self,
        layer: int | None = ...,
        *,
        incl_mid: bool = ...,
        pos_slice: PosSlice = ...,
        return_labels: Literal[False] = ...,
    ) -> torch.Tensor: ...

    @overload
    def logit_lens(
        self,
        layer: int | None = ...,
        *,
        incl_mid: bool = ...,
        pos_slice: PosSlice = ...,
        return_labels: Literal[True],
    ) -> tuple[torch.Tensor, list[str]]: ...

    def logit_lens(
        self,
        layer: int | None = None,
        *,
        incl_mid: bool = False,
        pos_slice: PosSlice = None,
        return_labels: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, list[str]]:
        """Read each accumulated residual (``accumulated_resid``) out through the unembedding.

        Every entry goes through the full final norm with its own statistics (not the cached
        final scale), the norm's weight and bias, ``W_U``, ``b_U`` and soft-capping, so the
        ``"final_post"`` entry reproduces the model's logits.

        Args:
            layer: As in ``accumulated_resid``.
            incl_mid: Include mid residuals.
            pos_slice: Positions to keep (an ``int`` drops the position dimension), within
                each prompt on a ragged cache.
            return_labels: Also return the labels.

        Returns:
            ``[component, batch, pos, d_vocab]`` logits, and the labels if asked.

        Raises:
            UserError: No readout, or a needed hook is not cached.
        """
        readout = self._require_readout("logit_lens")
        stack, labels = self.accumulated_resid(
            layer, incl_mid=incl_mid, pos_slice=pos_slice, return_labels=True
        )
        logits = readout_logits(stack, readout)
        return (logits, labels) if return_labels else logits
