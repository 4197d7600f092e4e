"""``SparseDictionary``: a sparse autoencoder or transcoder as tensors, with sae-lens's math.

tl runs dictionaries inside its drivers' forward passes, so it keeps its own small copy of
the inference math sae-lens defines (encode, decode, the error term), checked against
sae-lens itself in the sae_lens nox session. sae-lens need not be installed: dictionaries
load from its on-disk format (``cfg.json`` plus ``sae_weights.safetensors``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal, TypeAlias

import torch

from tl_core._errors import ConfigError

__all__ = [
    "ARCHITECTURES",
    "NORMALIZATIONS",
    "DictionaryArchitecture",
    "Linear",
    "Normalization",
    "SparseDictionary",
]

#: ``x -> x @ W + b`` for one of a dictionary's two matrices, computed by an engine's own
#: kernel (e.g. vLLM's oneDNN GEMM on CPUs, with the weight prepacked); ``None``: torch.
Linear: TypeAlias = "Callable[[torch.Tensor], torch.Tensor] | None"

#: How features are computed from the pre-activations: ``"standard"`` (ReLU),
#: ``"jumprelu"`` (ReLU where the pre-activation exceeds a per-feature threshold) and
#: ``"topk"`` (the ``k`` largest pre-activations, ReLU'd; the rest 0).
DictionaryArchitecture = Literal["standard", "jumprelu", "topk"]
ARCHITECTURES: tuple[DictionaryArchitecture, ...] = ("standard", "jumprelu", "topk")
"""Every ``DictionaryArchitecture``."""

#: How the input is normalised before encoding and the reconstruction after decoding:
#: ``"none"``; ``"constant_norm_rescale"`` (each input scaled to norm ``sqrt(d_in)``, the
#: output scaled back); ``"layer_norm"`` (centred and divided by its standard deviation plus
#: 1e-5, undone on the output).
Normalization = Literal["none", "constant_norm_rescale", "layer_norm"]
NORMALIZATIONS: tuple[Normalization, ...] = ("none", "constant_norm_rescale", "layer_norm")
"""Every ``Normalization``."""


@dataclass(frozen=True)
class SparseDictionary:
    """A sparse autoencoder (read and write at one site) or transcoder (read at one, write
    at another), as sae-lens computes it at inference.

    Attributes:
        W_enc: Encoder ``[d_in, d_sae]``.
        b_enc: Encoder bias ``[d_sae]``.
        W_dec: Decoder ``[d_sae, d_out]``.
        b_dec: Decoder bias ``[d_out]`` (subtracted from the input first when
            ``apply_b_dec_to_input``, which needs ``d_in == d_out``).
        architecture: ``DictionaryArchitecture``.
        threshold: Per-feature thresholds ``[d_sae]`` (``"jumprelu"`` only).
        k: Features kept per token (``"topk"`` only).
        rescale_acts_by_decoder_norm: TopK dictionaries trained as if the decoder rows had
            unit norm: pre-activations are scaled by the row norms before the top k are
            taken, and divided by them again before decoding.
        apply_b_dec_to_input: Whether ``b_dec`` is subtracted from the input.
        normalize_activations: ``Normalization``.
        W_skip: A skip transcoder's linear path ``[d_out, d_in]`` (sae-lens's layout: the
            output gains ``x @ W_skip.T``), or ``None``.
        hook_name: The site the dictionary reads (sae-lens's ``metadata.hook_name``), if
            known.
        output_hook_name: The site a transcoder writes, or ``None`` for an autoencoder
            (which writes where it reads).
        flatten_heads: Whether the site is per head (``attn.hook_z``) and the dictionary reads
            its heads flattened (sae-lens's ``reshape_activations="hook_z"``).
        transcoder: Whether it writes another site than it reads (a transcoder, skip or
            not); implied by ``d_in != d_out``, ``W_skip`` or ``output_hook_name``.
    """

    W_enc: torch.Tensor
    b_enc: torch.Tensor
    W_dec: torch.Tensor
    b_dec: torch.Tensor
    architecture: DictionaryArchitecture = "standard"
    threshold: torch.Tensor | None = None
    k: int | None = None
    rescale_acts_by_decoder_norm: bool = False
    apply_b_dec_to_input: bool = True
    normalize_activations: Normalization = "none"
    W_skip: torch.Tensor | None = None
    hook_name: str | None = None
    output_hook_name: str | None = None
    flatten_heads: bool = False
    transcoder: bool = False

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigError(f"this sparse dictionary is inconsistent: {'; '.join(problems)}")

    def problems(self) -> list[str]:
        """What is inconsistent in the tensors and settings (empty when nothing is)."""
        out: list[str] = []
        if self.architecture not in ARCHITECTURES:
            out.append(f"architecture {self.architecture!r} is not one of {ARCHITECTURES}")
        if self.normalize_activations not in NORMALIZATIONS:
            out.append(
                f"normalize_activations {self.normalize_activations!r} is not one of {NORMALIZATIONS}"
            )
        if self.W_enc.dim() != 2 or self.W_dec.dim() != 2:
            return [*out, "W_enc and W_dec must be matrices"]
        d_in, d_sae = self.W_enc.shape
        if tuple(self.W_dec.shape[:1]) != (d_sae,):
            out.append(f"W_dec has {self.W_dec.shape[0]} rows, W_enc {d_sae} columns (d_sae)")
        if tuple(self.b_enc.shape) != (d_sae,):
            out.append(f"b_enc has shape {tuple(self.b_enc.shape)}, expected ({d_sae},)")
        if tuple(self.b_dec.shape) != (self.d_out,):
            out.append(f"b_dec has shape {tuple(self.b_dec.shape)}, expected ({self.d_out},)")
        if self.architecture == "jumprelu" and (
            self.threshold is None or tuple(self.threshold.shape) != (d_sae,)
        ):
            out.append(f"a jumprelu dictionary needs a threshold of shape ({d_sae},)")
        if self.architecture == "topk" and (not isinstance(self.k, int) or not 0 < self.k <= d_sae):
            out.append(f"a topk dictionary needs 0 < k <= d_sae ({d_sae}), got k={self.k!r}")
        if self.W_skip is not None and tuple(self.W_skip.shape) != (self.d_out, d_in):
            out.append(
                f"W_skip has shape {tuple(self.W_skip.shape)}, expected (d_out, d_in) = ({self.d_out}, {d_in})"
            )
        if self.is_transcoder and self.apply_b_dec_to_input:
            out.append(
                "a transcoder cannot subtract b_dec from its input (apply_b_dec_to_input must be False)"
            )
        if self.is_transcoder and self.normalize_activations != "none":
            out.append(
                "a transcoder takes no activation normalisation (sae-lens runs none on its output)"
            )
        if self.is_transcoder and self.flatten_heads:
            out.append("a transcoder cannot read heads flattened")
        return out

    def __repr__(self) -> str:
        # The tensors' shapes, not their values: a default dataclass repr prints every weight.
        parts = [f"{self.architecture!r}", f"d_in={self.d_in}", f"d_sae={self.d_sae}"]
        if self.d_out != self.d_in:
            parts.append(f"d_out={self.d_out}")
        if self.k is not None:
            parts.append(f"k={self.k}")
        flags = {
            "hook_name": self.hook_name, "output_hook_name": self.output_hook_name,
            "normalize_activations": None if self.normalize_activations == "none" else self.normalize_activations,
            "apply_b_dec_to_input": self.apply_b_dec_to_input or None,
            "rescale_acts_by_decoder_norm": self.rescale_acts_by_decoder_norm or None,
            "skip": True if self.W_skip is not None else None,
            "flatten_heads": self.flatten_heads or None, "transcoder": self.transcoder or None,
        }  # fmt: skip
        parts += [f"{key}={value!r}" for key, value in flags.items() if value is not None]
        parts.append(f"dtype={str(self.dtype).removeprefix('torch.')}")
        return f"SparseDictionary({', '.join(parts)})"

    @property
    def is_transcoder(self) -> bool:
        """Whether it writes another site than it reads."""
        return (
            self.transcoder
            or self.W_skip is not None
            or self.output_hook_name is not None
            or self.d_out != self.d_in
        )

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> SparseDictionary:
        """This dictionary with its tensors on ``device`` and/or in float ``dtype``."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype if t.is_floating_point() else None)

        return replace(
            self, W_enc=move(self.W_enc), b_enc=move(self.b_enc), W_dec=move(self.W_dec), b_dec=move(self.b_dec),
            threshold=None if self.threshold is None else move(self.threshold),
            W_skip=None if self.W_skip is None else move(self.W_skip),
        )  # fmt: skip

    @property
    def d_in(self) -> int:
        """Width the dictionary reads."""
        return int(self.W_enc.shape[0])

    @property
    def d_sae(self) -> int:
        """Number of features."""
        return int(self.W_enc.shape[1])

    @property
    def d_out(self) -> int:
        """Width the dictionary writes."""
        return int(self.W_dec.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        """The dictionary's dtype (inputs are cast to it)."""
        return self.W_enc.dtype

    def normalize(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """``x`` normalised as the dictionary expects, and what undoes it on the output."""
        if self.normalize_activations == "constant_norm_rescale":
            coeff = (self.d_in**0.5) / x.norm(dim=-1, keepdim=True)
            return x * coeff, (coeff, torch.zeros_like(coeff))
        if self.normalize_activations == "layer_norm":
            mu = x.mean(dim=-1, keepdim=True)
            centred = x - mu
            std = centred.std(dim=-1, keepdim=True)
            return centred / (std + 1e-5), (std, mu)
        return x, None

    def pre_activations(self, x: torch.Tensor, linear: Linear = None) -> torch.Tensor:
        """The encoder's pre-activations of a normalised input ``[..., d_in]`` (sae-lens's
        ``hook_sae_acts_pre``); ``linear`` computes ``x @ W_enc + b_enc`` if given."""
        if self.apply_b_dec_to_input:
            x = x - self.b_dec
        if linear is not None:
            return linear(x)
        return torch.addmm(self.b_enc, x.reshape(-1, x.shape[-1]), self.W_enc).view(
            *x.shape[:-1], -1
        )

    def activate(self, pre: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
        """Feature activations from pre-activations, by the architecture's rule.

        ``inplace`` reuses ``pre``'s memory where the rule allows (the caller owns ``pre``
        and needs it no more): on a 16x SAE over thousands of tokens that saves writing a
        fresh tensor of hundreds of megabytes.
        """
        if self.architecture == "topk" and self.rescale_acts_by_decoder_norm:
            pre = pre * self.W_dec.norm(dim=-1)
        if self.architecture == "jumprelu":
            assert self.threshold is not None
            below = pre <= self.threshold
            return (
                pre.masked_fill_(below, 0.0).relu_()
                if inplace
                else pre.masked_fill(below, 0.0).relu()
            )
        if self.architecture == "topk":
            assert self.k is not None
            values, indices = pre.topk(self.k, dim=-1, sorted=False)
            return torch.zeros_like(pre).scatter_(-1, indices, values.relu())
        return pre.relu_() if inplace else pre.relu()

    def decode_linear(self, acts: torch.Tensor, linear: Linear = None) -> torch.Tensor:
        """The decoder's output for feature activations ``[..., d_sae]``, before the input's
        normalisation is undone (sae-lens's ``hook_sae_recons``); ``linear`` computes
        ``acts @ W_dec + b_dec`` if given."""
        if self.architecture == "topk" and self.rescale_acts_by_decoder_norm:
            acts = acts / self.W_dec.norm(dim=-1)
        if linear is not None:
            return linear(acts)
        return torch.addmm(self.b_dec, acts.reshape(-1, acts.shape[-1]), self.W_dec).view(
            *acts.shape[:-1], -1
        )

    def denormalize(
        self, out: torch.Tensor, undo: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        """``out`` with the normalisation ``normalize`` applied to the input undone."""
        if undo is None:
            return out
        scale, shift = undo
        if self.normalize_activations == "constant_norm_rescale":
            return out / scale
        return out * scale + shift

    def decode(
        self, acts: torch.Tensor, undo: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """The reconstruction of feature activations ``[..., d_sae]`` (normalisation undone
        with ``undo`` from ``normalize``)."""
        return self.denormalize(self.decode_linear(acts), undo)

    def skip(self, x: torch.Tensor) -> torch.Tensor | None:
        """A skip transcoder's linear path for input ``x`` (``None`` without one)."""
        return None if self.W_skip is None else x @ self.W_skip.T

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations ``[..., d_sae]`` of an input ``[..., d_in]``."""
        normed, _ = self.normalize(x.to(self.dtype))
        return self.activate(self.pre_activations(normed))

    def reconstruct(
        self, x: torch.Tensor, encoder: Linear = None, decoder: Linear = None
    ) -> torch.Tensor:
        """What sae-lens's ``SAE.forward`` returns without the error term: encode, then
        decode (plus the skip path of a skip transcoder), in the dictionary's dtype."""
        x = x.to(self.dtype)
        normed, undo = self.normalize(x)
        acts = self.activate(self.pre_activations(normed, encoder))
        out = self.denormalize(self.decode_linear(acts, decoder), undo)
        skip = self.skip(x)
        return out if skip is None else out + skip
