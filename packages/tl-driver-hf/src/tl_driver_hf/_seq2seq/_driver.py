"""``Seq2SeqDriver``: an encoder-decoder (T5, BART, Marian, ...) on the hf driver.

The model is booted whole (``AutoModelForSeq2SeqLM``). Its two stacks are served under
TransformerLens 4.3's prefixes, ``encoder_blocks.{i}.*`` and ``decoder_blocks.{i}.*``, the
decoder's cross-attention as ``decoder_blocks.{i}.cross_attn.*``. The encoder reads the
prompts; the decoder reads each prompt's decoder input (``decoder_input=``, by default
the model's decoder start token alone), and the logits are the decoder's. Every site is a
torch hook on one module's input or output, installed only for the forward that needs it;
certification (``certify_seq2seq``) decides which are served.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from tl_core import ConfigError, HookPoint, UnsupportedFeatureError
from tl_core.driver_api import (
    FEATURES,
    ForwardRequest,
    ForwardResult,
    ModelInfo,
    TokenBatch,
    Tokenizer,
    next_tokens,
)
from tl_core.hooks import forward_order
from tl_driver_hf._runtime._whole_model import WholeModelDriver
from tl_driver_hf._seq2seq._layout import (
    Site,
    StackLayout,
    final_norm,
    find_stacks,
)

__all__ = ["Seq2SeqDriver"]


def _first(module: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        value = getattr(module, name, None)
        if value is not None:
            return value
    return None


def measure_post_norm(model: nn.Module, encoder: StackLayout) -> bool:
    """Whether the encoder's first norm reads the sum of a block's input and its
    attention's output (post-LN: BART, Marian) rather than the block input (pre-LN: T5,
    mBART), measured on one forward of the encoder."""
    block, norm = encoder.blocks[0], encoder.sites[0]["ln1.hook_in"].module
    seen: dict[str, torch.Tensor] = {}

    def keep(key: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            # A block that takes its stream under another name is refused later, by
            # certification, with what it lacked.
            x = args[0] if args else kwargs.get("hidden_states")
            if isinstance(x, torch.Tensor):
                seen.setdefault(key, x)

        return hook

    handles = [
        block.register_forward_pre_hook(keep("block"), with_kwargs=True),
        norm.register_forward_pre_hook(keep("norm"), with_kwargs=True),
    ]
    try:
        with torch.no_grad():
            model.get_encoder()(input_ids=torch.tensor([[3, 4, 5, 6]], device=_device(model)))  # type: ignore[operator]
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise ConfigError(
            f"tl cannot read the blocks of {type(model).__name__}'s encoder on token ids: "
            f"{type(error).__name__}: {error}"
        ) from error
    finally:
        for handle in handles:
            handle.remove()
    if set(seen) != {"block", "norm"}:
        raise ConfigError(
            f"{type(model).__name__}'s encoder ran without its first block or its norm "
            "receiving the stream: tl cannot tell where its sites are"
        )
    return not torch.equal(seen["block"], seen["norm"])


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def seq2seq_info(model: nn.Module, post_norm: bool, encoder: int, decoder: int) -> ModelInfo:
    """The ``ModelInfo`` of an encoder-decoder, from its config and measured facts."""
    config: Any = model.config
    d_model = int(_first(config, ("d_model", "hidden_size")))
    n_heads = int(_first(config, ("num_heads", "decoder_attention_heads", "num_attention_heads")))
    d_head = int(_first(config, ("d_kv",)) or d_model // n_heads)
    d_mlp = int(_first(config, ("d_ff", "decoder_ffn_dim", "intermediate_size")))
    rms = "T5" in type(model).__name__ or "rms" in str(_first(config, ("layer_norm_type",)) or "")
    learned = hasattr(model.get_decoder(), "embed_positions")  # type: ignore[operator]
    act = _first(config, ("dense_act_fn", "activation_function", "feed_forward_proj"))
    return ModelInfo(
        n_layers=decoder,
        d_model=d_model,
        n_heads=n_heads,
        d_head=d_head,
        d_mlp=d_mlp,
        d_vocab=int(config.vocab_size),
        n_ctx=int(_first(config, ("max_position_embeddings", "n_positions")) or 512),
        normalization_type="RMS" if rms else "LN",
        positional_embedding_type="standard" if learned else "none",
        gated_mlp=bool(getattr(config, "is_gated_act", False)),
        post_residual_norm=post_norm,
        encoder_layers=encoder,
        cross_attention=True,
        act_fn=None if act is None else str(act).removeprefix("gated-"),
        architecture=type(model).__name__,
    )


class Seq2SeqDriver(WholeModelDriver):
    """Runs a transformers encoder-decoder with both stacks' sites (see the module doc)."""

    features: ClassVar[frozenset[str]] = FEATURES - {"token_type_ids", "images", "weight_access"}
    forward_options: ClassVar[frozenset[str]] = frozenset({"capture_device"})
    #: Requests carry a decoder input (``ForwardRequest.decoder_batch``).
    encoder_decoder: ClassVar[bool] = True

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, *, name: str = "") -> None:
        """Wrap a loaded encoder-decoder (``HFDriver.boot`` builds it for such checkpoints).

        Raises:
            ConfigError: Stacks or blocks of a form tl does not know.
        """
        super().__init__(model, name=name)
        if "decoder_input_ids" not in inspect.signature(model.forward).parameters:
            raise ConfigError(
                f"{type(model).__name__} takes no decoder_input_ids: tl serves encoder-decoders "
                "that read token ids in both stacks"
            )
        self._tokenizer = tokenizer
        self._stacks = find_stacks(model)
        self._post_norm = measure_post_norm(model, self._stacks[0])
        encoder, decoder = self._stacks
        self._info = seq2seq_info(model, self._post_norm, len(encoder.blocks), len(decoder.blocks))
        self._sites: dict[str, Site] = {}
        for stack in self._stacks:
            for i, sites in enumerate(stack.sites):
                self._sites.update({f"{stack.prefix}.{i}.{k}": v for k, v in sites.items()})
        norm = final_norm(model)
        if norm is not None:
            self._sites["ln_final.hook_in"] = Site(norm, "in")
            self._sites["ln_final.hook_out"] = Site(norm, "out")
        self._sites["unembed.hook_out"] = Site(model.get_output_embeddings(), "out")  # type: ignore[operator]
        self._points = {name: HookPoint(name) for name in forward_order(self._sites)}

    @property
    def decoder_start_ids(self) -> tuple[int, ...]:
        """The ids a decoder input starts from (the model's decoder start token)."""
        config: Any = self._hf_model.config
        generation = getattr(self._hf_model, "generation_config", None)
        # transformers' own order (GenerationMixin): the start token, else BOS.
        start = None
        for key in ("decoder_start_token_id", "bos_token_id"):
            for source in (generation, config):
                if start is None and source is not None:
                    start = _first(source, (key,))
        if start is None:
            raise ConfigError(
                f"{self._model_name!r} names no decoder start token (decoder_start_token_id "
                "or bos_token_id in its config or generation config): pass decoder_input="
            )
        return (int(start),)

    @property
    def read_only_reasons(self) -> Mapping[str, str]:
        """The residual between a pre-LN BART block's sublayers: visible, not editable."""
        out: dict[str, str] = {
            name: "the attention module hands its probabilities out after using them: tl "
            "reads them there, and an edit would not reach hook_z"
            for name in self._points
            if name.endswith(".hook_pattern")
        }
        for stack in self._stacks if not self._post_norm else ():
            for i in range(len(stack.blocks)):
                for suffix in stack.at_norm_input:
                    name = f"{stack.prefix}.{i}.{suffix}"
                    if name in self._points:
                        out[name] = (
                            "this pre-LN block keeps the residual stream between its sublayers "
                            "in a local variable: tl reads it where the norm takes it, and an "
                            "edit there would reach the norm only"
                        )
        return out

    @property
    def stacks(self) -> tuple[StackLayout, StackLayout]:
        """The encoder's and the decoder's blocks and sites."""
        return self._stacks

    # -- running -----------------------------------------------------------------------

    def run_model(
        self,
        input_ids: torch.Tensor | None,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        start_at_layer: int | None = None,
        stop_at_layer: int | None = None,
        residual: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One forward of both stacks with whatever hooks are attached; the decoder's logits.

        Raises:
            UnsupportedFeatureError: A partial forward (not served on encoder-decoders).
        """
        if start_at_layer is not None or stop_at_layer is not None or residual is not None:
            raise UnsupportedFeatureError(
                "partial forwards (start_at_layer/stop_at_layer) are not served on "
                "encoder-decoders yet"
            )
        if decoder_input_ids is None:
            start = torch.tensor([self.decoder_start_ids], device=self.device)
            n = 1 if input_ids is None else input_ids.shape[0]
            decoder_input_ids = start.expand(n, -1)
        with self._wired():
            out = self._hf_model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                decoder_input_ids=decoder_input_ids,
                decoder_attention_mask=decoder_attention_mask,
                use_cache=False,
            )
        return out.logits  # type: ignore[no-any-return]

    def run(self, request: ForwardRequest) -> ForwardResult:
        """Run one validated request: the encoder reads ``request.batch``, the decoder
        ``request.decoder_batch``; logits and generation follow the decoder."""
        partial = (request.start_at_layer, request.stop_at_layer, request.residual)
        if any(x is not None for x in partial):
            raise UnsupportedFeatureError(
                "partial forwards (start_at_layer/stop_at_layer/residual) are not served on "
                "encoder-decoders yet: run the whole model and capture the block you need "
                "(e.g. decoder_blocks.1.hook_in)"
            )
        batch = request.batch.to(self.device)
        if request.decoder_batch is None:
            raise UnsupportedFeatureError(
                "an encoder-decoder's request needs its decoder inputs (decoder_batch)"
            )
        decoder = request.decoder_batch.to(self.device)
        if request.decodes:
            return self._generate_seq2seq(batch, decoder, request)
        store: dict[str, torch.Tensor] = {}
        with self.attached(
            request.plan, batch, capture=request.capture, store=store, decoder_batch=decoder
        ):
            logits = self.run_model(
                batch.ids,
                attention_mask=batch.attention_mask(),
                decoder_input_ids=decoder.ids,
                decoder_attention_mask=decoder.attention_mask(),
            )
        last = logits[torch.arange(logits.shape[0]), torch.tensor(decoder.lengths) - 1]
        out: torch.Tensor | None = logits
        if request.logits == "none":
            out = None
        elif request.logits == "last":
            out = last[:, None]
        new = last.argmax(-1)[:, None] if request.max_new_tokens == 1 else None
        if request.capture_device is not None:
            store = {k: v.to(request.capture_device) for k, v in store.items()}
        return ForwardResult(
            logits=out, captured=store, new_tokens=new, raw_output=None, lengths=decoder.lengths
        )

    def _generate_seq2seq(
        self, batch: TokenBatch, decoder: TokenBatch, request: ForwardRequest
    ) -> ForwardResult:
        """Decode step by step from each prompt's decoder input, the plan active at every
        step; the encoder reruns with the decoder (full recomputation, as the local
        drivers' generation does)."""
        if len(set(decoder.lengths)) > 1:
            raise UnsupportedFeatureError(
                f"decoder inputs of different lengths {decoder.lengths} cannot be decoded "
                "together: generate from each prompt's decoder input on its own, or give "
                "inputs of one length"
            )
        ids = decoder.ids
        eos = self._tokenizer.eos_token_id if request.stop_at_eos else None
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        generated: list[torch.Tensor] = []
        store: dict[str, torch.Tensor] = {}
        for step in range(request.max_new_tokens):
            step_decoder = TokenBatch(ids, (ids.shape[1],) * ids.shape[0], (0,) * ids.shape[0])
            capture = request.capture if step == 0 else ()
            with self.attached(
                request.plan, batch, capture=capture, store=store, decoder_batch=step_decoder
            ):
                logits = self.run_model(
                    batch.ids, attention_mask=batch.attention_mask(), decoder_input_ids=ids
                )
            token = next_tokens(logits[:, -1], request.sampling)
            if eos is not None:
                token = torch.where(done, torch.full_like(token, eos), token)
                done |= token == eos
            generated.append(token)
            ids = torch.cat([ids, token[:, None]], dim=1)
            if eos is not None and bool(done.all()):
                break
        return ForwardResult(
            logits=None,
            captured=store,
            new_tokens=torch.stack(generated, dim=1),
            raw_output=None,
            lengths=decoder.lengths,
        )
