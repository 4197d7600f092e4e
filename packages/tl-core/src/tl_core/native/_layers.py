"""Building blocks of the native transformer: norms, rotary, attention and MLP.

Parameters are stored in TransformerLens shapes (``W_Q`` is ``[n_heads, d_model, d_head]``
and so on) so the model's weight accessors are plain stacks, and every intermediate tensor
passes through a ``HookPoint`` whose returned value is the one used downstream.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tl_core.hooks._hook_point import HookPoint, only_rerouted
from tl_core.native._config import NativeConfig

__all__ = [
    "MLP",
    "Attention",
    "AttentionContext",
    "Norm",
    "WeightInit",
    "activation",
    "apply_rotary",
    "build_attention_context",
    "rotary_cos_sin",
]


class WeightInit:
    """Fills weights from one private generator, in the order the model asks.

    Values are drawn on the CPU and copied in, so the result depends only on the seed and
    the call order, not on the global RNG or the default device.
    """

    def __init__(self, seed: int, mode: str) -> None:
        self.mode = mode
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed)

    @torch.no_grad()
    def weight(self, param: torch.Tensor, fan_in: int, fan_out: int) -> None:
        """Draw ``param`` from a zero-mean normal whose std depends on the init mode."""
        std = math.sqrt(2.0 / (fan_in + fan_out)) if self.mode == "xavier_normal" else 0.02
        values = torch.randn(param.shape, generator=self.generator, dtype=torch.float32)
        param.copy_(values * std)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP activation called ``name`` (one of ``NativeConfig.act_fn``'s choices)."""
    if name == "gelu":
        return F.gelu
    if name == "gelu_new":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu
    return F.silu


def _optional_param(shape: tuple[int, ...], present: bool) -> nn.Parameter | None:
    return nn.Parameter(torch.zeros(shape)) if present else None


class Norm(nn.Module):
    """LayerNorm (``"LN"``) or RMSNorm (``"RMS"``) with the four canonical hooks.

    ``hook_scale`` is ``sqrt(var + eps)`` (LN, biased variance) or ``sqrt(mean(x^2) + eps)``
    (RMS), shape ``[b, p, 1]``; ``hook_normalized`` is the value before the weight (and
    bias); ``hook_out`` is after. A model without norms gets the identity: no parameters
    and only ``hook_in`` where the site exists without a norm (``ln2.hook_in``, the residual
    stream between attention and MLP).
    """

    def __init__(self, cfg: NativeConfig, *, input_site: bool = False) -> None:
        super().__init__()
        self.kind = cfg.normalization_type
        self.eps = cfg.eps
        self.w: nn.Parameter | None = None
        self.b: nn.Parameter | None = None
        self.hook_in: HookPoint | None = HookPoint() if self.kind or input_site else None
        if self.kind is None:
            return
        self.w = nn.Parameter(torch.ones(cfg.d_model))
        self.b = _optional_param((cfg.d_model,), self.kind == "LN")
        self.hook_scale = HookPoint()
        self.hook_normalized = HookPoint()
        self.hook_out = HookPoint()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Fire ``hook_in`` on ``x``, then normalise it."""
        return self.normalize(self.hook_in(x) if self.hook_in is not None else x)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        """The same normalisation over the last axis of any shape, firing no hook (per-head
        input copies are normalised with it)."""
        if self.kind is None:
            return x
        assert self.w is not None  # every norm kind has a weight
        if self.kind == "LN":
            x = x - x.mean(dim=-1, keepdim=True)
        out = x / (x.pow(2).mean(dim=-1, keepdim=True) + self.eps).sqrt() * self.w
        return out if self.b is None else out + self.b

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise a value whose ``hook_in`` has already fired (see ``ln2`` in a block)."""
        if self.kind is None:
            return x
        if self.kind == "LN":
            x = x - x.mean(dim=-1, keepdim=True)
        scale = self.hook_scale((x.pow(2).mean(dim=-1, keepdim=True) + self.eps).sqrt())
        normalized = self.hook_normalized(x / scale)
        out = normalized * self.w
        if self.b is not None:
            out = out + self.b
        hooked: torch.Tensor = self.hook_out(out)
        return hooked


def rotary_cos_sin(
    position_ids: torch.Tensor, d_head: int, base: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines for rotate-half rotary embeddings.

    Args:
        position_ids: ``[b, p]`` integer positions.
        d_head: Head width (even).
        base: Frequency base.

    Returns:
        ``(cos, sin)``, each float32 ``[b, p, 1, d_head]`` (broadcasts over heads).
    """
    exponents = torch.arange(0, d_head, 2, device=position_ids.device, dtype=torch.float32)
    inv_freq = 1.0 / (base ** (exponents / d_head))
    angles = position_ids.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[b, p, h, d_head]``) by position, GPT-NeoX/Llama rotate-half style."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def _per_position(point: HookPoint, table: torch.Tensor) -> torch.Tensor:
    """Fire a ``b p r`` hook on a rotary table kept as ``[b, p, 1, r]`` (head-broadcast)."""
    if not point.has_hooks:
        return table
    fired: torch.Tensor = point(table[:, :, 0])
    return fired[:, :, None]


@dataclass(frozen=True)
class AttentionContext:
    """Per-forward attention inputs shared by every block.

    Attributes:
        mask: Bool ``[b or 1, 1, q, k]``, True where a query may attend to a key.
        row_valid: Bool ``[b, 1, q, 1]``: whether a query has any key to attend to (left
            padding leaves some without); ``None`` when every row has one.
        sdpa_mask: The mask handed to SDPA (fully masked rows opened up, to avoid NaNs,
            and zeroed afterwards); ``None`` means plain causal (``is_causal=True``).
        cos: Rotary cosines ``[b, p, 1, d_head]`` or ``None`` without rotary.
        sin: Rotary sines, like ``cos``.
    """

    mask: torch.Tensor
    row_valid: torch.Tensor | None
    sdpa_mask: torch.Tensor | None
    cos: torch.Tensor | None
    sin: torch.Tensor | None


def build_attention_context(
    seq_len: int,
    device: torch.device,
    attention_mask: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
) -> AttentionContext:
    """Combine the causal mask with an optional key padding mask.

    Args:
        seq_len: Sequence length (queries = keys; there is no key/value cache).
        device: Where the masks live.
        attention_mask: Bool ``[b, p]``, True for real tokens, or ``None``.
        cos: Rotary cosines or ``None``.
        sin: Rotary sines or ``None``.

    Returns:
        The context.
    """
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    if attention_mask is None:
        return AttentionContext(causal[None, None], None, None, cos, sin)
    mask = causal[None, None] & attention_mask[:, None, None, :]
    row_valid = mask.any(dim=-1, keepdim=True)
    return AttentionContext(mask, row_valid, mask | ~row_valid, cos, sin)


class Attention(nn.Module):
    """Causal multi-head attention with optional grouped-query heads and rotary.

    Runs ``scaled_dot_product_attention`` unless ``hook_attn_scores`` or ``hook_pattern``
    has a hook; then it computes scores, mask, softmax and ``pattern @ v`` explicitly. A
    query with no key to attend to (left padding) gets an all-zero pattern on both paths.
    """

    def __init__(self, cfg: NativeConfig) -> None:
        super().__init__()
        n_heads, n_kv, d_model, d_head = cfg.n_heads, cfg.kv_heads, cfg.d_model, cfg.d_head
        self.n_heads = n_heads
        self.n_kv_heads = n_kv
        self.d_head = d_head
        self.scale = 1.0 / math.sqrt(d_head)
        self.W_Q = nn.Parameter(torch.empty(n_heads, d_model, d_head))
        self.W_K = nn.Parameter(torch.empty(n_kv, d_model, d_head))
        self.W_V = nn.Parameter(torch.empty(n_kv, d_model, d_head))
        self.W_O = nn.Parameter(torch.empty(n_heads, d_head, d_model))
        self.b_Q = _optional_param((n_heads, d_head), cfg.has_bias)
        self.b_K = _optional_param((n_kv, d_head), cfg.has_bias)
        self.b_V = _optional_param((n_kv, d_head), cfg.has_bias)
        self.b_O = _optional_param((d_model,), cfg.has_bias)
        self.rotary = cfg.positional_embedding_type == "rotary"
        self.hook_q_input = HookPoint()
        self.hook_k_input = HookPoint()
        self.hook_v_input = HookPoint()
        self.hook_in = HookPoint()
        self.hook_q = HookPoint()
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        if self.rotary:
            self.hook_cos = HookPoint()
            self.hook_sin = HookPoint()
            self.hook_rot_q = HookPoint()
            self.hook_rot_k = HookPoint()
        self.hook_attn_scores = HookPoint()
        self.hook_pattern = HookPoint()
        self.hook_z = HookPoint()
        self.hook_result = HookPoint() if cfg.use_attn_result else None
        self.hook_out = HookPoint()

    def reset_parameters(self, init: WeightInit) -> None:
        """Draw the projection weights (biases stay zero)."""
        d_model = self.W_Q.shape[1]
        init.weight(self.W_Q, d_model, self.n_heads * self.d_head)
        init.weight(self.W_K, d_model, self.n_kv_heads * self.d_head)
        init.weight(self.W_V, d_model, self.n_kv_heads * self.d_head)
        init.weight(self.W_O, self.n_heads * self.d_head, d_model)

    @staticmethod
    def _project(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        out = torch.einsum("bpd,hde->bphe", x, w)
        return out if b is None else out + b

    def _split(
        self,
        point: HookPoint,
        resid: torch.Tensor,
        norm: Callable[[torch.Tensor], torch.Tensor],
        w: torch.Tensor,
        b: torch.Tensor | None,
    ) -> torch.Tensor:
        """Project each head from its own normalised copy of the block input."""
        copies = point(resid[:, :, None, :].expand(-1, -1, w.shape[0], -1).clone())
        out = torch.einsum("bphd,hde->bphe", norm(copies), w)
        return out if b is None else out + b

    def forward(
        self,
        x: torch.Tensor,
        ctx: AttentionContext,
        split: tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Attend over ``x`` (``[b, p, d_model]``, the ``ln1`` output); returns ``[b, p, d]``.

        With ``split = (ln1's input, ln1's plain normalisation)`` each head reads its own
        copy of the block input (as ``ln1.hook_in`` left it) instead (``hook_q_input``/``hook_k_input``/``hook_v_input``).
        """
        x = self.hook_in(x)
        if split is None:
            q = self.hook_q(self._project(x, self.W_Q, self.b_Q))
            k = self.hook_k(self._project(x, self.W_K, self.b_K))
            v = self.hook_v(self._project(x, self.W_V, self.b_V))
        else:
            resid, norm = split
            q = self.hook_q(self._split(self.hook_q_input, resid, norm, self.W_Q, self.b_Q))
            k = self.hook_k(self._split(self.hook_k_input, resid, norm, self.W_K, self.b_K))
            v = self.hook_v(self._split(self.hook_v_input, resid, norm, self.W_V, self.b_V))
        if self.rotary:
            assert ctx.cos is not None and ctx.sin is not None
            cos = _per_position(self.hook_cos, ctx.cos)
            sin = _per_position(self.hook_sin, ctx.sin)
            q = self.hook_rot_q(apply_rotary(q, cos, sin))
            k = self.hook_rot_k(apply_rotary(k, cos, sin))
        if self.hook_attn_scores.has_hooks or self.hook_pattern.has_hooks:
            z, rerouted = self._explicit(q, k, v, ctx)
            if rerouted:
                # The hooks handed on equal values and only change the gradient (relevance
                # rules, probes): keep the fused kernel's bits, the explicit path's gradient.
                z = self._fused(q, k, v, ctx).detach() + (z - z.detach())
        else:
            z = self._fused(q, k, v, ctx)
        z = self.hook_z(z)
        if self.hook_result is not None:
            result = self.hook_result(torch.einsum("bphe,hed->bphd", z, self.W_O))
            out = result.sum(dim=2)
        else:
            out = z.flatten(2) @ self.W_O.flatten(0, 1)
        if self.b_O is not None:
            out = out + self.b_O
        hooked: torch.Tensor = self.hook_out(out)
        return hooked

    def _explicit(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext
    ) -> tuple[torch.Tensor, bool]:
        """``(z, rerouted)``: rerouted when a hook returned a new tensor of equal value."""
        group = self.n_heads // self.n_kv_heads
        if group > 1:
            k = k.repeat_interleave(group, dim=2)
            v = v.repeat_interleave(group, dim=2)
        scores = torch.einsum("bqhe,bkhe->bhqk", q, k) * self.scale
        masked = scores.masked_fill(~ctx.mask, float("-inf"))
        scores = self.hook_attn_scores(masked)
        # At least float32 (half-precision models), and float64 models keep their precision.
        softmax_dtype = torch.promote_types(scores.dtype, torch.float32)
        if ctx.row_valid is None:
            pattern = F.softmax(scores, dim=-1, dtype=softmax_dtype)
        else:
            # A row of only -inf would softmax to NaN, and NaN * 0 still poisons pattern @ v.
            safe = scores.masked_fill(~ctx.row_valid, 0.0)
            pattern = F.softmax(safe, dim=-1, dtype=softmax_dtype)
            pattern = pattern.masked_fill(~ctx.row_valid, 0.0)
        computed = pattern.to(q.dtype)
        pattern = self.hook_pattern(computed)
        z = torch.einsum("bhqk,bkhe->bqhe", pattern, v)
        return z, only_rerouted((masked, scores), (computed, pattern))

    def _fused(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        gqa = self.n_heads != self.n_kv_heads
        if ctx.sdpa_mask is None:
            out = F.scaled_dot_product_attention(
                qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=gqa
            )
        else:
            out = F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=ctx.sdpa_mask, scale=self.scale, enable_gqa=gqa
            )
            if ctx.row_valid is not None:
                out = out.masked_fill(~ctx.row_valid, 0.0)
        return out.transpose(1, 2)


class MLP(nn.Module):
    """Two-layer MLP, optionally gated (``act(x @ W_gate) * (x @ W_in + b_in)``).

    ``hook_pre`` is the activation's input (the gate projection when gated),
    ``hook_pre_linear`` the up projection (gated only), ``hook_post`` the hidden value fed
    to ``W_out``. A gated MLP has no gate bias.
    """

    def __init__(self, cfg: NativeConfig) -> None:
        super().__init__()
        d_model, d_mlp = cfg.d_model, cfg.d_mlp
        self.gated = cfg.gated_mlp
        self.act = activation(cfg.act_fn)
        self.W_in = nn.Parameter(torch.empty(d_model, d_mlp))
        self.b_in = _optional_param((d_mlp,), cfg.has_bias)
        self.W_gate = nn.Parameter(torch.empty(d_model, d_mlp)) if self.gated else None
        self.W_out = nn.Parameter(torch.empty(d_mlp, d_model))
        self.b_out = _optional_param((d_model,), cfg.has_bias)
        self.hook_in = HookPoint()
        self.hook_pre = HookPoint()
        if self.gated:
            self.hook_pre_linear = HookPoint()
        self.hook_post = HookPoint()
        self.hook_out = HookPoint()

    def reset_parameters(self, init: WeightInit) -> None:
        """Draw the weights (biases stay zero)."""
        d_model, d_mlp = self.W_in.shape
        init.weight(self.W_in, d_model, d_mlp)
        if self.W_gate is not None:
            init.weight(self.W_gate, d_model, d_mlp)
        init.weight(self.W_out, d_mlp, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``x`` (``[b, p, d_model]``, the ``ln2`` output)."""
        x = self.hook_in(x)
        up = x @ self.W_in
        if self.b_in is not None:
            up = up + self.b_in
        if self.W_gate is not None:
            pre = self.hook_pre(x @ self.W_gate)
            linear = self.hook_pre_linear(up)
            post = self.hook_post(self.act(pre) * linear)
        else:
            pre = self.hook_pre(up)
            post = self.hook_post(self.act(pre))
        out = post @ self.W_out
        if self.b_out is not None:
            out = out + self.b_out
        hooked: torch.Tensor = self.hook_out(out)
        return hooked
