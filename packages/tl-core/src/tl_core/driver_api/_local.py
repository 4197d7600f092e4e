"""``LocalDriver``: the shared engine of drivers that run an ``nn.Module`` in-process.

A subclass supplies the module, its ``HookPoint`` tree (canonical name -> HookPoint) and a
``run_model`` call; this base turns ``capture`` lists and ``intervene`` plans into
temporary hooks, runs prefill or generation, and always removes what it attached.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from tl_core._errors import DriverContractError, UnsupportedFeatureError, UserError
from tl_core.cache._readout import ModelReadout
from tl_core.driver_api._batching import TokenBatch
from tl_core.driver_api._context import fits_context, most_new_tokens, positions_run
from tl_core.driver_api._protocol import FEATURES, NamespaceFacts
from tl_core.driver_api._request import LOCAL_OPTIONS, ForwardRequest, ForwardResult, RequestForward
from tl_core.driver_api._sampling import next_tokens
from tl_core.driver_api._tokenizers import Tokenizer, padding_id
from tl_core.hooks._dictionary_sites import DictionarySite, check_start
from tl_core.hooks._hook_point import HookHandle, HookPoint
from tl_core.hooks._model_info import ModelInfo
from tl_core.hooks._namespace import HookNamespace
from tl_core.hooks._order import forward_order
from tl_core.hooks._vocabulary import on_decoder_positions
from tl_core.specs._affine import AffineEdit, compile_plan
from tl_core.specs._plan import InterventionPlan

if TYPE_CHECKING:
    from tl_core._dictionaries._run import DictionaryRun

__all__ = ["LocalDriver"]

_SPLIT_INPUTS = ("attn.hook_q_input", "attn.hook_k_input", "attn.hook_v_input")
_SPLIT_READ_ONLY = (
    "per-head q/k/v inputs are on: attention reads attn.hook_q_input/hook_k_input/"
    "hook_v_input, so an edit here would not reach it; edit those, or turn them off "
    "with set_use_split_qkv_input(False)"
)


class LocalDriver(RequestForward, NamespaceFacts, ABC):
    """Base class for in-process drivers (``native``, ``hf``).

    Subclasses implement the abstract members; everything in the Driver protocol is
    provided here on top of them, the ``namespace`` included (built once from
    ``hook_points``, ``info`` and ``absent_reasons``).
    """

    #: The name users type to get this driver.
    name: ClassVar[str] = ""
    #: Local drivers return logits at every position.
    provides_sequence_logits: bool = True
    #: Features this driver has; local drivers have all of them unless they say otherwise,
    #: but ``token_type_ids`` and ``images`` (a model with a token-type embedding or a vision
    #: tower says so itself).
    features: ClassVar[frozenset[str]] = FEATURES - {"token_type_ids", "images"}
    #: ``forward`` also takes capture_device and the partial-forward options.
    forward_options: ClassVar[frozenset[str]] = LOCAL_OPTIONS

    @property
    @abstractmethod
    def module(self) -> nn.Module:
        """The ``nn.Module`` that owns the hook points (registered inside the bridge)."""

    @property
    @abstractmethod
    def hook_points(self) -> Mapping[str, HookPoint]:
        """Canonical hook name -> the ``HookPoint`` that fires there."""

    @property
    @abstractmethod
    def info(self) -> ModelInfo:
        """The model's sizes and structure."""

    @property
    @abstractmethod
    def tokenizer(self) -> Tokenizer:
        """The tokenizer for text input."""

    @abstractmethod
    def run_model(
        self,
        input_ids: torch.Tensor | None,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        start_at_layer: int | None = None,
        stop_at_layer: int | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One forward pass with whatever hooks are attached.

        Args:
            input_ids: ``[batch, pos]`` ids (``None`` when starting from ``residual``).
            attention_mask: ``[batch, pos]``, 1 for real tokens; ``None`` = all real.
            position_ids: ``[batch, pos]``; ``None`` = derived from the mask or ``arange``.
            start_at_layer: Start at this block, reading ``residual`` as its input (a block
                index in ``0..n_layers``, already checked: ``build_request`` resolves what
                the user gave).
            stop_at_layer: Return the residual stream entering this block (checked too).
            residual: ``[batch, pos, d_model]`` input of ``start_at_layer``.

        Returns:
            Logits ``[batch, pos, d_vocab]``, or the residual stream when stopping early.
        """

    def readout(self) -> ModelReadout | None:
        """The final norm and unembedding, for cache analysis (``None`` if unavailable)."""
        return None

    @property
    def absent_reasons(self) -> Mapping[str, str]:
        """Why this model lacks canonical hooks its ``ModelInfo`` suggests (family quirks).

        Hooks the model structurally lacks get their reason from the vocabulary; override
        this for anything more specific.
        """
        return {}

    @property
    def read_only_reasons(self) -> Mapping[str, str]:
        """Served hooks that take no specs, with the reason (integer sites need none)."""
        return {}

    # -- opt-in per-head inputs ---------------------------------------------------------

    @property
    def split_qkv_input(self) -> bool:
        """Whether each attention head reads its own copy of the block input."""
        return bool(self.__dict__.get("_split_qkv_input", False))

    def set_use_split_qkv_input(self, enabled: bool) -> None:
        """Give each head its own copy of the block input, or stop (HookedTransformer's
        ``use_split_qkv_input``).

        While on, ``attn.hook_q_input``/``hook_k_input``/``hook_v_input`` are served and
        ``ln1``'s outputs (and ``attn.hook_in``) are capture-only: attention no longer reads
        them. The namespace is rebuilt.

        Raises:
            UnsupportedFeatureError: The driver has no per-head inputs.
            UserError: Turning them on while a dictionary reads or writes a site they make
                capture-only (its output would no longer reach attention).
        """
        if not isinstance(enabled, bool):
            raise UserError(f"set_use_split_qkv_input takes a bool, got {enabled!r}")
        if enabled and not self.split_qkv_input:
            self._check_split_dictionaries()
        self._apply_split_qkv_input(enabled)
        before = self._split_read_only()
        self._split_qkv_input = enabled
        self.__dict__.pop("_namespace", None)
        # Python hooks are refused too, not only specs: an edit there would be lost.
        for name, reason in before.items():
            if self.hook_points[name].edit_refusal == reason:
                self.hook_points[name].edit_refusal = None
        for name, reason in self._split_read_only().items():
            self.hook_points[name].edit_refusal = reason

    def _check_split_dictionaries(self) -> None:
        made_read_only = set(self._split_read_only(enabled=True))
        for site in self.dictionary_sites.values():
            for hook in dict.fromkeys((site.hook, site.output_hook)):
                if hook in made_read_only:
                    why = (
                        "so the dictionary's output would not reach attention"
                        if hook == site.output_hook
                        else "and tl attaches dictionaries only where a site takes edits"
                    )
                    raise UserError(
                        f"per-head q/k/v inputs cannot be turned on while a dictionary is attached "
                        f"at {site.hook!r}: they make {hook!r} capture-only (attention then reads "
                        f"attn.hook_q_input/hook_k_input/hook_v_input), {why}; remove the "
                        "dictionary first (.remove() on what add_sae returned)"
                    )

    def _apply_split_qkv_input(self, enabled: bool) -> None:
        """Switch the model's attention to per-head inputs (drivers that can override)."""
        raise UnsupportedFeatureError(f"driver {self.name!r} has no per-head q/k/v inputs")

    def _served(self, points: Mapping[str, HookPoint]) -> dict[str, HookPoint]:
        """``points`` without the per-head inputs unless they are on, plus the sites of
        attached dictionaries (for ``hook_points``)."""
        # Read several times per forward: rebuilt only when the model's points (the same
        # object, same size), the per-head switch or the attached dictionaries change.
        # The key holds the dictionaries' point maps themselves (compared by identity), not ids
        # that a detached and re-attached dictionary could reuse.
        key = (
            len(points),
            self.split_qkv_input,
            tuple((site, hp) for site, (_, hp) in self._dictionaries.items()),
        )
        cached: tuple[Mapping[str, HookPoint], object, dict[str, HookPoint]] | None = (
            self.__dict__.get("_served_points")
        )
        if cached is not None and cached[0] is points and cached[1] == key:
            return cached[2]
        extra = self._dictionary_points
        if self.split_qkv_input:
            served = {**points, **extra}
        else:
            served = {**{n: p for n, p in points.items() if not n.endswith(_SPLIT_INPUTS)}, **extra}
        self.__dict__["_served_points"] = (points, key, served)
        return served

    # -- dictionary sites ------------------------------------------------------------------

    @property
    def _dictionaries(self) -> dict[str, tuple[DictionarySite, dict[str, HookPoint]]]:
        """Canonical site -> the dictionary attached there and the HookPoints of its sites."""
        entries: dict[str, tuple[DictionarySite, dict[str, HookPoint]]] = self.__dict__.setdefault(
            "_dictionary_entries", {}
        )
        return entries

    @property
    def _dictionary_points(self) -> dict[str, HookPoint]:
        return {
            name: point
            for _, points in self._dictionaries.values()
            for name, point in points.items()
        }

    @property
    def dictionary_sites(self) -> Mapping[str, DictionarySite]:
        """Canonical site -> the dictionary attached there."""
        return {hook: site for hook, (site, _) in self._dictionaries.items()}

    @property
    def _dictionary_runs(self) -> dict[str, DictionaryRun]:
        """Canonical site -> the run of the dictionary attached there (its per-forward state)."""
        runs: dict[str, DictionaryRun] = self.__dict__.setdefault("_dictionary_run_map", {})
        return runs

    def add_dictionary_sites(
        self,
        site: DictionarySite,
        points: Mapping[str, HookPoint],
        *,
        run: DictionaryRun | None = None,
    ) -> None:
        """Serve a dictionary's sites (``site.names``), fired by ``points``.

        The caller (``tl_core.sae``) makes the dictionary run at ``site.hook``; this only
        makes its sites names the driver resolves, captures and edits, and, given ``run``,
        resets its per-forward state when each forward begins and ends.

        Raises:
            HookNameError: The namespace refuses the site (see ``HookNamespace.with_dictionary``).
            DriverContractError: ``points`` does not hold exactly ``site.names``.
        """
        if set(points) != set(site.names):
            raise DriverContractError(
                f"dictionary sites {sorted(points)} are not {list(site.names)}"
            )
        namespace = self.namespace.with_dictionary(site)
        self._dictionaries[site.hook] = (site, dict(points))
        if run is not None:
            self._dictionary_runs[site.hook] = run
        self._namespace = namespace

    def remove_dictionary_sites(self, hook: str) -> None:
        """Stop serving the sites of the dictionary at canonical ``hook`` (if any)."""
        self._dictionary_runs.pop(hook, None)
        if self._dictionaries.pop(hook, None) is not None:
            self.__dict__.pop("_namespace", None)

    def _split_read_only(self, *, enabled: bool | None = None) -> dict[str, str]:
        """The sites per-head inputs make capture-only (while on, or if ``enabled``)."""
        if not (self.split_qkv_input if enabled is None else enabled):
            return {}
        reason = _SPLIT_READ_ONLY
        names = [
            f"blocks.{i}.{site}"
            for i in range(self.info.n_layers)
            for site in ("ln1.hook_scale", "ln1.hook_normalized", "ln1.hook_out", "attn.hook_in")
        ]
        return {n: reason for n in names if n in self.hook_points}

    # -- Driver protocol --------------------------------------------------------------

    @property
    def namespace(self) -> HookNamespace:
        """The model's hook names: served hooks are editable unless read-only or integer.

        Built on first use (subclasses finish building their model in ``__init__``), and
        again after ``set_use_split_qkv_input``.
        """
        built: HookNamespace | None = self.__dict__.get("_namespace")
        if built is None:
            extra = self._dictionary_points
            model_points = {n: p for n, p in self.hook_points.items() if n not in extra}
            built = HookNamespace.build(
                self.info,
                model_points,
                read_only={**self.read_only_reasons, **self._split_read_only()},
                reasons=self.absent_reasons,
                driver=self.name,
            )
            for site in self.dictionary_sites.values():
                built = built.with_dictionary(site)
            self._namespace = built
        return built

    @property
    def masks_padding(self) -> bool:
        """Whether a prefill of a ragged batch passes the padding mask to ``run_model``: an
        encoder's positions attend to every position, padding included, unless masked."""
        return False

    def supports(self, feature: str) -> bool:
        """Whether this driver has ``feature``."""
        return feature in self.features

    def close(self) -> None:
        """Nothing to release for an in-process model; kept for the protocol."""

    @property
    def device(self) -> torch.device:
        """Where the model's first parameter lives (inputs are moved there)."""
        for param in self.module.parameters():
            return param.device
        return torch.device("cpu")

    def run(self, request: ForwardRequest) -> ForwardResult:
        """Run one validated request (see ``Driver.forward``; ``forward`` is its keyword form).

        Local drivers also honour ``capture_device``, ``start_at_layer``/``stop_at_layer``/
        ``residual`` (partial forwards; with ``stop_at_layer`` the ``logits`` field holds
        the residual stream) and, for ``max_new_tokens > 1``, the sampling options.
        """
        batch = request.batch.to(self.device)
        self._check_context(batch, request.max_new_tokens)
        if request.decodes:
            return self._generate(batch, request)
        store: dict[str, torch.Tensor] = {}
        start, stop = request.start_at_layer, request.stop_at_layer
        check_start(self.dictionary_sites.values(), start)
        # A causal model's real positions never read the right padding after them; an
        # encoder's would, so its ragged batches carry the padding mask.
        mask = batch.attention_mask() if self.masks_padding and batch.is_ragged else None
        # Only drivers that support segment ids get them (planned_request checked that).
        extra: dict[str, Any] = {}
        if request.token_type_ids is not None:
            extra["token_type_ids"] = request.token_type_ids.to(batch.ids.device)
        if request.images is not None:
            extra["images"] = request.images
        with self.attached(request.plan, batch, capture=request.capture, store=store):
            out = self.run_model(
                None if start is not None else batch.ids,
                attention_mask=mask,
                start_at_layer=start,
                stop_at_layer=stop,
                residual=request.residual,
                **extra,
            )
        new = None
        last_logits = None
        if stop is None and (request.max_new_tokens == 1 or request.logits == "last"):
            last = torch.tensor(batch.lengths, device=out.device) - 1
            last_logits = out[torch.arange(out.shape[0], device=out.device), last]
            if request.max_new_tokens == 1:
                new = last_logits.argmax(-1)[:, None]
        logits: torch.Tensor | None = out
        if request.logits == "none" and stop is None:
            logits = None
        elif request.logits == "last" and last_logits is not None:
            logits = last_logits[:, None]
        return ForwardResult(
            logits=logits,
            captured=_move(store, request.capture_device),
            new_tokens=new,
            raw_output=None,
            lengths=batch.lengths,
        )

    def _check_context(self, batch: TokenBatch, max_new_tokens: int) -> None:
        """Refuse work that would run the model on more than ``n_ctx`` positions.

        Models with learned positions fail there anyway, but rotary ones would run past
        their context without a word, and generation would fail only at the limit, its
        tokens lost. (Bridges check prompt plus ``max_new_tokens`` before this.)
        """
        n_ctx = self.info.n_ctx
        longest = max(batch.lengths)
        if fits_context(longest, max_new_tokens, n_ctx):
            return
        run = positions_run(longest, max_new_tokens)
        index = batch.lengths.index(longest)
        steps = (
            f" and generating {max_new_tokens} tokens runs the model on {run} positions"
            if max_new_tokens > 1
            else ""
        )
        most = most_new_tokens(longest, n_ctx)
        fewer = f", or lower max_new_tokens to {most}" if most else ""
        longer = (
            "its positions are learned, so it takes no longer inputs"
            if self.info.positional_embedding_type == "standard" and self.name != "native"
            else "a model that supports longer contexts can be booted with a larger n_ctx="
        )
        raise UserError(
            f"prompt {index} is {longest} tokens long{steps}, which exceeds n_ctx={n_ctx}, "
            f"the longest input this model takes; shorten it{fewer} ({longer})"
        )

    @contextmanager
    def attached(
        self,
        plan: InterventionPlan,
        batch: TokenBatch,
        *,
        capture: Sequence[str] = (),
        store: dict[str, torch.Tensor] | None = None,
        decoder_batch: TokenBatch | None = None,
    ) -> Iterator[None]:
        """Attach the plan's edits, then capture hooks; remove them all on exit.

        On an encoder-decoder, edits at sites over the decoder's positions
        (``on_decoder_positions``) follow ``decoder_batch``, the others ``batch``.

        This is one forward's scope: spliced dictionaries start it with no state and keep
        none after it (a transcoder's input read by a forward that stopped before its
        output site must not reach the next forward).
        """
        handles: list[HookHandle] = []
        runs = list(self._dictionary_runs.values())
        for run in runs:
            run.reset()
        try:
            for hook in forward_order(plan.hooks):
                point = self.hook_points[hook]
                if any(plan.specs_for(hook)):
                    rows = (
                        decoder_batch
                        if decoder_batch is not None and on_decoder_positions(hook)
                        else batch
                    )
                    edit = _SpecEdit(plan, hook, self.namespace, rows)
                    handles.append(point.add_hook(edit))
                for fn in plan.callables.get(hook, ()):
                    handles.append(point.add_hook(fn))
            if store is not None:
                for hook in capture:
                    handles.append(self.hook_points[hook].add_hook(_Capture(store, hook)))
            yield
        finally:
            for run in runs:
                run.reset()
            for handle in handles:
                handle.remove()

    def _generate(self, batch: TokenBatch, request: ForwardRequest) -> ForwardResult:
        """Decode step by step with the plan active at every step (full recomputation).

        Prompts are left-padded so every row's next token is the last column; positions
        come from the attention mask, and spec positions are shifted by each row's padding.
        """
        left = batch.repadded("left", padding_id(self.tokenizer))
        ids, mask = left.ids, left.attention_mask()
        eos = self.tokenizer.eos_token_id if request.stop_at_eos else None
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        generated: list[torch.Tensor] = []
        store: dict[str, torch.Tensor] = {}
        first_logits: torch.Tensor | None = None
        # Every step recomputes the whole sequence, its image positions included.
        images: dict[str, Any] = {} if request.images is None else {"images": request.images}
        for step in range(request.max_new_tokens):
            step_batch = TokenBatch(ids, left.lengths, left.offsets)
            capture = request.capture if step == 0 else ()
            with self.attached(request.plan, step_batch, capture=capture, store=store):
                logits = self.run_model(ids, attention_mask=mask, **images)
            if first_logits is None:
                first_logits = logits
            token = next_tokens(logits[:, -1], request.sampling)
            if eos is not None:
                token = torch.where(done, torch.full_like(token, eos), token)
                done |= token == eos
            generated.append(token)
            ids = torch.cat([ids, token[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            if eos is not None and bool(done.all()):
                break
        assert first_logits is not None
        logits_out: torch.Tensor | None = None
        if request.logits == "all":
            logits_out = _left_to_right(first_logits, left, "b p vocab")
        elif request.logits == "last":
            logits_out = first_logits[:, -1:]
        return ForwardResult(
            logits=logits_out,
            captured={
                k: _left_to_right(v, left, self.namespace.layout(k))
                for k, v in _move(store, request.capture_device).items()
            },
            new_tokens=torch.stack(generated, dim=1),
            raw_output=None,
            lengths=left.lengths,
        )


class _SpecEdit:
    """A forward hook applying one hook's compiled specs; compiled once per shape."""

    def __init__(
        self, plan: InterventionPlan, hook: str, namespace: HookNamespace, batch: TokenBatch
    ) -> None:
        self._plan = plan
        self._hook = hook
        self._layout = namespace.layout(hook)
        self._shape = namespace.feature_shape(hook)
        self._offsets = batch.offsets
        self._compiled: dict[tuple[Any, ...], AffineEdit | None] = {}

    def __call__(self, x: torch.Tensor, *, hook: HookPoint) -> torch.Tensor:
        seq_len = x.shape[2] if self._layout == "b h q k" else x.shape[1]
        key = (seq_len, x.dtype, x.device)
        if key not in self._compiled:
            self._compiled[key] = compile_plan(
                self._plan,
                self._hook,
                layout=self._layout,
                feature_shape=self._shape if self._shape is not None else (x.shape[-1],),
                seq_len=seq_len,
                offsets=self._offsets,
                dtype=x.dtype,
                device=x.device,
            )
        edit = self._compiled[key]
        return x if edit is None else edit.apply(x)


class _Capture:
    """A forward hook storing the (detached) value under its canonical name."""

    def __init__(self, store: dict[str, torch.Tensor], name: str) -> None:
        self._store = store
        self._name = name

    def __call__(self, x: torch.Tensor, *, hook: HookPoint) -> None:
        self._store[self._name] = x.detach()


def _move(
    store: Mapping[str, torch.Tensor], device: torch.device | str | None
) -> dict[str, torch.Tensor]:
    if device is None:
        return dict(store)
    return {k: v.to(device) for k, v in store.items()}


def _left_to_right(x: torch.Tensor, left: TokenBatch, layout: str) -> torch.Tensor:
    """Move left-padded rows to right padding, as ForwardResult promises."""
    if not any(left.offsets):
        return x
    out = torch.zeros_like(x)
    for row, (offset, length) in enumerate(zip(left.offsets, left.lengths, strict=True)):
        span = slice(offset, offset + length)
        if layout == "b h q k":
            out[row, :, :length, :length] = x[row, :, span, span]
        else:
            out[row, :length] = x[row, span]
    return out
