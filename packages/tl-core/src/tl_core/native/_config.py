"""``NativeConfig``: the size and shape of a native (plain-torch) transformer."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from tl_core._errors import ConfigError
from tl_core.hooks._model_info import ModelInfo

__all__ = ["MIN_VOCAB", "NativeConfig"]

#: Smallest vocabulary the built-in ``ByteTokenizer`` fits into (256 bytes + 3 specials).
MIN_VOCAB = 259

_ACT_FNS = ("gelu", "gelu_new", "relu", "silu")
_NORMS = ("LN", "RMS")
_POS_TYPES = ("standard", "rotary")
_INIT_MODES = ("gpt2", "xavier_normal")
_POSITIVE_INTS = ("n_layers", "d_model", "n_heads", "d_head", "d_mlp", "d_vocab", "n_ctx")
#: The native presets' names: ``NativeConfig.preset(name)`` builds each.
PRESETS: tuple[str, ...] = ("gpt2", "llama")
_BOOLS = ("gated_mlp", "use_attn_result", "use_split_qkv_input", "tie_word_embeddings")
# Native models compute in float32 unless booted with another dtype, so the float fields
# must survive float32: an eps that rounds to 0 divides a zero vector by 0, one that
# overflows zeroes every norm, and NaN turns every logit into NaN. A rotary base below 1
# makes the frequencies base**(-2i/d_head) grow, past float32's range for tiny bases.
_FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_TINY = 1.401298464324817e-45  # the smallest positive (subnormal) float32
_FLOAT_RANGES = {
    "eps": (
        _FLOAT32_TINY,
        "a positive number that float32 holds, from 1.4012985e-45 to 3.4028235e+38 "
        "(smaller ones round to 0, larger ones overflow)",
    ),
    "rotary_base": (
        1.0,
        "a number from 1 to 3.4028235e+38 (float32's largest); usual bases are 10000 to 1000000",
    ),
}
_SEED_LIMIT = 2**64  # torch's generators take seeds in 0 .. 2**64 - 1


@dataclass(frozen=True)
class NativeConfig:
    """Configuration of a ``NativeTransformer``; field names follow TransformerLens.

    The defaults describe a two-layer GPT-2-style model. ``NativeConfig.llama_style()``
    gives the Llama-style counterpart (RMSNorm, rotary, grouped-query attention, gated
    SiLU MLP, no biases).

    Attributes:
        n_layers: Number of transformer blocks.
        d_model: Residual-stream width.
        n_heads: Query heads per block.
        d_head: Width of one head (need not equal ``d_model // n_heads``).
        d_mlp: MLP hidden width.
        d_vocab: Vocabulary size; at least 259 so the ``ByteTokenizer`` fits.
        n_ctx: Longest sequence the model accepts.
        act_fn: MLP activation: ``"gelu"`` (exact), ``"gelu_new"`` (tanh), ``"relu"``,
            ``"silu"``.
        normalization_type: ``"LN"`` (LayerNorm with bias), ``"RMS"`` (RMSNorm) or
            ``None`` (no norms: every path from a site to the logits that passes no
            attention softmax or activation is linear, the toy model exact checks need).
        positional_embedding_type: ``"standard"`` (learned ``W_pos``) or ``"rotary"``.
        n_key_value_heads: Key/value heads; ``None`` means ``n_heads``. Fewer heads than
            ``n_heads`` gives grouped-query attention; ``n_heads`` must be a multiple.
        gated_mlp: Whether the MLP has a gate projection (``hook_pre_linear`` fires).
        init_mode: ``"gpt2"`` (normal, std 0.02) or ``"xavier_normal"`` for weights;
            biases start at zero and norm weights at one in both modes.
        seed: Seed of the private generator that initialises the weights, from 0 to
            ``2**64 - 1``.
        eps: Epsilon added to the variance (LN) or mean square (RMS) in every norm; a
            positive number that float32 holds (``1.4e-45`` to ``3.4e38``).
        rotary_base: Base of the rotary frequencies, from 1 to float32's largest number.
        use_attn_result: Whether ``attn.hook_result`` (per-head output) exists and fires.
        use_split_qkv_input: Whether each attention head reads its own copy of the block
            input (``attn.hook_q_input``/``hook_k_input``/``hook_v_input``) at boot; the
            model switches it with ``set_use_split_qkv_input``.
        tie_word_embeddings: Whether the unembedding is the transpose of ``W_E``.
        use_bias: Whether the linear maps (q, k, v, o, MLP, unembed) have biases;
            ``None`` means yes for LN models and no for RMS models. LayerNorm always has
            its own bias.
    """

    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    d_head: int = 16
    d_mlp: int = 256
    d_vocab: int = MIN_VOCAB
    n_ctx: int = 256
    act_fn: Literal["gelu", "gelu_new", "relu", "silu"] = "gelu"
    normalization_type: Literal["LN", "RMS"] | None = "LN"
    positional_embedding_type: Literal["standard", "rotary"] = "standard"
    n_key_value_heads: int | None = None
    gated_mlp: bool = False
    init_mode: Literal["gpt2", "xavier_normal"] = "gpt2"
    seed: int = 0
    eps: float = 1e-5
    rotary_base: float = 10000.0
    use_attn_result: bool = False
    use_split_qkv_input: bool = False
    tie_word_embeddings: bool = False
    use_bias: bool | None = None

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS:
            _check_positive_int(name, getattr(self, name))
        if self.d_vocab < MIN_VOCAB:
            raise ConfigError(
                f"NativeConfig field 'd_vocab' must be at least {MIN_VOCAB} so the byte "
                f"tokenizer's ids fit, got {self.d_vocab}; raise it to {MIN_VOCAB} or more."
            )
        if self.normalization_type is not None:
            _check_choice("normalization_type", self.normalization_type, _NORMS)
        for name, choices in (
            ("act_fn", _ACT_FNS),
            ("positional_embedding_type", _POS_TYPES),
            ("init_mode", _INIT_MODES),
        ):
            _check_choice(name, getattr(self, name), choices)
        for name in _BOOLS:
            _check_bool(name, getattr(self, name))
        if self.use_bias is not None:
            _check_bool("use_bias", self.use_bias)
        if self.n_key_value_heads is not None:
            _check_positive_int("n_key_value_heads", self.n_key_value_heads)
            if self.n_heads % self.n_key_value_heads != 0:
                raise ConfigError(
                    f"NativeConfig field 'n_heads' ({self.n_heads}) must be a multiple of "
                    f"'n_key_value_heads' ({self.n_key_value_heads}) for grouped-query "
                    "attention; choose n_key_value_heads among the divisors of n_heads."
                )
        if self.positional_embedding_type == "rotary" and self.d_head % 2 != 0:
            raise ConfigError(
                f"NativeConfig field 'd_head' must be even for rotary embeddings, got "
                f"{self.d_head}; use an even d_head or positional_embedding_type='standard'."
            )
        seed = self.seed
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _SEED_LIMIT:
            raise ConfigError(
                "NativeConfig field 'seed' must be a non-negative int below 2**64 (what "
                f"torch's generator takes), got {_shown(seed)}."
            )
        for name, (low, allowed) in _FLOAT_RANGES.items():
            value = getattr(self, name)
            # One chained comparison refuses NaN, infinities and ints beyond float64 alike.
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not low <= value <= _FLOAT32_MAX
            ):
                raise ConfigError(
                    f"NativeConfig field {name!r} must be {allowed}, got {_shown(value)}."
                )

    @property
    def kv_heads(self) -> int:
        """Key/value heads, resolving ``n_key_value_heads=None`` to ``n_heads``."""
        return self.n_key_value_heads or self.n_heads

    @property
    def has_bias(self) -> bool:
        """Whether the linear maps carry biases (``use_bias`` with its default resolved)."""
        if self.use_bias is None:
            return self.normalization_type == "LN"
        return self.use_bias

    @classmethod
    def gpt2_style(cls, **overrides: Any) -> NativeConfig:
        """A GPT-2-style config: LayerNorm, learned positions, GELU MLP, biases.

        Args:
            **overrides: Fields to change; unknown names raise ``ConfigError``.

        Returns:
            The config.

        Raises:
            ConfigError: An unknown field or an invalid value.
        """
        base: dict[str, Any] = {
            "normalization_type": "LN",
            "positional_embedding_type": "standard",
            "act_fn": "gelu",
            "gated_mlp": False,
            "use_bias": True,
        }
        return cls.from_dict({**base, **overrides})

    @classmethod
    def llama_style(cls, **overrides: Any) -> NativeConfig:
        """A Llama-style config: RMSNorm, rotary, 2 key/value heads, gated SiLU MLP, no biases.

        Args:
            **overrides: Fields to change; unknown names raise ``ConfigError``.

        Returns:
            The config.

        Raises:
            ConfigError: An unknown field or an invalid value.
        """
        base: dict[str, Any] = {
            "normalization_type": "RMS",
            "positional_embedding_type": "rotary",
            "n_key_value_heads": 2,
            "act_fn": "silu",
            "gated_mlp": True,
            "use_bias": False,
        }
        return cls.from_dict({**base, **overrides})

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> NativeConfig:
        """The config of a named preset (``PRESETS``: ``"gpt2"``, ``"llama"``).

        Args:
            name: The preset's name.
            **overrides: Fields to change; unknown names raise ``ConfigError``.

        Returns:
            The config.

        Raises:
            ConfigError: An unknown preset, field or value.
        """
        if name not in PRESETS:
            raise ConfigError(
                f"unknown native preset {name!r}; choose one of {sorted(PRESETS)} or pass "
                f"a NativeConfig / dict"
            )
        return cls.gpt2_style(**overrides) if name == "gpt2" else cls.llama_style(**overrides)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NativeConfig:
        """Build a config from a mapping of field names to values.

        Args:
            data: Field values; missing fields keep their defaults.

        Returns:
            The config.

        Raises:
            ConfigError: ``data`` is not a mapping, names an unknown field (the message
                suggests the nearest field), or holds an invalid value.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"A NativeConfig is built from a mapping of field names, got {type(data).__name__}."
            )
        known = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ConfigError(
                    f"Unknown NativeConfig field {key!r}.{hint} Known fields: {', '.join(known)}."
                )
        return cls(**data)

    @classmethod
    def coerce(cls, cfg: NativeConfig | Mapping[str, Any]) -> NativeConfig:
        """Return ``cfg`` if it is a ``NativeConfig``, else build one from the mapping.

        Args:
            cfg: A config or a mapping of field names to values.

        Returns:
            The config.

        Raises:
            ConfigError: ``cfg`` is neither, or the mapping is invalid.
        """
        if isinstance(cfg, NativeConfig):
            return cfg
        return cls.from_dict(cfg)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (round-trips through ``from_dict``)."""
        return dataclasses.asdict(self)

    def to_model_info(self) -> ModelInfo:
        """The ``ModelInfo`` describing a model built from this config."""
        return ModelInfo(
            n_layers=self.n_layers,
            d_model=self.d_model,
            n_heads=self.n_heads,
            d_head=self.d_head,
            d_mlp=self.d_mlp,
            d_vocab=self.d_vocab,
            n_ctx=self.n_ctx,
            n_key_value_heads=self.n_key_value_heads,
            normalization_type=self.normalization_type,
            positional_embedding_type=self.positional_embedding_type,
            gated_mlp=self.gated_mlp,
            architecture=self._architecture(),
        )

    def _architecture(self) -> str:
        if self.normalization_type == "LN" and self.positional_embedding_type == "standard":
            return "native-gpt2"
        if self.normalization_type == "RMS" and self.positional_embedding_type == "rotary":
            return "native-llama"
        return "native"


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 30 else f"{text[:12]}...({len(text)} characters)"


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"NativeConfig field {name!r} must be a positive int, got {value!r}.")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"NativeConfig field {name!r} must be one of {', '.join(map(repr, choices))}, "
            f"got {value!r}.{hint}"
        )


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(
            f"NativeConfig field {name!r} must be a bool (True or False), got {value!r} "
            f"of type {type(value).__name__}."
        )
