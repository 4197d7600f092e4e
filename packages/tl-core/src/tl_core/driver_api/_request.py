"""``ForwardRequest``: one engine call, validated once, that every driver trusts.

The bridge builds it (``Bridge._execute``) from what it already resolved: the padded batch,
canonical names, the intervention plan and the stop layer. A driver's ``run(request)`` does
no validation of its own and returns a ``ForwardResult``. The keyword form
``forward(input_ids, capture=..., intervene=...)`` is ``build_request`` followed by
``run``: ``RequestForward`` gives a driver that form.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from tl_core._errors import UnsupportedFeatureError, UserError
from tl_core.driver_api._batching import TokenBatch, check_token_range, pad_batch
from tl_core.driver_api._images import (
    checked_images,
    image_positions,
    vision_of,
    with_image_tokens,
)
from tl_core.driver_api._layers import block_index, outside_partial, partial_refusal
from tl_core.driver_api._sampling import SamplingOptions
from tl_core.driver_api._tokenizers import padding_id
from tl_core.specs._plan import InterventionPlan, build_plan

__all__ = [
    "LOCAL_OPTIONS",
    "ForwardRequest",
    "ForwardResult",
    "LogitsWanted",
    "RequestForward",
    "build_request",
    "checked_token_types",
    "logits_wanted",
    "partial_layers",
    "planned_request",
    "run_keywords",
]

#: Which logits a request wants: none, each prompt's last position, or every position.
LogitsWanted = Literal["none", "last", "all"]

#: ``forward`` keywords beyond the common ones that only in-process drivers take.
LOCAL_OPTIONS: frozenset[str] = frozenset(
    {"capture_device", "start_at_layer", "stop_at_layer", "residual"}
)

_COMMON = (
    "capture, decoder_input, images, intervene, max_new_tokens, return_logits, stop_at_eos, "
    "token_type_ids and the "
    "sampling options " + ", ".join(SamplingOptions.KEYS)
)


@dataclass(frozen=True)
class ForwardResult:
    """What one ``Driver.run`` call returns.

    Batches are right-padded: row ``b`` of every tensor holds prompt ``b`` in its first
    ``lengths[b]`` positions; later positions are padding and carry no meaning.

    Attributes:
        logits: ``[batch, pos, d_vocab]`` sequence logits, or ``None`` when not requested
            or when the driver cannot provide them.
        captured: Canonical hook name to tensor (``[batch, pos, ...]``, on the CPU unless
            the caller asked otherwise).
        new_tokens: Generated token ids per prompt (``[batch, n]``), or ``None``.
        raw_output: The engine's own result object, for callers who need more.
        lengths: Real length of each prompt.
    """

    logits: torch.Tensor | None
    captured: Mapping[str, torch.Tensor]
    new_tokens: torch.Tensor | None = None
    raw_output: Any = None
    lengths: tuple[int, ...] = field(default=())


@dataclass(frozen=True)
class ForwardRequest:
    """One validated engine call.

    Attributes:
        batch: Right-padded prompts on the CPU (ids in range, lengths per prompt).
        plan: The intervention plan, checked against the driver's namespace and the
            prompts' lengths.
        capture: Canonical hook names to return, each once, resolved against the same
            namespace.
        max_new_tokens: Tokens to generate (0: prefill only).
        logits: ``"all"`` (``[batch, pos, vocab]``), ``"last"`` (``[batch, 1, vocab]``,
            each prompt's last position) or ``"none"``.
        sampling: Validated decoding options.
        stop_at_eos: Stop a prompt's decoding at EOS (later tokens are EOS).
        stop_at_layer: Block index in ``0..n_layers`` to stop before (local drivers; the
            ``logits`` field then holds the residual stream).
        start_at_layer: Block index to start at from ``residual`` (local drivers).
        residual: ``[batch, pos, d_model]`` input of ``start_at_layer``.
        capture_device: Where captures go (``None``: where computed).
        token_type_ids: ``[batch, pos]`` segment ids of the prompts (an encoder's sentence
            A/B), right-padded with 0 like ``batch``; ``None`` leaves them to the model
            (all 0). Only drivers that support ``"token_type_ids"`` get one.
        images: ``[n, channels, height, width]`` pixels of a vision-language model's images,
            one per run of image tokens in prompt order (``checked_images``); ``None`` for
            text alone. Only drivers that support ``"images"`` get them.
        decoder_batch: An encoder-decoder's decoder inputs, right-padded, one per prompt
            (``batch`` is then what the encoder reads); ``None`` for other models. Logits,
            generation and the sites over the decoder's positions follow it.
        signal: What a model that reads no tokens reads instead (a driver whose
            ``signal_input`` names it): pixels ``[batch, channels, height, width]`` of an
            image classifier, or audio samples ``[batch, samples]`` of a speech encoder.
            ``batch`` then holds placeholder ids, one per position of the stream its blocks
            read (patches, audio frames), so that positions in specs and captures mean
            what they mean for text.
    """

    batch: TokenBatch
    plan: InterventionPlan
    capture: tuple[str, ...] = ()
    max_new_tokens: int = 0
    logits: LogitsWanted = "all"
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    stop_at_eos: bool = True
    stop_at_layer: int | None = None
    start_at_layer: int | None = None
    residual: torch.Tensor | None = None
    capture_device: torch.device | str | None = None
    token_type_ids: torch.Tensor | None = None
    images: torch.Tensor | None = None
    decoder_batch: TokenBatch | None = None
    signal: torch.Tensor | None = None

    @property
    def lengths(self) -> tuple[int, ...]:
        """Real length of each prompt."""
        return self.batch.lengths

    @property
    def decodes(self) -> bool:
        """Whether the call generates step by step (more than one token, or a sampled one)."""
        return self.max_new_tokens > 1 or (self.max_new_tokens == 1 and self.sampling.do_sample)


def build_request(
    driver: Any,
    input_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]],
    *,
    capture: Sequence[str] = (),
    intervene: Any = None,
    max_new_tokens: int = 1,
    return_logits: bool | Literal["last"] = True,
    **options: Any,
) -> ForwardRequest:
    """Check ``Driver.forward``'s keyword form against ``driver`` and build its request.

    The driver's ``forward_options`` (a set of names, e.g. ``LOCAL_OPTIONS``) say which
    keywords beyond the common ones it takes.

    Raises:
        UserError: Unknown options, bad ids, names, specs, sampling options or layers, all
            before any engine work; the message names what was wrong.
    """
    sampling = SamplingOptions.pop_from(options)
    token_type_ids = options.pop("token_type_ids", None)
    images = options.pop("images", None)
    decoder_input = options.pop("decoder_input", None)
    stop_at_eos = options.pop("stop_at_eos", True)
    if not isinstance(stop_at_eos, bool):
        raise UserError(f"stop_at_eos must be True or False, got {stop_at_eos!r}")
    accepted: frozenset[str] = getattr(driver, "forward_options", frozenset())
    unknown = sorted(set(options) - accepted)
    if unknown:
        extra = "".join(f", {name}" for name in sorted(accepted))
        local = sorted(set(unknown) & LOCAL_OPTIONS)
        hint = (
            f" ({', '.join(local)}: partial forwards and capture_device need a local driver, "
            "TransformerBridge.boot_transformers)"
            if local
            else ""
        )
        raise UserError(
            f"driver {driver.name!r} got unknown forward options {unknown}; it takes "
            f"{_COMMON}{extra}{hint}"
        )
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or max_new_tokens < 0
    ):
        raise UserError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    batch = pad_batch(input_ids, pad_id=padding_id(driver.tokenizer))
    if images is not None:
        batch = with_image_tokens(batch, vision_of(driver), padding_id(driver.tokenizer))
    check_token_range(batch, driver.info.d_vocab)
    namespace = driver.namespace
    start, stop = partial_layers(
        options.get("start_at_layer"),
        options.get("stop_at_layer"),
        options.get("residual"),
        n_layers=driver.info.n_layers,
    )
    if (start is not None or stop is not None) and (
        max_new_tokens > 1 or (max_new_tokens == 1 and sampling.do_sample)
    ):
        raise UserError(
            f"start_at_layer/stop_at_layer cannot be combined with generation (max_new_tokens="
            f"{max_new_tokens}); run the partial forward with max_new_tokens=0 or 1"
        )
    return planned_request(
        driver,
        batch,
        intervene=intervene,
        capture=tuple(dict.fromkeys(namespace.lookup(n) for n in capture)),
        max_new_tokens=max_new_tokens,
        logits=logits_wanted(return_logits),
        sampling=sampling,
        stop_at_eos=stop_at_eos,
        stop_at_layer=stop,
        start_at_layer=start,
        residual=options.get("residual"),
        capture_device=options.get("capture_device"),
        token_type_ids=token_type_ids,
        images=images,
        decoder_batch=decoder_batch(driver, decoder_input, len(batch.lengths)),
    )


def decoder_batch(driver: Any, decoder_input: Any, prompts: int) -> TokenBatch | None:
    """The decoder's inputs of an encoder-decoder, checked and right-padded.

    Args:
        driver: The driver that will run them (``driver.encoder_decoder`` says it runs an
            encoder-decoder, ``driver.decoder_start_ids`` the ids a decoder input starts from).
        decoder_input: ``None`` (each prompt's decoder reads ``decoder_start_ids`` alone),
            or ids as for prompts: one sequence for every prompt, or one per prompt.
        prompts: How many prompts the encoder reads.

    Returns:
        ``None`` for a driver of another model (``decoder_input`` must then be ``None``).

    Raises:
        UserError: Decoder inputs for a model without a decoder stack, ids out of range, or
            a count of sequences that is neither 1 nor the number of prompts.
    """
    if not getattr(driver, "encoder_decoder", False):
        if decoder_input is not None:
            raise UserError(
                f"driver {driver.name!r} runs {driver.info.architecture or 'a model'} with one "
                "stack: decoder_input feeds an encoder-decoder's decoder (T5, BART); drop it"
            )
        return None
    ids = [list(driver.decoder_start_ids)] if decoder_input is None else decoder_input
    batch = pad_batch(ids, pad_id=padding_id(driver.tokenizer))
    if len(batch.lengths) == 1 and prompts > 1:
        batch = pad_batch([batch.ids[0, : batch.lengths[0]].tolist()] * prompts, pad_id=0)
    if len(batch.lengths) != prompts:
        raise UserError(
            f"decoder_input holds {len(batch.lengths)} sequences for {prompts} prompts: give "
            "one sequence for every prompt, or one per prompt"
        )
    check_token_range(batch, driver.info.d_vocab)
    return batch


def planned_request(
    driver: Any, batch: TokenBatch, *, intervene: Any = None, **fields: Any
) -> ForwardRequest:
    """A request for ``batch`` with ``intervene`` planned against ``driver``'s namespace.

    Args:
        driver: The driver that will run it (its namespace, and whether it takes callables).
        batch: The checked, right-padded prompts.
        intervene: The ``intervene=`` argument.
        **fields: The other ``ForwardRequest`` fields, already checked (canonical names,
            resolved layers, ``SamplingOptions``).

    Raises:
        SpecError, HookNameError: From ``build_plan``.
        UserError: A capture or an edit on a hook that a partial forward
            (``start_at_layer``/``stop_at_layer``) never runs.
    """
    if fields.get("token_type_ids") is not None:
        fields["token_type_ids"] = checked_token_types(driver, fields["token_type_ids"], batch)
    if fields.get("images") is not None:
        fields["images"] = checked_images(driver, fields["images"], batch)
        if fields.get("start_at_layer") is not None:
            raise UserError(
                "images reach the model through its embeddings, which a forward from "
                "start_at_layer skips (its residual already holds them); drop images="
            )
    namespace = driver.namespace
    plan = build_plan(
        intervene,
        lengths=batch.lengths,
        namespace=namespace,
        allow_callables=driver.supports("intervention_callbacks"),
        image_positions=(
            None if fields.get("images") is None else image_positions(vision_of(driver), batch)
        ),
        decoder_lengths=(
            None if fields.get("decoder_batch") is None else fields["decoder_batch"].lengths
        ),
    )
    start, stop = fields.get("start_at_layer"), fields.get("stop_at_layer")
    if start is not None or stop is not None:
        # A hook the forward never reaches would come back missing, or its edit undone.
        dictionaries = namespace.dictionaries
        missed = {
            "capture": outside_partial(fields.get("capture", ()), start, stop, dictionaries),
            "intervene": outside_partial(sorted(plan.hooks), start, stop, dictionaries),
        }
        if any(missed.values()):
            raise partial_refusal(missed, start, stop, dictionaries)
    request = ForwardRequest(batch=batch, plan=plan, **fields)
    if request.token_type_ids is not None and request.decodes:
        raise UserError(
            "token_type_ids segment a prompt for one forward pass; generated tokens would "
            "have none, so they cannot be combined with generation (max_new_tokens="
            f"{request.max_new_tokens}): run the forward with max_new_tokens=0 or 1"
        )
    return request


def checked_token_types(driver: Any, value: object, batch: TokenBatch) -> torch.Tensor:
    """``token_type_ids`` as a ``[batch, pos]`` integer tensor padded like ``batch``.

    Args:
        driver: The driver that will run it (it must support ``"token_type_ids"``).
        value: A tensor of the padded batch's shape, or one list of ids per prompt, each as
            long as its prompt.
        batch: The checked, right-padded prompts.

    Raises:
        UnsupportedFeatureError: The driver (or its model) takes no segment ids.
        UserError: Another shape, row lengths that are not the prompts', or ids that are
            not non-negative integers (named with the prompt).
    """
    if not driver.supports("token_type_ids"):
        raise UnsupportedFeatureError(
            f"driver {driver.name!r} takes no token_type_ids for this model: segment ids "
            "exist for encoders with a token-type embedding (BERT); drop token_type_ids"
        )
    width = batch.ids.shape[1]
    if isinstance(value, torch.Tensor):
        if value.ndim == 1 and len(batch.lengths) == 1:
            value = value[None]
        if tuple(value.shape) != (len(batch.lengths), width):
            raise UserError(
                f"token_type_ids has shape {tuple(value.shape)}; the prompts' padded ids have "
                f"shape {(len(batch.lengths), width)}: give one segment id per token"
            )
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise UserError(f"token_type_ids must hold integers, got dtype {value.dtype}")
        types = value.detach().to("cpu", torch.long)
    elif isinstance(value, (list, tuple)):
        rows = list(value)
        if rows and not isinstance(rows[0], (list, tuple)) and len(batch.lengths) == 1:
            rows = [rows]
        if len(rows) != len(batch.lengths):
            raise UserError(
                f"token_type_ids has {len(rows)} rows for {len(batch.lengths)} prompts: give "
                "one list of segment ids per prompt"
            )
        types = torch.zeros((len(rows), width), dtype=torch.long)
        for b, (row, n) in enumerate(zip(rows, batch.lengths, strict=True)):
            if not isinstance(row, (list, tuple)) or len(row) != n:
                got = len(row) if isinstance(row, (list, tuple)) else type(row).__name__
                raise UserError(
                    f"token_type_ids of prompt {b} has {got} ids; the prompt has {n} tokens"
                )
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
                raise UserError(f"token_type_ids of prompt {b} must hold integers, got {row!r}")
            types[b, :n] = torch.tensor(row, dtype=torch.long)
    else:
        raise UserError(
            f"token_type_ids must be a tensor [batch, pos] or one list of ids per prompt, "
            f"got {type(value).__name__}"
        )
    if types.numel() and int(types.min()) < 0:
        raise UserError(f"token_type_ids must be >= 0, got {int(types.min())}")
    return types


def partial_layers(
    start_at_layer: object, stop_at_layer: object, residual: object, *, n_layers: int
) -> tuple[int | None, int | None]:
    """Resolve a partial forward's block indices (negatives count back from the end).

    Returns:
        ``(start, stop)`` as indices in ``0..n_layers``, ``None`` where not given.

    Raises:
        UserError: A bad index, a start after the stop, or ``residual`` without
            ``start_at_layer`` (or the reverse).
    """
    start = (
        None if start_at_layer is None else block_index(start_at_layer, "start_at_layer", n_layers)
    )
    stop = None if stop_at_layer is None else block_index(stop_at_layer, "stop_at_layer", n_layers)
    if start is not None and stop is not None and start > stop:
        raise UserError(
            f"start_at_layer ({start_at_layer}) resolves to block {start}, after "
            f"stop_at_layer ({stop_at_layer}) at block {stop}; start must not exceed stop."
        )
    if start is None and residual is not None:
        raise UserError(
            "residual was given without start_at_layer; pass start_at_layer=k to feed it "
            "into block k, or drop residual"
        )
    if start is not None and residual is None:
        raise UserError(
            "start_at_layer needs residual: the [batch, pos, d_model] input of that block"
        )
    return start, stop


def logits_wanted(return_logits: object) -> LogitsWanted:
    """``return_logits`` (``True``, ``False`` or ``"last"``) as a ``LogitsWanted``.

    Raises:
        UserError: Any other value.
    """
    if return_logits is True:
        return "all"
    if return_logits is False:
        return "none"
    if return_logits == "last":
        return "last"
    raise UserError(
        f"return_logits must be True (every prompt position), 'last' (each prompt's last "
        f"position) or False, got {return_logits!r}"
    )


def run_keywords(
    driver: Any,
    input_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]],
    **keywords: Any,
) -> ForwardResult:
    """``driver.run(build_request(driver, input_ids, **keywords))``: the keyword form of any
    driver's ``run``, for code that holds a driver rather than a bridge (``RequestForward``
    gives a driver the same form as its ``forward`` method).

    Raises:
        UserError: What ``build_request`` refuses, before any engine work.
    """
    result: ForwardResult = driver.run(build_request(driver, input_ids, **keywords))
    return result


class RequestForward:
    """Gives a driver with ``run(request)`` the keyword form of ``Driver.forward``."""

    #: ``forward`` keywords beyond the common ones this driver takes.
    forward_options: ClassVar[frozenset[str]] = frozenset()

    def run(self, request: ForwardRequest) -> ForwardResult:
        """Run one validated request (drivers implement this)."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]],
        *,
        capture: Sequence[str] = (),
        intervene: Any = None,
        max_new_tokens: int = 1,
        return_logits: bool | Literal["last"] = True,
        **options: Any,
    ) -> ForwardResult:
        """Run prompts with captures and specs: ``run(build_request(self, ...))``.

        Args:
            input_ids: ``[batch, pos]`` ids, one ``[pos]`` prompt, or ragged id lists.
            capture: Hook names (canonical or aliases) to return in ``captured``.
            intervene: ``{hook: spec | [spec, ...]}`` for every prompt, or a list with one
                mapping (or ``None``) per prompt; callables on drivers with
                ``intervention_callbacks``.
            max_new_tokens: Tokens to generate after the prompt (0 = prefill only).
            return_logits: ``True`` (every position), ``"last"`` or ``False``.
            **options: ``stop_at_eos``, the sampling options, and the driver's
                ``forward_options``.

        Raises:
            UserError: Bad options, ids, names or specs, before any engine work.
        """
        return run_keywords(
            self,
            input_ids,
            capture=capture,
            intervene=intervene,
            max_new_tokens=max_new_tokens,
            return_logits=return_logits,
            **options,
        )
