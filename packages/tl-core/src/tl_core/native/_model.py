"""``NativeTransformer``: a small decoder-only transformer whose hook sites are HookPoints."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from tl_core._errors import ConfigError, UnsupportedFeatureError, UserError
from tl_core.cache._readout import ModelReadout
from tl_core.driver_api._request import partial_layers
from tl_core.hooks._hook_point import HookPoint
from tl_core.hooks._model_info import ModelInfo
from tl_core.native._config import NativeConfig
from tl_core.native._layers import (
    MLP,
    Attention,
    AttentionContext,
    Norm,
    WeightInit,
    build_attention_context,
    rotary_cos_sin,
)

__all__ = ["Embed", "NativeTransformer", "PosEmbed", "TransformerBlock", "Unembed"]


class Embed(nn.Module):
    """Token embedding ``W_E`` (``[d_vocab, d_model]``); ``hook_out`` sees ``W_E[ids]``."""

    def __init__(self, cfg: NativeConfig) -> None:
        super().__init__()
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model))
        self.hook_in = HookPoint()
        self.hook_out = HookPoint()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Look up the embeddings of ``input_ids`` (``[b, p]``)."""
        out: torch.Tensor = self.hook_out(self.W_E[self.hook_in(input_ids)])
        return out


class PosEmbed(nn.Module):
    """Learned positional embedding ``W_pos`` (``[n_ctx, d_model]``)."""

    def __init__(self, cfg: NativeConfig) -> None:
        super().__init__()
        self.W_pos = nn.Parameter(torch.empty(cfg.n_ctx, cfg.d_model))
        self.hook_in = HookPoint()
        self.hook_out = HookPoint()

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Look up the embeddings of ``position_ids`` (``[b, p]``)."""
        out: torch.Tensor = self.hook_out(self.W_pos[self.hook_in(position_ids)])
        return out


class Unembed(nn.Module):
    """Unembedding ``W_U`` (``[d_model, d_vocab]``, absent when tied) and bias ``b_U``."""

    def __init__(self, cfg: NativeConfig) -> None:
        super().__init__()
        tied = cfg.tie_word_embeddings
        self.W_U = None if tied else nn.Parameter(torch.empty(cfg.d_model, cfg.d_vocab))
        self.b_U = nn.Parameter(torch.zeros(cfg.d_vocab)) if cfg.has_bias else None
        self.hook_out = HookPoint()

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Map ``x`` (``[b, p, d_model]``) to logits with ``weight`` (``[d_model, d_vocab]``)."""
        logits = x @ weight
        if self.b_U is not None:
            logits = logits + self.b_U
        out: torch.Tensor = self.hook_out(logits)
        return out


_SPLIT_INPUTS = ("attn.hook_q_input", "attn.hook_k_input", "attn.hook_v_input")


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(ln1(x))``, then ``+ mlp(ln2(.))``.

    ``ln2.hook_in`` is the residual stream after attention (``hook_resid_mid``): an edit
    there changes the residual stream itself, not only the MLP's input.
    """

    def __init__(self, cfg: NativeConfig) -> None:
        super().__init__()
        self.hook_in = HookPoint()
        self.ln1 = Norm(cfg)
        self.attn = Attention(cfg)
        self.ln2 = Norm(cfg, input_site=True)  # ln2.hook_in is resid_mid, norm or not
        self.mlp = MLP(cfg)
        self.hook_out = HookPoint()
        #: Whether each head reads its own copy of the block input (see ``Attention``).
        self.split_qkv_input = cfg.use_split_qkv_input

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """Run the block on the residual stream ``x`` (``[b, p, d_model]``)."""
        x = self.hook_in(x)
        if self.split_qkv_input:
            # The heads copy ln1's input after ln1.hook_in fired, so an edit there still
            # reaches attention (as it does without split, and as the hf driver does).
            ln_in = self.ln1.hook_in(x) if self.ln1.hook_in is not None else x
            attended = self.attn(self.ln1.normalize(ln_in), ctx, (ln_in, self.ln1.plain))
        else:
            attended = self.attn(self.ln1(x), ctx)
        mid = x + attended
        assert self.ln2.hook_in is not None
        mid = self.ln2.hook_in(mid)
        out: torch.Tensor = self.hook_out(mid + self.mlp(self.ln2.normalize(mid)))
        return out


class NativeTransformer(nn.Module):
    """A randomly initialised decoder-only transformer in plain torch.

    Every canonical hook site is a ``HookPoint`` reached through the module tree, so
    ``dict(model.named_modules())["blocks.0.attn.hook_q"]`` is the HookPoint of that name.
    Weights are drawn from a private generator seeded with ``cfg.seed``: two models with
    the same config have identical weights whatever the global RNG state.

    Attributes:
        cfg: The configuration.
        info: The ``ModelInfo`` derived from ``cfg``.
        hook_points: Canonical name to ``HookPoint`` (each ``HookPoint.name`` set).
        embed: The token embedding.
        pos_embed: The learned position embedding, or ``None`` (rotary or no positions).
        blocks: The transformer blocks, in order.
        ln_final: The final norm.
        unembed: The unembedding.
    """

    def __init__(self, cfg: NativeConfig) -> None:
        """Build and initialise the model.

        Args:
            cfg: The configuration.

        Raises:
            ConfigError: ``cfg`` is not a ``NativeConfig`` (use ``NativeConfig.coerce``).
        """
        super().__init__()
        if not isinstance(cfg, NativeConfig):
            raise ConfigError(
                f"NativeTransformer takes a NativeConfig, got {type(cfg).__name__}; "
                "build one with NativeConfig.coerce(mapping)."
            )
        self.cfg = cfg
        self.info: ModelInfo = cfg.to_model_info()
        self.embed = Embed(cfg)
        self.pos_embed = PosEmbed(cfg) if cfg.positional_embedding_type == "standard" else None
        self.blocks = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.ln_final = Norm(cfg)
        self.unembed = Unembed(cfg)
        self._reset_parameters()
        self._hook_points: dict[str, HookPoint] = {}
        for name, module in self.named_modules():
            if isinstance(module, HookPoint):
                module.name = name
                self._hook_points[name] = module

    @property
    def all_hook_points(self) -> Mapping[str, HookPoint]:
        """Canonical name -> HookPoint of every site, the per-head q/k/v inputs whether on or
        off (one mapping for the model's life)."""
        return self._hook_points

    @property
    def hook_points(self) -> dict[str, HookPoint]:
        """Canonical name -> HookPoint of every site that fires (the per-head q/k/v inputs
        only while they are on)."""
        if self.split_qkv_input:
            return dict(self._hook_points)
        return {n: p for n, p in self._hook_points.items() if not n.endswith(_SPLIT_INPUTS)}

    @property
    def split_qkv_input(self) -> bool:
        """Whether each attention head reads its own copy of the block input."""
        return any(block.split_qkv_input for block in self._block_list())

    def set_use_split_qkv_input(self, enabled: bool) -> None:
        """Give each attention head its own copy of the block input, or stop."""
        for block in self._block_list():
            block.split_qkv_input = enabled

    def _reset_parameters(self) -> None:
        cfg = self.cfg
        init = WeightInit(cfg.seed, cfg.init_mode)
        init.weight(self.embed.W_E, cfg.d_vocab, cfg.d_model)
        if self.pos_embed is not None:
            init.weight(self.pos_embed.W_pos, cfg.n_ctx, cfg.d_model)
        for block in self._block_list():
            block.attn.reset_parameters(init)
            block.mlp.reset_parameters(init)
        if self.unembed.W_U is not None:
            init.weight(self.unembed.W_U, cfg.d_model, cfg.d_vocab)

    def _block_list(self) -> list[TransformerBlock]:
        return [block for block in self.blocks if isinstance(block, TransformerBlock)]

    def forward(
        self,
        input_ids: torch.Tensor | None,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        start_at_layer: int | None = None,
        stop_at_layer: int | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the model, or a slice of its blocks.

        Args:
            input_ids: Token ids ``[b, p]``; may be ``None`` when ``start_at_layer`` is set.
            attention_mask: ``[b, p]``, 1 for real tokens and 0 for padding (left or
                right); padded keys are masked out.
            position_ids: ``[b, p]`` or ``[p]``. Default: ``cumsum(attention_mask) - 1``
                clamped at 0 when a mask is given, else ``arange(p)``.
            start_at_layer: Start at this block with ``residual`` as its input instead
                of embedding ``input_ids``; negative counts from the end.
            stop_at_layer: Return the residual stream entering this block (``n_layers``:
                the final residual before ``ln_final``); negative counts from the end.
            residual: ``[b, p, d_model]``, the input of block ``start_at_layer``.

        Returns:
            Logits ``[b, p, d_vocab]``, or the residual ``[b, p, d_model]`` when
            ``stop_at_layer`` is set.

        Raises:
            UserError: Inputs of the wrong shape, dtype or range.
        """
        start, stop = partial_layers(
            start_at_layer, stop_at_layer, residual, n_layers=self.cfg.n_layers
        )
        if start is None:
            input_ids = self._check_input_ids(input_ids)
        return self.run_blocks(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            start=start,
            stop=stop,
            residual=residual,
        )

    def run_blocks(
        self,
        input_ids: torch.Tensor | None,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        start: int | None = None,
        stop: int | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``forward`` for callers that checked the ids and resolved the block indices.

        Args:
            input_ids: In-range token ids ``[b, p]`` (``None`` when starting from
                ``residual``).
            attention_mask: As in ``forward``.
            position_ids: As in ``forward``.
            start: Block index in ``0..n_layers`` that reads ``residual``; ``None``: embed.
            stop: Block index in ``start..n_layers`` to stop before; ``None``: run to logits.
            residual: The input of block ``start``.

        Raises:
            UserError: A residual or mask of the wrong shape, a sequence past ``n_ctx``.
        """
        ids: torch.Tensor | None = None
        if start is None:
            assert input_ids is not None
            ids = input_ids
            batch, seq = ids.shape
            device = ids.device
        else:
            x = self._check_residual(residual, input_ids)
            batch, seq = x.shape[:2]
            device = x.device
        if seq == 0 or seq > self.cfg.n_ctx:
            raise UserError(
                f"Sequence length must be between 1 and n_ctx={self.cfg.n_ctx}, got {seq}."
            )
        mask = self._check_attention_mask(attention_mask, batch, seq, device)
        positions = self._positions(position_ids, mask, batch, seq, device)
        ctx = self._attention_context(positions, mask, seq, device)
        if ids is not None:
            x = self.embed(ids)
            if self.pos_embed is not None:
                x = x + self.pos_embed(positions)
        for block in self._block_list()[start or 0 : stop]:
            x = block(x, ctx)
        if stop is not None:
            return x
        logits: torch.Tensor = self.unembed(self.ln_final(x), self.W_U)
        return logits

    def _check_input_ids(self, input_ids: torch.Tensor | None) -> torch.Tensor:
        if input_ids is None:
            raise UserError(
                "input_ids is None; pass token ids [batch, pos], or start_at_layer with residual."
            )
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
            found = input_ids.shape if isinstance(input_ids, torch.Tensor) else type(input_ids)
            raise UserError(f"input_ids must be a 2-D tensor [batch, pos], got {found}.")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex:
            raise UserError(f"input_ids must hold integers, got dtype {input_ids.dtype}.")
        if input_ids.numel() and (
            int(input_ids.min()) < 0 or int(input_ids.max()) >= self.cfg.d_vocab
        ):
            raise UserError(
                f"input_ids must lie in [0, {self.cfg.d_vocab}) (d_vocab), got values from "
                f"{int(input_ids.min())} to {int(input_ids.max())}."
            )
        return input_ids

    def _check_residual(
        self, residual: torch.Tensor | None, input_ids: torch.Tensor | None
    ) -> torch.Tensor:
        d_model = self.cfg.d_model
        if residual is None:
            raise UserError(
                "start_at_layer needs residual: the [batch, pos, d_model] input of that block."
            )
        if residual.ndim != 3 or residual.shape[-1] != d_model:
            raise UserError(
                f"residual must have shape [batch, pos, {d_model}], got {tuple(residual.shape)}."
            )
        if input_ids is not None and tuple(input_ids.shape) != tuple(residual.shape[:2]):
            raise UserError(
                f"input_ids shape {tuple(input_ids.shape)} does not match residual's "
                f"[batch, pos] {tuple(residual.shape[:2])}."
            )
        return residual

    @staticmethod
    def _check_attention_mask(
        attention_mask: torch.Tensor | None, batch: int, seq: int, device: torch.device
    ) -> torch.Tensor | None:
        if attention_mask is None:
            return None
        if tuple(attention_mask.shape) != (batch, seq):
            raise UserError(
                f"attention_mask must have shape [batch, pos] = {(batch, seq)}, got "
                f"{tuple(attention_mask.shape)}."
            )
        return attention_mask.to(device=device) != 0

    def _positions(
        self,
        position_ids: torch.Tensor | None,
        mask: torch.Tensor | None,
        batch: int,
        seq: int,
        device: torch.device,
    ) -> torch.Tensor:
        if position_ids is None:
            if mask is None:
                return torch.arange(seq, device=device).expand(batch, seq)
            return (mask.long().cumsum(dim=-1) - 1).clamp(min=0)
        if position_ids.dtype.is_floating_point or position_ids.dtype.is_complex:
            raise UserError(f"position_ids must hold integers, got dtype {position_ids.dtype}.")
        if tuple(position_ids.shape) not in ((batch, seq), (seq,)):
            raise UserError(
                f"position_ids must have shape [batch, pos] = {(batch, seq)} or [pos] = "
                f"{(seq,)}, got {tuple(position_ids.shape)}."
            )
        positions = position_ids.to(device=device).expand(batch, seq)
        if self.pos_embed is not None and (
            int(positions.min()) < 0 or int(positions.max()) >= self.cfg.n_ctx
        ):
            raise UserError(
                f"position_ids must lie in [0, {self.cfg.n_ctx}) (n_ctx) for learned "
                f"positional embeddings, got values from {int(positions.min())} to "
                f"{int(positions.max())}."
            )
        return positions

    def _attention_context(
        self, positions: torch.Tensor, mask: torch.Tensor | None, seq: int, device: torch.device
    ) -> AttentionContext:
        cos = sin = None
        if self.cfg.positional_embedding_type == "rotary":
            cos, sin = rotary_cos_sin(positions, self.cfg.d_head, self.cfg.rotary_base)
        return build_attention_context(seq, device, mask, cos, sin)

    # Weight accessors, in HookedTransformer shapes.

    def _stack(self, get: str, owner: str) -> torch.Tensor:
        return torch.stack([getattr(getattr(b, owner), get) for b in self._block_list()])

    def _stack_or_zeros(self, get: str, owner: str, shape: tuple[int, ...]) -> torch.Tensor:
        blocks = self._block_list()
        if getattr(getattr(blocks[0], owner), get) is not None:
            return self._stack(get, owner)
        ref = self.embed.W_E
        return torch.zeros((len(blocks), *shape), dtype=ref.dtype, device=ref.device)

    @property
    def W_E(self) -> torch.Tensor:
        """Token embedding ``[d_vocab, d_model]``."""
        return self.embed.W_E

    @property
    def W_pos(self) -> torch.Tensor:
        """Learned positional embedding ``[n_ctx, d_model]`` (standard positions only)."""
        if self.pos_embed is None:
            raise UnsupportedFeatureError(
                "W_pos exists only with positional_embedding_type='standard'; this model "
                f"uses {self.cfg.positional_embedding_type!r} positions."
            )
        return self.pos_embed.W_pos

    @property
    def W_Q(self) -> torch.Tensor:
        """Query weights ``[n_layers, n_heads, d_model, d_head]``."""
        return self._stack("W_Q", "attn")

    @property
    def W_K(self) -> torch.Tensor:
        """Key weights ``[n_layers, n_key_value_heads, d_model, d_head]``."""
        return self._stack("W_K", "attn")

    @property
    def W_V(self) -> torch.Tensor:
        """Value weights ``[n_layers, n_key_value_heads, d_model, d_head]``."""
        return self._stack("W_V", "attn")

    @property
    def W_O(self) -> torch.Tensor:
        """Output weights ``[n_layers, n_heads, d_head, d_model]``."""
        return self._stack("W_O", "attn")

    @property
    def b_Q(self) -> torch.Tensor:
        """Query biases ``[n_layers, n_heads, d_head]`` (zeros without biases)."""
        return self._stack_or_zeros("b_Q", "attn", (self.cfg.n_heads, self.cfg.d_head))

    @property
    def b_K(self) -> torch.Tensor:
        """Key biases ``[n_layers, n_key_value_heads, d_head]`` (zeros without biases)."""
        return self._stack_or_zeros("b_K", "attn", (self.cfg.kv_heads, self.cfg.d_head))

    @property
    def b_V(self) -> torch.Tensor:
        """Value biases ``[n_layers, n_key_value_heads, d_head]`` (zeros without biases)."""
        return self._stack_or_zeros("b_V", "attn", (self.cfg.kv_heads, self.cfg.d_head))

    @property
    def b_O(self) -> torch.Tensor:
        """Attention output biases ``[n_layers, d_model]`` (zeros without biases)."""
        return self._stack_or_zeros("b_O", "attn", (self.cfg.d_model,))

    @property
    def W_in(self) -> torch.Tensor:
        """MLP input (up) weights ``[n_layers, d_model, d_mlp]``."""
        return self._stack("W_in", "mlp")

    @property
    def W_gate(self) -> torch.Tensor:
        """MLP gate weights ``[n_layers, d_model, d_mlp]`` (gated MLPs only)."""
        if not self.cfg.gated_mlp:
            raise UnsupportedFeatureError(
                "W_gate exists only with gated_mlp=True; this model's MLP is not gated."
            )
        return self._stack("W_gate", "mlp")

    @property
    def W_out(self) -> torch.Tensor:
        """MLP output weights ``[n_layers, d_mlp, d_model]``."""
        return self._stack("W_out", "mlp")

    @property
    def b_in(self) -> torch.Tensor:
        """MLP input biases ``[n_layers, d_mlp]`` (zeros without biases)."""
        return self._stack_or_zeros("b_in", "mlp", (self.cfg.d_mlp,))

    @property
    def b_out(self) -> torch.Tensor:
        """MLP output biases ``[n_layers, d_model]`` (zeros without biases)."""
        return self._stack_or_zeros("b_out", "mlp", (self.cfg.d_model,))

    @property
    def W_U(self) -> torch.Tensor:
        """Unembedding ``[d_model, d_vocab]`` (``W_E.T`` when embeddings are tied)."""
        if self.unembed.W_U is None:
            return self.embed.W_E.T
        return self.unembed.W_U

    @property
    def b_U(self) -> torch.Tensor:
        """Unembedding bias ``[d_vocab]`` (zeros without biases)."""
        if self.unembed.b_U is None:
            return torch.zeros_like(self.embed.W_E[:, 0])
        return self.unembed.b_U

    def readout(self) -> ModelReadout:
        """The final norm and unembedding, as live (not detached) parameters."""
        return ModelReadout(
            W_U=self.W_U,
            b_U=self.unembed.b_U,
            ln_final_weight=self.ln_final.w,
            ln_final_bias=self.ln_final.b,
            normalization_type=self.cfg.normalization_type,
            eps=self.cfg.eps,
        )
