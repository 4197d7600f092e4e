"""``SparseDictionary``: a sparse autoencoder or transcoder as tensors, with sae-lens's math.

tl runs dictionaries inside its drivers' forward passes, so it keeps its own small copy of
the inference math sae-lens defines (encode, decode, the error term), checked against
sae-lens itself in the sae_lens nox session. sae-lens need not be installed: dictionaries
load from its on-disk format (``cfg.json`` plus ``sae_weights.safetensors``).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, TypeAlias

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

#: The fields that hold tensors (``threshold`` and ``W_skip`` may be ``None``).
TENSORS: tuple[str, ...] = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip")


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
        hook_head_index: The one head of a per-head site the dictionary was trained on
            (sae-lens's ``metadata.hook_head_index``), or ``None``. Such a dictionary
            encodes and decodes, but tl does not splice it into a model.

    Raises:
        ConfigError: On construction, for anything ``problems`` lists, and for a keyword
            that is not a field (naming the nearest one).
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
    hook_head_index: int | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> SparseDictionary:
        # The generated __init__ would raise a bare TypeError for a misspelled keyword.
        names = [f.name for f in fields(cls)]
        unknown = [key for key in kwargs if key not in names]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigError(
                f"SparseDictionary got unknown keywords {', '.join(hints)}; it takes "
                f"{', '.join(names)}"
            )
        return super().__new__(cls)

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ConfigError(f"this sparse dictionary is inconsistent: {'; '.join(problems)}")

    def problems(self) -> list[str]:
        """What is inconsistent in the tensors and settings (empty when nothing is): a
        tensor that is not a ``torch.Tensor``, not floating point, of another dtype or
        device than ``W_enc``, of the wrong shape, or holding NaN or infinite values; a
        setting that is unknown or does not fit the architecture."""
        tensors = self._tensors()
        wrong = [
            f"{name} is a {type(t).__module__}.{type(t).__qualname__}, not a torch.Tensor"
            for name, t in tensors.items()
            if not isinstance(t, torch.Tensor)
        ]
        if wrong:
            return [
                *wrong,
                "a dictionary holds torch tensors: convert each with torch.as_tensor(...) "
                "(W_enc, b_enc, W_dec and b_dec are needed; threshold and W_skip may be None)",
            ]
        out = self._dtype_problems(tensors)
        if self.architecture not in ARCHITECTURES:
            out.append(f"architecture {self.architecture!r} is not one of {ARCHITECTURES}")
        if self.normalize_activations not in NORMALIZATIONS:
            out.append(
                f"normalize_activations {self.normalize_activations!r} is not one of {NORMALIZATIONS}"
            )
        if self.W_enc.dim() != 2 or self.W_dec.dim() != 2:
            return [
                *out,
                f"W_enc and W_dec must be matrices, got shapes {tuple(self.W_enc.shape)} "
                f"and {tuple(self.W_dec.shape)}",
            ]
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
        if self.normalize_activations == "layer_norm" and d_in < 2:
            out.append("layer_norm normalisation needs d_in >= 2 (one value has no spread)")
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
        out += self._fit_problems()
        if not out:
            bad = [p for name, t in tensors.items() if (p := _non_finite(name, t))]
            if bad:
                out.append(
                    f"{'; '.join(bad)}: a dictionary with NaN or infinite weights gives NaN "
                    "outputs; retrain it or repair those weights"
                )
        return out

    def _tensors(self) -> dict[str, Any]:
        """The tensor fields that are set, by name."""
        values = {name: getattr(self, name) for name in TENSORS}
        return {name: value for name, value in values.items() if value is not None}

    def _dtype_problems(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        out = [
            f"{name} has dtype {t.dtype}, not a floating-point one (the site's input would be "
            f"cast to it): convert it with {name}.float()"
            for name, t in tensors.items()
            if not t.is_floating_point()
        ]
        if out:
            return out
        dtypes = {t.dtype for t in tensors.values()}
        if len(dtypes) > 1:
            listed = ", ".join(
                f"{n} {str(t.dtype).removeprefix('torch.')}" for n, t in tensors.items()
            )
            out.append(
                f"its tensors have different dtypes ({listed}): convert them to one, e.g. "
                f"each with .to({self.W_enc.dtype})"
            )
        devices = {t.device for t in tensors.values()}
        if len(devices) > 1:
            listed = ", ".join(f"{n} on {t.device}" for n, t in tensors.items())
            out.append(f"its tensors are on different devices ({listed}): move them to one")
        return out

    def _fit_problems(self) -> list[str]:
        """Settings given for an architecture that does not use them."""
        out: list[str] = []
        if self.threshold is not None and self.architecture != "jumprelu":
            out.append(
                f"a threshold is given but the architecture is {self.architecture!r}: only a "
                "jumprelu dictionary has thresholds; set architecture='jumprelu' or drop it"
            )
        if self.k is not None and self.architecture != "topk":
            out.append(
                f"k={self.k!r} is given but the architecture is {self.architecture!r}: only a "
                "topk dictionary keeps k features; set architecture='topk' or drop k"
            )
        if self.rescale_acts_by_decoder_norm and self.architecture != "topk":
            out.append(
                "rescale_acts_by_decoder_norm applies to topk dictionaries only, but the "
                f"architecture is {self.architecture!r}"
            )
        head = self.hook_head_index
        if head is not None and (isinstance(head, bool) or not isinstance(head, int) or head < 0):
            out.append(f"hook_head_index must be None or a head index >= 0, got {head!r}")
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
            "hook_head_index": self.hook_head_index,
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

        try:
            return replace(
                self, W_enc=move(self.W_enc), b_enc=move(self.b_enc), W_dec=move(self.W_dec),
                b_dec=move(self.b_dec), threshold=None if self.threshold is None else move(self.threshold),
                W_skip=None if self.W_skip is None else move(self.W_skip),
            )  # fmt: skip
        except ConfigError as exc:
            # Casting to a narrower dtype can overflow to infinity.
            raise ConfigError(f"converting the dictionary to {dtype or device}: {exc}") from None

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


def _non_finite(name: str, t: torch.Tensor) -> str | None:
    """Where ``t`` holds NaN or infinite values, if it does."""
    # A NaN or infinity anywhere makes the sum non-finite, so a finite sum clears the tensor
    # in one fast reduction (a non-finite one may be an overflow: then look element-wise).
    if bool(torch.isfinite(t.sum())):
        return None
    bad = ~torch.isfinite(t)
    if not bool(bad.any()):
        return None
    nans, total = int(torch.isnan(t).sum()), int(bad.sum())
    kinds = [f"NaN at {nans}" if nans else "", f"inf at {total - nans}" if total > nans else ""]
    first = tuple(int(i) for i in bad.nonzero()[0])
    where = first[0] if len(first) == 1 else first
    return f"{name} holds {' and '.join(k for k in kinds if k)} of {t.numel()} entries (the first at index {where})"
