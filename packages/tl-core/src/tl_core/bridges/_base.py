"""``Bridge``: the one researcher-facing surface both bridges share.

``forward``, ``loss``, ``run_with_cache``, ``generate``, the token helpers and the hook
bookkeeping are written once, here, with one signature each. A bridge subclass supplies
how one engine call runs (``_execute``): in process with live hooks (``TransformerBridge``)
or in an engine whose captures replay through local hook points (``RemoteBridge``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, ClassVar, Literal, TypeVar, Union

import torch

from tl_core._dictionaries._dictionary import SparseDictionary
from tl_core._errors import UnsupportedFeatureError, UserError
from tl_core.architecture._description import Architecture
from tl_core.bridges._loss import next_token_loss
from tl_core.bridges._prompts import check_context, encode, generated_output, prompt_rows
from tl_core.bridges._stopping import reached
from tl_core.cache._cache import ActivationCache
from tl_core.certification._report import Certification
from tl_core.driver_api._batching import TokenBatch, check_token_range, pad_batch
from tl_core.driver_api._capabilities import CertifyingDriver, DescribingDriver, ReadoutDriver
from tl_core.driver_api._discovery import get_driver_entry
from tl_core.driver_api._images import ImageInput, vision_of, with_image_tokens
from tl_core.driver_api._layers import block_index, outside_partial, partial_refusal
from tl_core.driver_api._protocol import validate_driver
from tl_core.driver_api._request import (
    ForwardRequest,
    ForwardResult,
    LogitsWanted,
    decoder_batch,
    partial_layers,
    planned_request,
)
from tl_core.driver_api._sampling import SamplingOptions
from tl_core.driver_api._tokenizers import Tokenizer, padding_id
from tl_core.hooks._hook_point import HookHandle, HookPoint
from tl_core.hooks._model_info import ModelInfo
from tl_core.hooks._namespace import HookNamespace
from tl_core.sae._splice import Splice, splice

__all__ = ["Bridge", "HookSpec", "ModelInput", "NamesFilter", "ReturnType"]

#: Text, texts, or token ids (1-D/2-D tensor, list, or ragged list of lists).
ModelInput = Union[str, Sequence[str], torch.Tensor, Sequence[int], Sequence[Sequence[int]]]
#: ``(hook name or predicate on canonical names, hook function)``.
HookSpec = tuple[Union[str, Callable[[str], bool]], Callable[..., Any]]
NamesFilter = Union[None, str, Iterable[str], Callable[[str], bool]]
ReturnType = Literal["logits", "loss", "both"] | None

_B = TypeVar("_B", bound="Bridge")
_RETURN_TYPES = ("logits", "loss", "both", None)


class Bridge:
    """The bridge API over any driver: hooks, caches, specs, loss and generation.

    Every hook name argument accepts canonical names and aliases; names resolve through
    the booted model's ``namespace``, the same way for capture, specs and cache lookup.
    """

    #: The driver kind this bridge wraps (``DriverEntry.kind``).
    kind: ClassVar[str]
    #: The booted driver that runs the model (it implements ``tl_core.driver_api.Driver``).
    driver: Any
    _permanent: list[HookHandle]

    # -- construction -----------------------------------------------------------------

    @classmethod
    def boot(cls: type[_B], model: Any = None, *, driver: str, **options: Any) -> _B:
        """Boot a driver found through the ``tl_core.drivers`` entry points.

        The driver's kind is checked before anything loads, so asking the wrong bridge
        for a driver starts no engine.

        Args:
            model: What the driver loads (a folder, a hub id, a config, ...).
            driver: A driver name from ``tl drivers``.
            **options: The driver's boot options.

        Raises:
            DriverNotFoundError: The driver is not installed.
            UserError: The driver is of the other kind (the message names the bridge).
        """
        entry = get_driver_entry(driver)
        if entry.kind != cls.kind:
            other = "TransformerBridge" if entry.kind == "local" else "RemoteBridge"
            raise UserError(
                f"driver {driver!r} is a {entry.kind} driver, so {cls.__name__} cannot wrap "
                f"it; boot it with {other}.boot(model, driver={driver!r}) or "
                f"tl_core.boot(model, driver={driver!r}). Nothing was started."
            )
        instance = entry.load().boot(model, **options)
        try:
            return cls(instance)  # type: ignore[call-arg]
        except BaseException:
            close = getattr(instance, "close", None)
            if callable(close):  # a driver that breaks the contract may have no close()
                close()
            raise

    def _adopt(self, driver: Any) -> None:
        validate_driver(driver, name=getattr(driver, "name", None))
        self.driver = driver
        self._permanent = []

    # -- facts ------------------------------------------------------------------------

    @property
    def namespace(self) -> HookNamespace:
        """The model's hook names as this driver serves them."""
        return self.driver.namespace  # type: ignore[no-any-return]

    @property
    def certification(self) -> Certification | None:
        """The driver's certification report of the booted model (which hooks are served,
        with what status, and the equations that proved them), or ``None`` when the driver
        does not certify or was booted with ``certify=False``."""
        if not isinstance(self.driver, CertifyingDriver):
            return None
        report = self.driver.certification
        return report if isinstance(report, Certification) else None

    @property
    def architecture(self) -> Architecture | None:
        """What the booted model is, independent of the engine (block form, norms, attention
        and MLP variants, unembedding), or ``None`` when the driver does not describe it.
        Two drivers serving the same checkpoint give the same description."""
        if not isinstance(self.driver, DescribingDriver):
            return None
        described = self.driver.architecture
        return described if isinstance(described, Architecture) else None

    @property
    def device(self) -> torch.device:
        """Where the bridge takes token ids and returns tensors."""
        return torch.device("cpu")

    @property
    def cfg(self) -> ModelInfo:
        """Sizes and structure of the model; ``cfg.device`` is ``device``."""
        info: ModelInfo = self.driver.info
        device = self.device
        return info if info.device == device else replace(info, device=device)

    @property
    def tokenizer(self) -> Tokenizer:
        """The driver's tokenizer."""
        return self.driver.tokenizer  # type: ignore[no-any-return]

    @property
    def hook_dict(self) -> dict[str, HookPoint]:
        """Canonical hook name -> HookPoint for every hook this bridge can fire."""
        raise NotImplementedError

    def _execute(self, request: ForwardRequest) -> ForwardResult:
        """Run the engine once; ``logits`` holds the residual stream when stopping early."""
        raise NotImplementedError

    def _request(
        self,
        batch: TokenBatch,
        *,
        capture: Sequence[str] = (),
        intervene: Any = None,
        max_new_tokens: int = 0,
        logits: LogitsWanted = "all",
        sampling: SamplingOptions | None = None,
        stop_at_eos: bool = True,
        start_at_layer: int | None = None,
        stop_at_layer: int | None = None,
        residual: torch.Tensor | None = None,
        capture_device: torch.device | str | None = None,
        token_type_ids: Any = None,
        images: Any = None,
        decoder_input: Any = None,
        signal: torch.Tensor | None = None,
    ) -> ForwardRequest:
        """The one request of a bridge call: names canonical, layers resolved, specs planned."""
        return planned_request(
            self.driver,
            batch,
            intervene=intervene,
            capture=tuple(capture),
            max_new_tokens=max_new_tokens,
            logits=logits,
            sampling=sampling if sampling is not None else SamplingOptions(),
            stop_at_eos=stop_at_eos,
            stop_at_layer=stop_at_layer,
            start_at_layer=start_at_layer,
            residual=residual,
            capture_device=capture_device,
            token_type_ids=token_type_ids,
            images=images,
            decoder_batch=decoder_batch(
                self.driver, self._decoder_ids(decoder_input), len(batch.lengths)
            ),
            signal=signal,
        )

    def _decoder_ids(self, decoder_input: Any) -> Any:
        """An encoder-decoder's decoder input as ids: text (one or a list) is tokenized
        without special tokens after the decoder start token; ids are taken as they are."""
        if not getattr(self.driver, "encoder_decoder", False) or decoder_input is None:
            return decoder_input
        text = isinstance(decoder_input, str) or (
            isinstance(decoder_input, list) and any(isinstance(t, str) for t in decoder_input)
        )
        start = self.driver.decoder_start_ids if text else ()
        if isinstance(decoder_input, str):
            return [*start, *self.tokenizer.encode(decoder_input)]
        if (
            isinstance(decoder_input, list)
            and decoder_input
            and all(isinstance(t, str) for t in decoder_input)
        ):
            return [[*start, *self.tokenizer.encode(t)] for t in decoder_input]
        return decoder_input

    def _image_batch(self, batch: TokenBatch, images: Any) -> TokenBatch:
        """``batch`` with each lone image token widened to one image's run, when images come."""
        if images is None:
            return batch
        vision = vision_of(self.driver)
        return with_image_tokens(batch, vision, padding_id(self.tokenizer))

    def _check_next_token_loss(self, what: str) -> None:
        """Refuse a next-token loss on a model that predicts no next token (a masked LM).

        Raises:
            UnsupportedFeatureError: The architecture is a masked LM.
        """
        reads = getattr(self.driver, "signal_input", None)
        if reads is not None:
            raise UnsupportedFeatureError(
                f"{what} needs the next-token loss, and {self._name!r} reads {reads}, not "
                "tokens: it predicts a label per input (or per audio frame), not a next token. "
                "Take the loss you need from the logits"
            )
        described = self.architecture
        if described is not None and described.kind == "masked_lm":
            raise UnsupportedFeatureError(
                f"{what} needs the next-token loss, and {described.name!r} is a masked LM: its "
                "logits at a position predict that position's own (masked) token, not the "
                "next one. Take the masked-LM loss from the logits at the masked positions"
            )

    # -- tokens -----------------------------------------------------------------------

    def to_tokens(
        self,
        text: str | Sequence[str],
        *,
        prepend_bos: bool = True,
        padding_side: Literal["right", "left"] = "right",
        move_to_device: bool = True,
        truncate: bool = True,
    ) -> torch.Tensor:
        """Token ids ``[batch, pos]`` of one text or a list of texts (padded with the pad id).

        Args:
            text: A text or texts.
            prepend_bos: Put the BOS token first.
            padding_side: Where shorter texts are padded.
            move_to_device: Put the ids on ``device`` (else on the CPU).
            truncate: Cut texts to the model's context length ``cfg.n_ctx``.

        Raises:
            UserError: ``None``, an empty list, a list mixing texts with other values, or
                text the tokenizer cannot encode (a lone surrogate); the message names the
                prompt.
        """
        batch = self._token_batch(
            text, prepend_bos=prepend_bos, padding_side=padding_side, check_vocab=False
        )
        ids = batch.ids
        if truncate and ids.shape[1] > self.cfg.n_ctx > 0:
            ids = ids[:, : self.cfg.n_ctx]
        return ids.to(self.device) if move_to_device else ids

    def to_string(
        self, tokens: torch.Tensor | Sequence[int] | Sequence[Sequence[int]]
    ) -> str | list[str]:
        """Decode ``[pos]`` ids to a string, or ``[batch, pos]`` ids to a list of strings."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.tolist()
        items = list(tokens)
        if items and isinstance(items[0], (list, tuple)):
            return [self.tokenizer.decode(row) for row in items]
        return self.tokenizer.decode(items)

    def to_str_tokens(
        self, text: str | torch.Tensor | Sequence[int], *, prepend_bos: bool = True
    ) -> list[str]:
        """One readable string per token of ``text`` (or of the given ids)."""
        if isinstance(text, str):
            ids = encode(self.tokenizer, text, prepend_bos)
        else:
            ids = text.flatten().tolist() if isinstance(text, torch.Tensor) else list(text)
        return [self.tokenizer.token_to_str(int(i)) for i in ids]

    def to_single_token(self, text: str) -> int:
        """The id of ``text`` if it is exactly one token.

        Raises:
            UserError: If it encodes to zero or several tokens.
        """
        ids = self.tokenizer.encode(text)
        if len(ids) != 1:
            raise UserError(f"{text!r} is {len(ids)} tokens ({ids}), not a single token")
        return ids[0]

    def _token_batch(
        self,
        inputs: ModelInput,
        *,
        prepend_bos: bool = True,
        padding_side: Literal["right", "left"] = "right",
        check_vocab: bool = True,
    ) -> TokenBatch:
        """Tokenize text (or take ids as they are) into a right- or left-padded batch.

        Every malformed input is refused here, before any engine work, with the prompt (and
        position) at fault; ``check_vocab`` also refuses ids outside ``0..d_vocab-1``.
        """
        reads = getattr(self.driver, "signal_input", None)
        if reads is not None:
            raise UnsupportedFeatureError(
                f"{self._name!r} reads {reads}, not tokens: pass them as a float tensor to "
                f"forward or run_with_cache ({self.driver.signal_shape}); this call needs "
                "token ids"
            )
        rows = prompt_rows(self.tokenizer, inputs, prepend_bos)
        batch = pad_batch(rows, pad_id=padding_id(self.tokenizer), padding_side=padding_side)
        if check_vocab:
            check_token_range(batch, self.driver.info.d_vocab)
        return batch

    def _inputs(
        self, source: Any, prepend_bos: bool, images: Any
    ) -> tuple[TokenBatch, torch.Tensor | None]:
        """The batch of a call's input, and the signal when the model reads no tokens (its
        batch then holds one placeholder id per position of the stream its blocks read)."""
        if getattr(self.driver, "signal_input", None) is None:
            batch = self._token_batch(source, prepend_bos=prepend_bos)
            return self._image_batch(batch, images), None
        if images is not None:
            raise UserError(
                f"images= feeds a vision-language model's image tokens; {self._name!r} "
                "reads its pixels as its input: pass them as input"
            )
        signal, batch = self.driver.signal_batch(source)
        return batch, signal

    def _check_context(self, batch: TokenBatch, max_new_tokens: int = 0) -> None:
        """Refuse prompts (plus new tokens) past the model's context, before engine work."""
        check_context(self.driver.info, self._name, batch, max_new_tokens)

    # -- hooks ------------------------------------------------------------------------

    def get_hook_point(self, name: str) -> HookPoint:
        """The HookPoint for ``name`` (canonical or any alias)."""
        return self.hook_dict[self.namespace.lookup(name)]

    def select_hooks(self, names_filter: NamesFilter) -> list[str]:
        """Canonical names chosen by a filter: ``None`` (all), a name, names, or a predicate.

        A predicate sees canonical names; names may be aliases.
        """
        if names_filter is None:
            return list(self.hook_dict)
        if isinstance(names_filter, str):
            return [self.namespace.lookup(names_filter)]
        if callable(names_filter):
            return [n for n in self.hook_dict if names_filter(n)]
        return list(dict.fromkeys(self.namespace.lookup(n) for n in names_filter))

    def add_hook(
        self,
        name: str | Callable[[str], bool],
        hook: Callable[..., Any],
        dir: Literal["fwd", "bwd"] = "fwd",
        *,
        is_permanent: bool = False,
    ) -> list[HookHandle]:
        """Attach ``hook`` to one named hook, or to every hook a predicate selects.

        Raises:
            UnsupportedFeatureError: A backward hook on a driver without gradients.
        """
        if dir == "bwd":
            self._require("gradients", "backward hooks need gradients")
        if callable(name):
            names = [n for n in self.hook_dict if name(n)]
        else:
            names = [self.namespace.lookup(name)]
        handles = [self.hook_dict[n].add_hook(hook, dir, is_permanent=is_permanent) for n in names]
        if is_permanent:
            self._permanent.extend(handles)
        return handles

    def add_sae(self, dictionary: SparseDictionary, **options: Any) -> Splice:
        """Splice a sparse autoencoder or transcoder into every forward until
        ``.remove()`` on the result; its sites (``<hook>.hook_sae_acts_post``, ...) then take
        captures and specs. Options and errors: ``tl_core.sae.splice``."""
        return splice(self, dictionary, **options)

    def reset_hooks(self, *, including_permanent: bool = False) -> None:
        """Remove every hook (permanent ones too when asked)."""
        for point in self.hook_dict.values():
            point.remove_hooks("both", including_permanent=including_permanent)

    def run_with_hooks(
        self,
        input: ModelInput,
        *,
        fwd_hooks: Sequence[HookSpec] = (),
        bwd_hooks: Sequence[HookSpec] = (),
        reset_hooks_end: bool = True,
        return_type: ReturnType = "logits",
        **forward_kwargs: Any,
    ) -> Any:
        """Run with temporary hooks: ``[(name or predicate, fn(tensor, hook=...)), ...]``.

        Hooks are removed afterwards (unless ``reset_hooks_end=False``), also when the
        forward raises. On local drivers forward hooks may edit values, and backward hooks
        fire when you call ``.backward()`` on the result, so pass ``reset_hooks_end=False``
        for them or run the backward inside ``hooks()``. On remote drivers hooks read the
        captured values after the engine ran and must not change them.

        Order on one hook (local drivers): hooks already attached (``add_hook``,
        ``hooks()``, permanent ones) in the order they were attached, then these, then the
        ``intervene`` specs (in list order), then ``intervene`` callables (in list order);
        each sees what the one before returned. See ``docs/interventions.md``.

        Raises:
            UserError: With ``start_at_layer``/``stop_at_layer`` in ``forward_kwargs``, a
                hook named (not a predicate) at a site that partial forward never runs.
        """
        self._check_partial_hooks(
            {"fwd_hooks": fwd_hooks, "bwd_hooks": bwd_hooks},
            forward_kwargs.get("start_at_layer"),
            forward_kwargs.get("stop_at_layer"),
        )
        with self.hooks(fwd_hooks, bwd_hooks, reset_hooks_end=reset_hooks_end):
            return self.forward(input, return_type, **forward_kwargs)

    @contextmanager
    def hooks(
        self,
        fwd_hooks: Sequence[HookSpec] = (),
        bwd_hooks: Sequence[HookSpec] = (),
        *,
        reset_hooks_end: bool = True,
    ) -> Iterator[Any]:
        """Attach hooks for the duration of a ``with`` block; they are removed on exit,
        also when the block raises (unless ``reset_hooks_end=False``)."""
        handles: list[HookHandle] = []
        try:
            for direction, specs in (("fwd", fwd_hooks), ("bwd", bwd_hooks)):
                for name, fn in specs:
                    handles.extend(self.add_hook(name, fn, direction))  # type: ignore[arg-type]
            yield self
        finally:
            if reset_hooks_end:
                for handle in handles:
                    handle.remove()

    # -- running ----------------------------------------------------------------------

    def forward(
        self,
        input: ModelInput | None = None,
        return_type: ReturnType = "logits",
        *,
        intervene: Any = None,
        prepend_bos: bool = True,
        loss_per_token: bool = False,
        start_at_layer: int | None = None,
        stop_at_layer: int | None = None,
        residual: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
        token_type_ids: Any = None,
        images: ImageInput | None = None,
        decoder_input: Any = None,
    ) -> Any:
        """Run the model.

        Args:
            input: Text, texts or token ids. Ragged batches are right-padded; padding never
                reaches the loss. A model that reads no tokens (``driver.signal_input``: an
                image classifier, a CTC speech recogniser) takes its pixels
                ``[batch, channels, height, width]`` or audio samples ``[batch, samples]``.
            return_type: ``"logits"``, ``"loss"``, ``"both"`` (a ``(logits, loss)`` pair)
                or ``None``.
            intervene: Specs (and, on local drivers, callables) per hook; see
                ``tl_core.InterventionSpec``. On one hook, Python hooks attached to the
                bridge run first, then the specs, then the callables.
            prepend_bos: Put the BOS token before text input.
            loss_per_token: Return per-position losses.
            start_at_layer: Start at this block; pass its input as ``residual`` (``input``
                still supplies the token ids for the loss). Local drivers only.
            stop_at_layer: Stop before this block and return the residual stream entering
                it (``n_layers``: the final norm's input).
            residual: The residual stream entering ``start_at_layer``.
            tokens: Token ids for the loss when ``input`` is ``None`` (with ``residual``).
            token_type_ids: Segment ids of an encoder's prompts (BERT's sentence A and B):
                a ``[batch, pos]`` tensor of the padded ids' shape, or one list per prompt
                as long as the prompt; drivers and models without them refuse it.
            images: A vision-language model's images, one per image token of the prompts
                in order: pixel tensors ``[n, channels, height, width]`` (or a list of
                ``[channels, height, width]``), or PIL images, arrays or file paths, which
                the driver reads with the checkpoint's image processor. A lone image token
                is widened to the positions one image fills
                (``architecture.vision.tokens_per_image``); ``"pos": "image"`` in a spec
                edits those positions.
            decoder_input: An encoder-decoder's (T5, BART) decoder input: text (tokenized
                after the decoder start token), one sequence of ids for every prompt, or
                one per prompt. ``None``: the decoder start token alone. The logits and the
                loss are the decoder's (each position predicts the next decoder token).

        Returns:
            Logits ``[batch, pos, d_vocab]``, the loss, both, the residual stream when
            ``stop_at_layer`` is set, or ``None``.

        Raises:
            UserError: Bad arguments, names or specs, before the engine runs; among them
                specs or callables on hooks a partial forward never runs (before
                ``start_at_layer`` or from ``stop_at_layer`` on).
            UnsupportedFeatureError: What the driver cannot do (a remote engine starting
                from a residual, a loss without sequence logits).
        """
        _check_return_type(return_type)
        if input is None and tokens is None and residual is None:
            raise UserError(
                "the input is None; expected a text, a list of texts, or token ids (or "
                "residual= with start_at_layer= to start from a block's input)"
            )
        start, stop = partial_layers(
            start_at_layer, stop_at_layer, residual, n_layers=self.driver.info.n_layers
        )
        source = input if input is not None else tokens
        if source is None:
            assert residual is not None
            batch = pad_batch(torch.zeros(residual.shape[:2], dtype=torch.long), pad_id=0)
            signal = None
        else:
            batch, signal = self._inputs(source, prepend_bos, images)
        self._check_context(batch)
        wants_loss = stop is None and return_type in ("loss", "both")
        if wants_loss and source is None:
            raise UserError("a loss needs the token ids: pass input or tokens")
        if wants_loss:
            self._check_next_token_loss(f"return_type={return_type!r}")
        request = self._request(
            batch,
            intervene=intervene,
            logits="all" if return_type is not None else "none",
            start_at_layer=start,
            stop_at_layer=stop,
            residual=residual,
            token_type_ids=token_type_ids,
            images=images,
            decoder_input=decoder_input,
            signal=signal,
        )
        result = self._execute(request)
        targets = batch if request.decoder_batch is None else request.decoder_batch
        return self._output(result, targets, return_type, loss_per_token, stop)

    def loss(
        self,
        input: ModelInput,
        *,
        per_token: bool = False,
        intervene: Any = None,
        prepend_bos: bool = True,
    ) -> torch.Tensor:
        """Mean next-token cross-entropy over real positions (or per position).

        Raises:
            UnsupportedFeatureError: The driver returns no sequence logits (before running).
        """
        return self.forward(  # type: ignore[no-any-return]
            input, "loss", intervene=intervene, prepend_bos=prepend_bos, loss_per_token=per_token
        )

    def run_with_cache(
        self,
        input: ModelInput,
        *,
        names_filter: NamesFilter = None,
        device: torch.device | str | None = None,
        remove_batch_dim: bool = False,
        intervene: Any = None,
        return_type: ReturnType = "logits",
        prepend_bos: bool = True,
        stop_at_layer: int | None = None,
        incl_bwd: bool = False,
        token_type_ids: Any = None,
        images: ImageInput | None = None,
        decoder_input: Any = None,
    ) -> tuple[Any, ActivationCache]:
        """Run and cache activations.

        Args:
            input: Text, texts or ids; ragged batches are right-padded and the cache keeps
                each prompt's length (``cache.lengths``; ``cache.prompt(i)`` trims). Pixels
                or audio samples for a model that reads no tokens, as in ``forward``.
            names_filter: ``None`` for every hook, a name, a list of names (aliases ok), or
                a predicate over canonical names.
            device: Where cached tensors go (default: where they were computed).
            remove_batch_dim: Drop the batch axis (batch of one only).
            intervene: Specs applied during the run; the cache holds edited values (each
                hook's value after every Python hook, spec and callable on it).
            return_type: As in ``forward``.
            prepend_bos: Put BOS before text input.
            stop_at_layer: Stop before this block: the first output is the residual stream
                entering it, and only hooks before it are cached (``None`` or a predicate
                as ``names_filter`` keeps those; a name past the stop is an error). A
                remote engine still runs the whole model, but returns no logits.
            incl_bwd: Also cache gradients (drivers with gradients): computes the loss,
                calls ``backward()`` and stores each selected hook's gradient in
                ``cache.grads``.
            token_type_ids: As in ``forward``.
            images: As in ``forward``; the cache's positions are the widened prompts'.
            decoder_input: As in ``forward``. The decoder's sites (``decoder_blocks.*``
                but cross-attention's keys and values) lie over the decoder's positions;
                ``cache.lengths`` are the prompts'.

        Returns:
            ``(output, cache)``.

        Raises:
            UserError: Bad arguments, names or specs, before the engine runs; with
                ``stop_at_layer``, a hook named in ``names_filter`` (or every hook a
                predicate selects) past the stop.
            UnsupportedFeatureError: ``incl_bwd`` on a driver without gradients.
        """
        _check_return_type(return_type)
        names = self.select_hooks(names_filter)
        _, stop = partial_layers(None, stop_at_layer, None, n_layers=self.driver.info.n_layers)
        if stop is not None:
            names = self._reached_names(names_filter, names, stop)
        batch, signal = self._inputs(input, prepend_bos, images)
        self._check_context(batch)
        grads: dict[str, torch.Tensor] = {}
        bwd: list[HookSpec] = []
        if incl_bwd:
            self._require("gradients", "incl_bwd=True caches gradients")
            if stop is not None:
                raise UserError("incl_bwd needs the loss, which stop_at_layer skips")
            self._check_next_token_loss("incl_bwd=True")
            bwd = [(n, _GradCapture(grads, n, device)) for n in names]
        elif return_type in ("loss", "both") and stop is None:
            self._check_next_token_loss(f"return_type={return_type!r}")
        with self.hooks((), bwd):
            request = self._request(
                batch,
                capture=names,
                intervene=intervene,
                logits="all" if return_type is not None or incl_bwd else "none",
                capture_device=device,
                stop_at_layer=stop,
                token_type_ids=token_type_ids,
                images=images,
                decoder_input=decoder_input,
                signal=signal,
            )
            result = self._execute(request)
            targets = batch if request.decoder_batch is None else request.decoder_batch
            if incl_bwd:
                assert result.logits is not None
                loss = next_token_loss(result.logits, targets.ids, targets.lengths)
                loss.backward()  # type: ignore[no-untyped-call]
                both = (result.logits, loss)
                out: Any = {"logits": result.logits, "loss": loss, "both": both}[
                    return_type or "loss"
                ]
            else:
                out = self._output(result, targets, return_type, False, stop)
        captured = {n: result.captured[n] for n in names if n in result.captured}
        cache = ActivationCache(
            captured,
            namespace=self.namespace,
            readout=self.driver.readout if isinstance(self.driver, ReadoutDriver) else None,
            lengths=batch.lengths,
        )
        if incl_bwd:
            cache.grads = ActivationCache(grads, namespace=self.namespace, lengths=batch.lengths)
        return out, (cache.remove_batch_dim() if remove_batch_dim else cache)

    def generate(
        self,
        input: ModelInput,
        max_new_tokens: int = 10,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop_at_eos: bool = True,
        intervene: Any = None,
        prepend_bos: bool = True,
        return_type: Literal["str", "tokens"] | None = None,
        images: ImageInput | None = None,
        decoder_input: Any = None,
    ) -> str | list[str] | torch.Tensor:
        """Continue the prompt(s) with hooks (``hooks()``) and specs active at every step.

        ``images`` are a vision-language model's images, as in ``forward``. An
        encoder-decoder's decoder continues ``decoder_input`` (as in ``forward``; by default
        its start token), and the new tokens are the decoder's.

        Returns:
            Text for text input, else ``[batch, n]`` new token ids (``return_type``
            overrides). Sequences that hit EOS are padded with EOS afterwards.

        Raises:
            UserError: ``max_new_tokens < 1``, a prompt plus ``max_new_tokens`` longer than
                ``cfg.n_ctx`` (the message gives the largest ``max_new_tokens`` that fits),
                bad inputs, sampling options, names or specs; all before decoding starts.
        """
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, int)
            or max_new_tokens < 1
        ):
            raise UserError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        batch = self._image_batch(self._token_batch(input, prepend_bos=prepend_bos), images)
        self._check_context(batch, max_new_tokens)
        sampling = SamplingOptions(
            do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed
        )
        if not isinstance(stop_at_eos, bool):
            raise UserError(f"stop_at_eos must be True or False, got {stop_at_eos!r}")
        request = self._request(
            batch,
            intervene=intervene,
            max_new_tokens=max_new_tokens,
            logits="none",
            sampling=sampling,
            stop_at_eos=stop_at_eos,
            images=images,
            decoder_input=decoder_input,
        )
        with torch.no_grad():
            result = self._execute(request)
        assert result.new_tokens is not None
        return generated_output(self.tokenizer, input, result.new_tokens, return_type)

    # -- helpers ----------------------------------------------------------------------

    def _output(
        self,
        result: ForwardResult,
        batch: TokenBatch,
        return_type: ReturnType,
        per_token: bool,
        stop_at_layer: int | None,
    ) -> Any:
        if stop_at_layer is not None or return_type == "logits":
            return result.logits
        if return_type is None:
            return None
        assert result.logits is not None
        loss = next_token_loss(result.logits, batch.ids, batch.lengths, per_token=per_token)
        return loss if return_type == "loss" else (result.logits, loss)

    def _reached_names(self, names_filter: NamesFilter, names: list[str], stop: int) -> list[str]:
        """The selected hooks a forward stopped before block ``stop`` runs.

        ``None`` and predicates select "whatever runs"; hooks named one by one must all run.

        Raises:
            UserError: A named hook past the stop, or a predicate whose hooks all are.
        """
        dictionaries = self.namespace.dictionaries
        kept = [n for n in names if reached(n, stop, dictionaries)]
        broad = names_filter is None or callable(names_filter)
        if (broad and names and not kept) or (not broad and len(kept) < len(names)):
            missed = [n for n in names if n not in kept]
            raise partial_refusal({"names_filter": missed}, None, stop, dictionaries)
        return kept

    def _check_partial_hooks(
        self, specs: dict[str, Sequence[HookSpec]], start_at_layer: object, stop_at_layer: object
    ) -> None:
        """Refuse hooks named for a partial forward that never runs them."""
        n_layers = self.driver.info.n_layers
        start = (
            None
            if start_at_layer is None
            else block_index(start_at_layer, "start_at_layer", n_layers)
        )
        stop = (
            None if stop_at_layer is None else block_index(stop_at_layer, "stop_at_layer", n_layers)
        )
        if start is None and stop is None:
            return
        dictionaries = self.namespace.dictionaries
        missed = {
            role: outside_partial(
                [self.namespace.lookup(name) for name, _ in items if isinstance(name, str)],
                start,
                stop,
                dictionaries,
            )
            for role, items in specs.items()
        }
        if any(missed.values()):
            raise partial_refusal(missed, start, stop, dictionaries)

    def _require(self, feature: str, what: str) -> None:
        if not self.driver.supports(feature):
            raise UnsupportedFeatureError(
                f"driver {self._name!r} has no {feature}, and {what}; use a local driver "
                f"(native, hf) for gradient work"
            )

    @property
    def _name(self) -> str:
        return str(getattr(self.driver, "name", type(self.driver).__name__))

    def close(self) -> None:
        """Release the driver (engine processes, memory); safe to call twice."""
        self.driver.close()

    def __enter__(self: _B) -> _B:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        info = self.driver.info
        return (
            f"{type(self).__name__}(driver={self._name!r}, arch={info.architecture!r}, "
            f"n_layers={info.n_layers}, d_model={info.d_model}, hooks={len(self.hook_dict)})"
        )


def _check_return_type(return_type: object) -> None:
    if return_type not in _RETURN_TYPES:
        raise UserError(
            f"return_type must be 'logits', 'loss', 'both' or None, got {return_type!r}"
        )


class _GradCapture:
    """A backward hook storing the gradient at one hook under its canonical name."""

    def __init__(self, store: dict[str, torch.Tensor], name: str, device: Any) -> None:
        self._store, self._name, self._device = store, name, device

    def __call__(self, grad: torch.Tensor, *, hook: HookPoint) -> None:
        grad = grad.detach()
        self._store[self._name] = grad.to(self._device) if self._device is not None else grad
