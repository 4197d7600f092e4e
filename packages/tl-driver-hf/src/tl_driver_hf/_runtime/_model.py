"""``HFHookedModel``: a transformers model plus the canonical HookPoint tree and weights.

The HookPoints live in small container modules named like the canonical hooks
(``blocks[3].attn.hook_q``), next to the wrapped model (``hf_model``); the transformers
model itself is never changed. Weight accessors read the live parameters and return them
in HookedTransformer shapes, so ``bridge.W_Q`` works as TransformerLens users expect.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from tl_core import HookPoint, ModelInfo, UnsupportedFeatureError
from tl_core.driver_api import ModelReadout
from tl_driver_hf._architecture._modules import ModelModules
from tl_driver_hf._runtime._norms import norm_eps
from tl_driver_hf._weights._shapes import (
    bias_of,
    head_weights,
    in_out,
    layer_attention_weights,
    layer_mlp_weights,
)
from tl_driver_hf.adapters import ArchitectureAdapter

__all__ = ["HFHookedModel"]


class _Node(nn.Module):
    """A named container of HookPoints and child containers."""


def _build_tree(root: nn.Module, names: Iterable[str], n_layers: int) -> dict[str, HookPoint]:
    blocks = nn.ModuleList(_Node() for _ in range(n_layers))
    root.blocks = blocks
    points: dict[str, HookPoint] = {}
    for name in names:
        *path, leaf = name.split(".")
        node: nn.Module = root
        for part in path:
            if part.isdigit():
                node = blocks[int(part)]
                continue
            if part == "blocks":
                continue
            child = node._modules.get(part)
            if child is None:
                child = _Node()
                node.add_module(part, child)
            node = child
        point = HookPoint(name)
        node.add_module(leaf, point)
        points[name] = point
    return points


class HFHookedModel(nn.Module):
    """A transformers causal LM with canonical HookPoints and HookedTransformer weights.

    Attributes:
        hf_model: The wrapped transformers model (unchanged).
        adapter: The family's ``ArchitectureAdapter``.
        info: The model's ``ModelInfo``.
        hook_points: Canonical name to HookPoint.
    """

    def __init__(
        self,
        hf_model: nn.Module,
        adapter: ArchitectureAdapter,
        info: ModelInfo,
        modules: ModelModules,
        hook_names: Iterable[str],
    ) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.adapter = adapter
        self.info = info
        self.parts = modules
        self.hook_points = _build_tree(self, hook_names, info.n_layers)
        #: Weight name -> why it is refused: certification found it does not reproduce
        #: the activations it claims to produce.
        self.refused_weights: dict[str, str] = {}

    def _refuse(self, name: str) -> None:
        reason = self.refused_weights.get(name)
        if reason is not None:
            raise UnsupportedFeatureError(f"{name} is not served on this model: {reason}")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped transformers model directly (no tl hooks fire)."""
        return self.hf_model(*args, **kwargs)

    # -- weights ----------------------------------------------------------------------

    def _stack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        # Offloaded (meta) layers have shapes but no values: the stack is then meta too.
        meta = any(t.is_meta for t in tensors)
        device = torch.device("meta") if meta else tensors[0].device
        return torch.stack([t.to(device) for t in tensors])

    def _attn(self, key: str) -> torch.Tensor:
        info = self.info
        return self._stack(
            [
                layer_attention_weights(
                    lay.q,
                    lay.k,
                    lay.v,
                    lay.qkv,
                    self.adapter.linear,
                    info.n_heads,
                    info.kv_heads,
                    info.d_head,
                    self.adapter.qkv_layout,
                )[key]
                for lay in self.parts.layers
            ]
        )

    def _mlp(self, key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if self.adapter.description.moe:
            raise UnsupportedFeatureError(
                f"{key} does not exist on {self.adapter.family!r}: its MLP is a mixture of "
                f"experts; read the expert weights from bridge.hf_model directly"
            )
        values = [
            layer_mlp_weights(
                lay.mlp_in, lay.gate, lay.up, lay.gate_up, lay.down, self.adapter.linear
            )[key]
            for lay in self.parts.layers
        ]
        if values[0] is None:
            if shape is None:
                raise UnsupportedFeatureError(
                    f"{key} exists only on gated MLPs; this {self.adapter.family!r} MLP is not gated"
                )
            ref = self.W_E
            return torch.zeros((len(values), *shape), dtype=ref.dtype, device=ref.device)
        return self._stack([v for v in values if v is not None])

    @property
    def W_E(self) -> torch.Tensor:
        """Token embedding ``[d_vocab, d_model]``, as it enters the residual stream.

        Gemma's embedding module multiplies its lookup by ``sqrt(d_model)``; ``W_E``
        includes that scale, so ``embed.hook_out == W_E[tokens]`` on every family (as
        TransformerLens serves it).
        """
        self._refuse("W_E")
        weight: torch.Tensor = self.parts.embed.weight  # type: ignore[assignment]
        if not self.adapter.description.embed_scaled:
            return weight
        scale = cast(torch.Tensor, self.parts.embed.embed_scale)
        return weight * scale.to(weight.dtype)

    @property
    def W_pos(self) -> torch.Tensor:
        """Learned position embedding ``[n_ctx, d_model]``."""
        self._refuse("W_pos")
        if self.parts.pos_embed is None:
            raise UnsupportedFeatureError(
                f"W_pos exists only with learned positions; {self.adapter.family!r} uses "
                f"{self.info.positional_embedding_type!r} positions"
            )
        weight: torch.Tensor = self.parts.pos_embed.weight  # type: ignore[assignment]
        # OPT keeps two rows before position 0; RoBERTa numbers positions after its padding id.
        first = self.adapter.pos_offset + self.adapter.position_ids_start
        return weight[first:] if first else weight

    @property
    def W_Q(self) -> torch.Tensor:
        """Query weights ``[n_layers, n_heads, d_model, d_head]``."""
        self._refuse("W_Q")
        return self._attn("W_Q")

    @property
    def W_K(self) -> torch.Tensor:
        """Key weights ``[n_layers, n_key_value_heads, d_model, d_head]``."""
        self._refuse("W_K")
        return self._attn("W_K")

    @property
    def W_V(self) -> torch.Tensor:
        """Value weights ``[n_layers, n_key_value_heads, d_model, d_head]``."""
        self._refuse("W_V")
        return self._attn("W_V")

    @property
    def b_Q(self) -> torch.Tensor:
        """Query biases ``[n_layers, n_heads, d_head]`` (zeros without biases)."""
        self._refuse("b_Q")
        return self._attn("b_Q")

    @property
    def b_K(self) -> torch.Tensor:
        """Key biases ``[n_layers, n_key_value_heads, d_head]`` (zeros without biases)."""
        self._refuse("b_K")
        return self._attn("b_K")

    @property
    def b_V(self) -> torch.Tensor:
        """Value biases ``[n_layers, n_key_value_heads, d_head]`` (zeros without biases)."""
        self._refuse("b_V")
        return self._attn("b_V")

    @property
    def W_O(self) -> torch.Tensor:
        """Output weights ``[n_layers, n_heads, d_head, d_model]``."""
        self._refuse("W_O")
        info = self.info
        return self._stack(
            [
                head_weights(lay.o, self.adapter.linear, info.n_heads, info.d_head)[0]
                for lay in self.parts.layers
            ]
        )

    @property
    def b_O(self) -> torch.Tensor:
        """Attention output biases ``[n_layers, d_model]`` (zeros without biases)."""
        self._refuse("b_O")
        biases = [bias_of(lay.o) for lay in self.parts.layers]
        if biases[0] is None:
            ref = self.W_E
            return torch.zeros(len(biases), self.info.d_model, dtype=ref.dtype, device=ref.device)
        return self._stack([b for b in biases if b is not None])

    @property
    def W_in(self) -> torch.Tensor:
        """MLP input (up) weights ``[n_layers, d_model, d_mlp]``."""
        self._refuse("W_in")
        return self._mlp("W_in")

    @property
    def W_gate(self) -> torch.Tensor:
        """MLP gate weights ``[n_layers, d_model, d_mlp]`` (gated MLPs only)."""
        self._refuse("W_gate")
        return self._mlp("W_gate")

    @property
    def W_out(self) -> torch.Tensor:
        """MLP output weights ``[n_layers, d_mlp, d_model]``."""
        self._refuse("W_out")
        return self._mlp("W_out")

    @property
    def b_in(self) -> torch.Tensor:
        """MLP input biases ``[n_layers, d_mlp]`` (zeros without biases)."""
        self._refuse("b_in")
        return self._mlp("b_in", (self.info.d_mlp,))

    @property
    def b_out(self) -> torch.Tensor:
        """MLP output biases ``[n_layers, d_model]`` (zeros without biases)."""
        self._refuse("b_out")
        return self._mlp("b_out", (self.info.d_model,))

    @property
    def W_U(self) -> torch.Tensor:
        """Unembedding ``[d_model, d_vocab]``."""
        self._refuse("W_U")
        return in_out(self.parts.lm_head, "linear")

    @property
    def b_U(self) -> torch.Tensor:
        """Unembedding bias ``[d_vocab]`` (zeros without a bias)."""
        self._refuse("b_U")
        bias = bias_of(self.parts.lm_head)
        if bias is None:
            return torch.zeros_like(self.W_U[0])
        return bias

    def readout(self) -> ModelReadout:
        """The final norm and unembedding (the family's weight rule folded into the weight)."""
        norm = self.parts.final_norm
        if self.adapter.readout_opaque:
            raise UnsupportedFeatureError(
                f"the unembedding of {self.info.architecture!r} reads a head transform (a "
                f"projection and an activation before the final norm, served as mlm_head.* "
                f"where tl found them), not one final norm, so there is no linear readout of "
                f"the residual stream to logits; unembed.hook_out holds the model's own logits"
            )
        kind = self.info.normalization_type
        if norm is not None and kind not in ("LN", "RMS"):
            raise UnsupportedFeatureError(
                f"tl did not establish the weight rule of {self.info.architecture!r}'s final "
                f"norm, so there is no readout of the residual stream to logits; "
                f"unembed.hook_out holds the model's own logits"
            )
        weight = getattr(norm, "weight", None)
        if weight is not None and self.adapter.description.norm == "rms_plus_one":
            weight = 1.0 + weight.float()
        softcap = None
        if self.adapter.description.final_softcap:
            softcap = getattr(self.hf_model.config, self.adapter.description.final_softcap, None)
        return ModelReadout(
            W_U=self.W_U,
            b_U=bias_of(self.parts.lm_head),
            ln_final_weight=weight,
            ln_final_bias=bias_of(norm) if norm is not None else None,
            normalization_type=kind if norm is not None and kind != "unknown" else None,
            eps=norm_eps(norm) if norm is not None else 1e-5,
            logit_softcap=float(softcap) if softcap is not None else None,
        )
