"""``ActivationCache``: the captured tensors of one forward pass, keyed by canonical hook name."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, overload

import torch

from tl_core._errors import HookNameError, UserError
from tl_core.cache._plotting import CachePlotsMixin
from tl_core.cache._readout import ModelReadout
from tl_core.cache._resid_analysis import ResidualAnalysisMixin
from tl_core.hooks._model_info import ModelInfo
from tl_core.hooks._resolution import canonical_name

if TYPE_CHECKING:
    from tl_core.hooks._namespace import HookNamespace

__all__ = ["ActivationCache", "tl_style_name"]

_T = TypeVar("_T")

_BLOCK_INDEX = re.compile(r"^blocks\.(\d+)\.")
_ATTN_POSITIONS = (".hook_pattern", ".hook_attn_scores")  # [b, h, q, k]: two position dims
_SHOWN_NAMES = 12

# TransformerLens short names (``utils.get_act_name``) mapped to canonical suffixes.
_SHORT_ALIASES = {
    "attn": "pattern",
    "attn_logits": "attn_scores",
    "key": "k",
    "query": "q",
    "value": "v",
    "mlp_pre": "pre",
    "mlp_post": "post",
}
_GLOBAL_NAMES = {
    "embed": "embed.hook_out",
    "pos_embed": "pos_embed.hook_out",
    "unembed": "unembed.hook_out",
}
_BLOCK_NAMES = {
    "resid_pre": "hook_in",
    "resid_mid": "ln2.hook_in",
    "resid_post": "hook_out",
    "attn_out": "attn.hook_out",
    "mlp_out": "mlp.hook_out",
}
_ATTN_NAMES = frozenset({"q", "k", "v", "z", "rot_q", "rot_k", "result", "pattern", "attn_scores"})
_MLP_NAMES = frozenset({"pre", "pre_linear", "post"})
_NORM_NAMES = frozenset({"scale", "normalized"})
_SUBLAYERS = {"a": "attn", "attention": "attn", "m": "mlp", "b": "", "block": "", "blocks": ""}


def tl_style_name(name: str, layer: int | None = None, sublayer: str | None = None) -> str:
    """Build a hook name from TransformerLens-style parts, e.g. ``("resid_post", 3)``.

    Short names (``resid_pre``, ``resid_mid``, ``resid_post``, ``attn_out``, ``mlp_out``,
    ``q``/``k``/``v``/``z``/``pattern``/``attn_scores``/``result``,
    ``pre``/``pre_linear``/``post``, ``embed``, ``pos_embed``, ``unembed``, and
    ``scale``/``normalized`` with a norm such as ``"ln1"``) map to canonical names. Any other
    name is taken as a suffix under ``blocks.{layer}.[{sublayer}.]`` (``hook_`` is prefixed
    to a bare word) and left to the alias resolver, so ``("hook_out", 2)``,
    ``("attn.hook_pattern", 0)`` and ``("mlp_in", 1)`` (legacy ``blocks.1.hook_mlp_in``) work.

    Args:
        name: Short name or suffix.
        layer: Block index (non-negative), or ``None`` for model-level names.
        sublayer: ``"attn"``/``"a"``, ``"mlp"``/``"m"``, a norm (``"ln1"``, ``"ln2"``,
            ``"ln_final"``), or ``None``.

    Returns:
        The name (canonical for short names; otherwise to be resolved as an alias).

    Raises:
        HookNameError: ``scale``/``normalized`` at a block without saying which norm.
    """
    short = _SHORT_ALIASES.get(name, name)
    sub = _SUBLAYERS.get(sublayer, sublayer) if sublayer is not None else None
    if layer is None:
        if not sub and short in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[short]
        if short in _NORM_NAMES:
            return f"{sub or 'ln_final'}.hook_{short}"
        return f"{sub}.{_hook_suffix(name)}" if sub else name
    if not sub and short in _BLOCK_NAMES:
        return f"blocks.{layer}.{_BLOCK_NAMES[short]}"
    if sub in (None, "attn") and short in _ATTN_NAMES:
        return f"blocks.{layer}.attn.hook_{short}"
    if sub in (None, "mlp") and short in _MLP_NAMES:
        return f"blocks.{layer}.mlp.hook_{short}"
    if short in _NORM_NAMES and not sub:
        raise HookNameError(
            f"({name!r}, {layer}) does not say which norm: use ({name!r}, {layer}, 'ln1') or "
            f"({name!r}, {layer}, 'ln2')."
        )
    prefix = f"blocks.{layer}." + (f"{sub}." if sub else "")
    return prefix + (f"hook_{short}" if short in _NORM_NAMES else _hook_suffix(name))


def _hook_suffix(name: str) -> str:
    return name if "." in name or name.startswith("hook_") else f"hook_{name}"


class ActivationCache(ResidualAnalysisMixin, CachePlotsMixin, Mapping[str, torch.Tensor]):
    """Captured activations of one forward pass, keyed by canonical hook name.

    Lookup accepts canonical names, aliases (``"blocks.3.hook_resid_post"``,
    ``"hook_embed"``) and TransformerLens-style tuples (``("resid_post", 3)``,
    ``("pattern", 0)``, ``("scale", 2, "ln1")``; see ``tl_style_name``). A name that is not
    cached raises ``HookNameError`` listing what is cached, nearest first; note that this is
    not a ``KeyError``: use ``in`` or ``get`` to probe.

    The analysis methods (``accumulated_resid``, ``decompose_resid``, ``apply_ln_to_stack``,
    ``stack_head_results``, ``logit_attrs``, ``logit_lens``) come from
    ``ResidualAnalysisMixin``; the figures (``plot_pattern``, ``plot_logit_lens``, needing
    matplotlib: ``pip install 'tl-core[plots]'``) from ``CachePlotsMixin``.

    Names resolve through the model's ``namespace`` when the cache has one (every cache a
    bridge builds does), so an alias means the same tensor here as in ``capture`` and
    ``intervene`` on that model; otherwise against ``info``, if given.

    Args:
        cache_dict: Hook name (canonical or alias) to tensor. Names are resolved once; a
            name that resolves to no site is kept as given.
        info: Model sizes and structure (layer count, norm type, positional embedding...);
            default: the namespace's.
        namespace: The hook namespace of the model the tensors come from.
        readout: Final norm and unembedding, needed by ``logit_attrs`` and ``logit_lens``;
            or a zero-argument function returning it, called on first use (a serving
            engine's unembedding is large and need not move for a plain capture).
        lengths: Real length of each prompt in the batch (right padding assumed).
        has_batch_dim: Whether tensors have a leading batch dimension.

    Raises:
        UserError: A key that is not a string, a value that is not a tensor, two keys naming
            the same hook, or ``lengths`` that do not fit the batch.
    """

    def __init__(
        self,
        cache_dict: Mapping[str, torch.Tensor],
        *,
        info: ModelInfo | None = None,
        namespace: HookNamespace | None = None,
        readout: ModelReadout | Callable[[], ModelReadout | None] | None = None,
        lengths: Sequence[int] | None = None,
        has_batch_dim: bool = True,
    ) -> None:
        if info is None and namespace is not None:
            info = namespace.info
        self._namespace = namespace
        self._info = info
        data: dict[str, torch.Tensor] = {}
        given: dict[str, str] = {}
        for name, tensor in cache_dict.items():
            if not isinstance(name, str):
                raise UserError(f"ActivationCache keys must be hook names (str), got {name!r}.")
            if not isinstance(tensor, torch.Tensor):
                raise UserError(
                    f"ActivationCache value for {name!r} must be a torch.Tensor, "
                    f"got {type(tensor).__name__}."
                )
            try:
                canonical = self._resolve(name)
            except UserError:
                canonical = name
            if canonical in data:
                raise UserError(
                    f"ActivationCache got both {given[canonical]!r} and {name!r}, which name "
                    f"the same hook {canonical!r}; pass only one."
                )
            data[canonical] = tensor
            given[canonical] = name
        self._data = data
        self._readout = readout
        self._has_batch_dim = has_batch_dim
        self._lengths = self._check_lengths(lengths)
        self.grads: ActivationCache | None = None
        """Gradients of the same hooks (set by ``run_with_cache(incl_bwd=True)``), or ``None``.
        Caches derived with ``to``/``prompt``/``remove_batch_dim``/... derive it alike."""

    @classmethod
    def _build(
        cls, template: ActivationCache, data: dict[str, torch.Tensor], **changes: Any
    ) -> ActivationCache:
        # Keys are already canonical: skip resolution and validation of names.
        cache = cls.__new__(cls)
        cache._namespace = template._namespace
        cache._data = data
        cache._info = template._info
        cache._readout = template._readout
        cache._has_batch_dim = changes.get("has_batch_dim", template._has_batch_dim)
        cache._lengths = changes.get("lengths", template._lengths)
        cache.grads = None
        return cache

    def _check_lengths(self, lengths: Sequence[int] | None) -> tuple[int, ...] | None:
        if lengths is None:
            return None
        values = tuple(lengths)
        for value in values:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"lengths must be positive ints, got {value!r} in {lengths!r}.")
        expected = self._batch_size() if self._has_batch_dim else 1
        if expected is not None and len(values) != expected:
            raise UserError(
                f"lengths has {len(values)} entries but the cache holds {expected} prompt(s); "
                "pass one length per prompt."
            )
        return values

    # -- attributes ----------------------------------------------------------------------

    def _resolve(self, name: str) -> str:
        if self._namespace is not None:
            return self._namespace.canonical(name)
        return canonical_name(name, info=self._info)

    @property
    def namespace(self) -> HookNamespace | None:
        """The hook namespace names resolve through, or ``None``."""
        return self._namespace

    @property
    def info(self) -> ModelInfo | None:
        """Model sizes and structure, or ``None``."""
        return self._info

    @property
    def readout(self) -> ModelReadout | None:
        """Final norm and unembedding, or ``None``."""
        if callable(self._readout):
            self._readout = self._readout()
        return self._readout

    @property
    def has_batch_dim(self) -> bool:
        """Whether tensors have a leading batch dimension."""
        return self._has_batch_dim

    @property
    def lengths(self) -> tuple[int, ...] | None:
        """Real length of each prompt (right padding), or ``None`` if unknown."""
        return self._lengths

    @property
    def n_layers(self) -> int:
        """Number of blocks: from ``info``, else one more than the highest cached block index.

        Raises:
            UserError: No ``info`` and no block hook cached.
        """
        if self._info is not None:
            return self._info.n_layers
        indices = [int(m.group(1)) for name in self._data if (m := _BLOCK_INDEX.match(name))]
        if not indices:
            raise UserError(
                "Cannot tell the number of layers: the cache has no 'blocks.{i}.*' hook and no "
                "info; build it with info=ModelInfo(...)."
            )
        return max(indices) + 1

    def _batch_size(self) -> int | None:
        first = next(iter(self._data.values()), None)
        return None if first is None or first.ndim == 0 else int(first.shape[0])

    # -- mapping -------------------------------------------------------------------------

    def _find(self, key: object) -> tuple[str | None, str, str, HookNameError | None]:
        """Return (cached name or None, name asked, canonical guess, resolver error)."""
        if isinstance(key, tuple):
            asked = self._tuple_name(key)
        elif isinstance(key, str):
            asked = key
        else:
            raise HookNameError(
                f"Activation cache keys are hook names (str) or tuples like ('resid_post', 3); "
                f"got {key!r}."
            )
        if asked in self._data:
            return asked, asked, asked, None
        try:
            canonical = self._resolve(asked)
        except HookNameError as error:
            return None, asked, asked, error
        return (canonical if canonical in self._data else None), asked, canonical, None

    def _tuple_name(self, key: tuple[Any, ...]) -> str:
        parts = (*key, None, None)[:3] if 1 <= len(key) <= 3 else None
        if parts is None or not isinstance(parts[0], str):
            raise HookNameError(
                f"A tuple key must be (name,), (name, layer) or (name, layer, sublayer), "
                f"got {key!r}."
            )
        name, layer, sublayer = parts
        if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int)):
            raise HookNameError(f"The layer in key {key!r} must be an int, got {layer!r}.")
        if sublayer is not None and not isinstance(sublayer, str):
            raise HookNameError(f"The sublayer in key {key!r} must be a str, got {sublayer!r}.")
        if layer is not None and layer < 0:
            layer += self.n_layers
        return tl_style_name(name, layer, sublayer)

    def _missing(
        self, asked: str, canonical: str, error: HookNameError | None, purpose: str | None = None
    ) -> HookNameError:
        head = f"{purpose} needs {asked!r}" if purpose else f"{asked!r} is not in this cache"
        if purpose:
            head += ", which is not in this cache"
        if canonical != asked:
            head += f" (canonical name {canonical!r})"
        head += "."
        if error is not None:
            reason = str(error).rstrip()
            head += f" It is not a known hook name either: {reason.rstrip('.')}."
        if not self._data:
            return HookNameError(f"{head} The cache is empty.")
        targets = {asked, canonical}
        ranked = sorted(
            self._data,
            key=lambda n: -max(difflib.SequenceMatcher(None, t, n).ratio() for t in targets),
        )
        shown = ", ".join(repr(n) for n in ranked[:_SHOWN_NAMES])
        more = f" and {len(ranked) - _SHOWN_NAMES} more" if len(ranked) > _SHOWN_NAMES else ""
        return HookNameError(
            f"{head} The cache holds {len(ranked)} tensors, nearest first: {shown}{more}. "
            "Capture the hook in the run that builds the cache (capture=...), or check the name."
        )

    def _tensor(self, name: str, purpose: str) -> torch.Tensor:
        tensor = self._data.get(name)
        if tensor is None:
            raise self._missing(name, name, None, purpose)
        return tensor

    def _has(self, name: str) -> bool:
        return name in self._data

    def __getitem__(self, key: str | tuple[Any, ...]) -> torch.Tensor:
        """The tensor of a hook name, alias or TransformerLens-style tuple.

        Raises:
            HookNameError: The hook is not cached; the message lists cached names.
        """
        found, asked, canonical, error = self._find(key)
        if found is None:
            raise self._missing(asked, canonical, error)
        return self._data[found]

    def __contains__(self, key: object) -> bool:
        try:
            return self._find(key)[0] is not None
        except UserError:
            return False

    @overload
    def get(self, key: str, /) -> torch.Tensor | None: ...

    @overload
    def get(self, key: str, default: torch.Tensor, /) -> torch.Tensor: ...

    @overload
    def get(self, key: str, default: _T, /) -> torch.Tensor | _T: ...

    def get(self, key: str, default: object = None, /) -> object:
        """The tensor of ``key`` (name, alias or tuple), or ``default`` if not cached."""
        found = self._find(key)[0]
        return default if found is None else self._data[found]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        parts = [f"{len(self._data)} tensors"]
        batch = self._batch_size()
        if self._has_batch_dim and batch is not None:
            parts.append(f"batch {batch}")
        if self._lengths is not None:
            parts.append(f"lengths {self._lengths}")
        names = list(self._data)
        shown = ", ".join(repr(n) for n in names[:_SHOWN_NAMES])
        if len(names) > _SHOWN_NAMES:
            shown += f", ... ({len(names) - _SHOWN_NAMES} more)"
        return f"ActivationCache({', '.join(parts)}: {shown})"

    # -- new caches ----------------------------------------------------------------------

    def _map(
        self, fn: Callable[[str, torch.Tensor], torch.Tensor], **changes: Any
    ) -> ActivationCache:
        cache = self._build(self, {name: fn(name, t) for name, t in self._data.items()}, **changes)
        if self.grads is not None:
            cache.grads = self.grads._map(fn, **changes)
        return cache

    def to(
        self,
        device_or_dtype: torch.device | str | int | torch.dtype,
        dtype: torch.dtype | None = None,
        *,
        non_blocking: bool = False,
    ) -> ActivationCache:
        """A new cache with every tensor moved and/or cast.

        Only floating-point tensors change dtype. Tensors already in place are shared, not
        copied. ``info`` and ``readout`` are carried over unchanged (the analysis methods move
        the readout weights they use to the stack's device).

        Args:
            device_or_dtype: A device, or a dtype when only casting.
            dtype: A dtype to cast to as well as moving.
            non_blocking: Passed to ``Tensor.to``.

        Returns:
            The new cache.

        Raises:
            UserError: Two dtypes given.
        """
        device: torch.device | str | int | None
        if isinstance(device_or_dtype, torch.dtype):
            if dtype is not None:
                raise UserError(f"to() got two dtypes: {device_or_dtype} and {dtype}.")
            device, dtype = None, device_or_dtype
        else:
            device = device_or_dtype

        def move(_: str, tensor: torch.Tensor) -> torch.Tensor:
            cast = dtype if tensor.is_floating_point() else None
            return tensor.to(device=device, dtype=cast, non_blocking=non_blocking)

        return self._map(move)

    def cpu(self) -> ActivationCache:
        """A new cache with every tensor on the CPU."""
        return self.to("cpu")

    def detach(self) -> ActivationCache:
        """A new cache with every tensor detached from the autograd graph."""
        return self._map(lambda _, tensor: tensor.detach())

    def remove_batch_dim(self) -> ActivationCache:
        """A new cache without the batch dimension (views); ``self`` if it has none.

        Raises:
            UserError: The batch holds more than one prompt.
        """
        if not self._has_batch_dim:
            return self
        for name, tensor in self._data.items():
            if tensor.ndim == 0 or tensor.shape[0] != 1:
                size = "no" if tensor.ndim == 0 else tensor.shape[0]
                raise UserError(
                    f"remove_batch_dim needs batch size 1, but {name!r} has {size} batch entries "
                    f"(shape {tuple(tensor.shape)}); use cache.prompt(i) to take one prompt first."
                )
        return self._map(lambda _, tensor: tensor[0], has_batch_dim=False)

    def _one_prompt(self, prompt: int) -> ActivationCache:
        """One prompt's cache without a batch dimension: what the figures draw from."""
        if self.has_batch_dim:
            return self.prompt(prompt).remove_batch_dim()
        if prompt not in (0, -1):
            raise UserError(
                f"this cache has no batch dimension, so prompt must be 0, got {prompt!r}"
            )
        return self

    def prompt(self, index: int) -> ActivationCache:
        """A new cache holding one prompt, trimmed to its real length (views).

        The batch dimension is kept (size 1). With ``lengths`` known, every position
        dimension is cut to that prompt's length: dimension 1 of every tensor, and also the
        key dimension of ``attn.hook_pattern``/``hook_attn_scores`` (``[b, h, q, k]``).

        Args:
            index: Prompt index; negative counts from the end.

        Returns:
            The new cache, with ``lengths`` of one entry.

        Raises:
            UserError: ``index`` is out of range.
        """
        size = self._batch_size() if self._has_batch_dim else 1
        if isinstance(index, bool) or not isinstance(index, int):
            raise UserError(f"prompt() takes an int index, got {index!r}.")
        if size is None or not -size <= index < size:
            raise UserError(
                f"prompt({index}) is out of range for a cache of {size or 0} prompt(s)."
            )
        index %= size
        length = None if self._lengths is None else self._lengths[index]
        offset = 1 if self._has_batch_dim else 0

        def take(name: str, tensor: torch.Tensor) -> torch.Tensor:
            if self._has_batch_dim:
                tensor = tensor[index : index + 1]
            if length is None:
                return tensor
            dims = (offset + 1, offset + 2) if name.endswith(_ATTN_POSITIONS) else (offset,)
            for dim in dims:
                if dim < tensor.ndim:
                    tensor = tensor.narrow(dim, 0, min(length, tensor.shape[dim]))
            return tensor

        lengths = None if length is None else (length,)
        return self._map(take, lengths=lengths)

    def stack_activation(
        self, activation_name: str, layer: int | None = -1, sublayer_type: str | None = None
    ) -> torch.Tensor:
        """Stack one activation over the blocks before ``layer``: ``[layer, ...]``.

        Args:
            activation_name: A short name or suffix as in ``tl_style_name``
                (``"resid_post"``, ``"hook_out"``, ``"attn.hook_pattern"``, ``"scale"`` with
                ``sublayer_type="ln1"``...), resolved for each block.
            layer: Stop before this block; ``None``/``-1`` for all blocks.
            sublayer_type: Sublayer to look in (``"attn"``, ``"mlp"``, ``"ln1"``, ...).

        Returns:
            The stacked tensors.

        Raises:
            UserError: ``layer`` is out of range or 0 (nothing to stack), or a hook is not
                cached (``HookNameError``).
        """
        n_layers = self.n_layers
        if layer is None or layer == -1:
            layer = n_layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not 1 <= layer <= n_layers:
            raise UserError(
                f"stack_activation: layer must be 1..{n_layers} or -1 (all blocks), got {layer!r}."
            )
        return torch.stack(
            [self[(activation_name, block, sublayer_type)] for block in range(layer)]
        )
