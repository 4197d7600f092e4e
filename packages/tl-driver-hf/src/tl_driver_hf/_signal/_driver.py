"""``SignalDriver``: a model that reads pixels or audio (ViT, DeiT, wav2vec2, HuBERT) on
the hf driver, served at the residual stream of its one stack of blocks.

The model is booted whole (``AutoModelForImageClassification``, ``AutoModelForCTC``). Its
input is a float tensor instead of token ids; each request's batch holds one placeholder
id per position of the stream its blocks read (patches, audio frames), so positions in
specs and captures mean what they mean for text. ``blocks.{i}.hook_in`` is what transformers
hands block ``i``, ``blocks.{i}.hook_out`` what it returns; the logits are the model's own
(one row of labels per image, or one per audio frame).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any, ClassVar

import torch
from torch import nn

from tl_core import ConfigError, HookPoint, UnsupportedFeatureError, UserError
from tl_core.driver_api import (
    FEATURES,
    ForwardRequest,
    ForwardResult,
    ModelInfo,
    TokenBatch,
)
from tl_core.hooks import forward_order
from tl_driver_hf._runtime._whole_model import Site, WholeModelDriver
from tl_driver_hf._signal._layout import (
    SignalLayout,
    SignalReads,
    config_value,
    feature_size,
    find_blocks,
    run_plain,
)

__all__ = ["SignalDriver", "LabelTokenizer"]


class LabelTokenizer:
    """The tokenizer of a model that reads no text: it encodes nothing and decodes output
    ids to the config's label names (``id2label``)."""

    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __init__(self, model_name: str, reads: str, labels: Mapping[int, str]) -> None:
        self._model_name = model_name
        self._reads = reads
        self._labels = dict(labels)

    def encode(self, text: str) -> list[int]:
        """Refused: the model reads no text.

        Raises:
            UserError: Always, naming what the model reads.
        """
        raise UserError(
            f"{self._model_name!r} reads {self._reads}, not text: pass them as a float tensor"
        )

    def decode(self, ids: int | Sequence[int]) -> str:
        """Label names of output ids (one, a sequence, or a tensor), space-separated."""
        values = torch.as_tensor(ids).flatten().tolist()
        return " ".join(self.token_to_str(int(i)) for i in values)

    def token_to_str(self, token_id: int) -> str:
        """The label name of one output id (``LABEL_3`` where the config names none)."""
        return str(self._labels.get(int(token_id), f"LABEL_{int(token_id)}"))


def _partial_forward() -> UnsupportedFeatureError:
    return UnsupportedFeatureError(
        "partial forwards (start_at_layer/stop_at_layer) are not served on models that read "
        "pixels or audio yet: run the whole model and capture the block you need (e.g. "
        "blocks.1.hook_in)"
    )


class _Measured(Exception):
    """Stops a forward at the first block, once the stream's length is known."""

    def __init__(self, positions: int) -> None:
        self.positions = positions


def signal_info(model: nn.Module, layout: SignalLayout, positions: int | None) -> ModelInfo:
    """The ``ModelInfo`` of a pixel or audio model: its sizes (``d_vocab`` is the logits'
    width: labels, or CTC tokens), and no fact tl did not establish (its norms and
    positions are ``"unknown"``: only the stream is served)."""
    config: Any = model.config
    n_heads = int(config_value(config, "num_attention_heads", "num_heads") or 1)
    d_mlp = config_value(config, "intermediate_size", "mlp_dim")
    return ModelInfo(
        n_layers=len(layout.blocks),
        d_model=layout.width,
        n_heads=n_heads,
        d_head=layout.width // n_heads,
        d_mlp=int(d_mlp) if isinstance(d_mlp, int) else 4 * layout.width,
        d_vocab=layout.outputs,
        # Audio streams have no fixed length: any sample count has its frames.
        n_ctx=positions if positions is not None else 1 << 20,
        normalization_type="unknown",
        positional_embedding_type="unknown",
        architecture=type(model).__name__,
    )


class SignalDriver(WholeModelDriver):
    """Runs a transformers pixel or audio model with its block stack's residual sites."""

    features: ClassVar[frozenset[str]] = FEATURES - {
        "token_type_ids",
        "images",
        "weight_access",
        "generation",
    }
    forward_options: ClassVar[frozenset[str]] = frozenset({"capture_device"})

    def __init__(self, model: nn.Module, reads: SignalReads, *, name: str = "") -> None:
        """Wrap a loaded image classifier or CTC model (``HFDriver.boot`` builds it).

        Raises:
            ConfigError: No one stack of blocks (see ``find_blocks``).
        """
        super().__init__(model, name=name)
        self._reads: SignalReads = reads
        self._layout = find_blocks(model, reads)
        self._positions: dict[tuple[int, ...], int] = {}
        fixed = None
        if reads == "pixels":
            size = config_value(model.config, "image_size") or 224
            fixed = self._stream_length(self._expected_pixels(1, size))
        self._info = signal_info(model, self._layout, fixed)
        labels = getattr(model.config, "id2label", None) or {}
        self._tokenizer = LabelTokenizer(self._model_name, reads, labels)
        self._sites = {
            name: site
            for i, block in enumerate(self._layout.blocks)
            for name, site in (
                (f"blocks.{i}.hook_in", Site(block, "in")),
                (f"blocks.{i}.hook_out", Site(block, "out")),
            )
        }
        self._points = {name: HookPoint(name) for name in forward_order(self._sites)}

    @property
    def layout(self) -> SignalLayout:
        """The block stack found at boot."""
        return self._layout

    # -- the signal --------------------------------------------------------------------

    @property
    def signal_input(self) -> SignalReads:
        """What the model reads instead of tokens (the bridge passes it as ``signal``)."""
        return self._reads

    @cached_property
    def signal_shape(self) -> str:
        """The input's shape, for messages: ``[batch, 3, 224, 224]``, ``[batch, samples]``
        or ``[batch, frames, 80]``."""
        if self._reads == "audio samples":
            return "[batch, samples]"
        if self._reads == "audio features":
            return f"[batch, frames, {feature_size(self._hf_model.config)}]"
        size = config_value(self._hf_model.config, "image_size") or 224
        return f"[batch, {', '.join(str(d) for d in self._expected_pixels(1, size)[1:])}]"

    def _expected_pixels(self, batch: int, size: Any) -> tuple[int, ...]:
        height, width = (size, size) if isinstance(size, int) else (int(size[0]), int(size[-1]))
        channels = int(config_value(self._hf_model.config, "num_channels") or 3)
        return (batch, channels, height, width)

    def signal_batch(self, signal: Any) -> tuple[torch.Tensor, TokenBatch]:
        """Check an input and give the batch of its stream's positions.

        Args:
            signal: Pixels ``[batch, channels, height, width]`` (one image may drop the
                batch axis) or audio samples ``[batch, samples]`` (one waveform may too).

        Returns:
            The input as a ``[batch, ...]`` float tensor, and a batch of placeholder ids
            (0), one per position of the stream the blocks read.

        Raises:
            UserError: Not a float tensor, or not of the shape the model reads.
        """
        want = self.signal_shape
        if not isinstance(signal, torch.Tensor) or not signal.is_floating_point():
            got = type(signal).__name__
            if isinstance(signal, torch.Tensor):
                got = f"a {signal.dtype} tensor"
            raise UserError(
                f"{self._model_name!r} reads {self._reads}, not tokens: pass a float tensor "
                f"{want}; got {got}"
            )
        batched = {"pixels": 4, "audio samples": 2, "audio features": 3}[self._reads]
        given = tuple(signal.shape)
        if signal.ndim == batched - 1:
            signal = signal[None]
        if signal.ndim == batched and signal.shape[0] == 0:
            raise UserError(f"{self._model_name!r} got an empty batch (shape {given})")
        if self._reads == "pixels":
            size = config_value(self._hf_model.config, "image_size") or 224
            expected = self._expected_pixels(signal.shape[0], size)
            if tuple(signal.shape) != expected:
                raise UserError(
                    f"{self._model_name!r} reads pixels {want}; got shape {given} (resize "
                    "the images to the config's size)"
                )
        elif (
            signal.ndim != batched
            or signal.shape[1] == 0
            or (batched == 3 and signal.shape[2] != feature_size(self._hf_model.config))
        ):
            raise UserError(f"{self._model_name!r} reads {self._reads} {want}; got shape {given}")
        positions = self._stream_length(tuple(signal.shape))
        batch = TokenBatch(
            torch.zeros(signal.shape[0], positions, dtype=torch.long),
            (positions,) * signal.shape[0],
            (0,) * signal.shape[0],
        )
        return signal, batch

    def _stream_length(self, shape: tuple[int, ...]) -> int:
        """How many positions the blocks read for an input of ``shape`` (measured once per
        shape, on a forward stopped at the first block)."""
        key = shape[1:]
        if key not in self._positions:

            def stop(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                x = args[0] if args else kwargs["hidden_states"]
                raise _Measured(int(x.shape[1]))

            handle = self._layout.blocks[0].register_forward_pre_hook(stop, with_kwargs=True)
            try:
                with torch.no_grad():
                    run_plain(self._hf_model, self._reads, torch.zeros((1, *key)))
            except _Measured as measured:
                self._positions[key] = measured.positions
            except Exception as error:  # the model's own embedding: any failure is the input's
                raise UserError(
                    f"{self._model_name!r} cannot read {self._reads} of shape {shape}: "
                    f"{type(error).__name__}: {error}"
                ) from error
            finally:
                handle.remove()
            if key not in self._positions:
                raise ConfigError(f"{self._model_name!r} ran without its first block")
        return self._positions[key]

    # -- running -------------------------------------------------------------------------

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
        """One forward on the signal (given as ``input_ids``: pixels or audio samples)
        with whatever hooks are attached; the model's logits.

        Raises:
            UnsupportedFeatureError: A partial forward, or no signal.
        """
        if start_at_layer is not None or stop_at_layer is not None or residual is not None:
            raise _partial_forward()
        if input_ids is None or not input_ids.is_floating_point():
            raise UnsupportedFeatureError(f"{self._model_name!r} runs on {self._reads} only")
        with self._wired():
            out = run_plain(self._hf_model, self._reads, input_ids)
        return out.logits  # type: ignore[no-any-return]

    def run(self, request: ForwardRequest) -> ForwardResult:
        """Run one validated request on ``request.signal``.

        Raises:
            UnsupportedFeatureError: No signal (token ids), generation, or a partial forward.
        """
        if request.signal is None:
            raise UnsupportedFeatureError(
                f"{self._model_name!r} reads {self._reads}, not token ids: pass them "
                f"{self.signal_shape} as the input"
            )
        if request.max_new_tokens:
            raise UnsupportedFeatureError(
                f"{self._model_name!r} reads {self._reads} and generates no tokens"
            )
        partial = (request.start_at_layer, request.stop_at_layer, request.residual)
        if any(x is not None for x in partial):
            raise _partial_forward()
        batch = request.batch.to(self.device)
        store: dict[str, torch.Tensor] = {}
        with self.attached(request.plan, batch, capture=request.capture, store=store):
            logits = self.run_model(request.signal.to(self.device))
        out: torch.Tensor | None = logits
        if request.logits == "none":
            out = None
        elif request.logits == "last":
            out = logits[:, -1:] if logits.ndim == 3 else logits[:, None]
        if request.capture_device is not None:
            store = {k: v.to(request.capture_device) for k, v in store.items()}
        return ForwardResult(
            logits=out, captured=store, new_tokens=None, raw_output=None, lengths=batch.lengths
        )
