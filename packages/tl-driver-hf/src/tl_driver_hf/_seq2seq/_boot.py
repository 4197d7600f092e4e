"""Booting an encoder-decoder checkpoint: the whole model, its tokenizer, certification."""

from __future__ import annotations

from typing import Any

from torch import nn

from tl_core import ConfigError
from tl_core.driver_api import HFTokenizer, Tokenizer
from tl_driver_hf._options import BootOptions
from tl_driver_hf._runtime._whole_model import refuse_unserved_options
from tl_driver_hf._seq2seq._certify import certify_seq2seq
from tl_driver_hf._seq2seq._driver import Seq2SeqDriver
from tl_driver_hf._weights._loading import load_model, load_tokenizer

__all__ = ["boot_seq2seq", "is_encoder_decoder"]


def is_encoder_decoder(model: Any) -> bool:
    """Whether ``model`` is a transformers encoder-decoder (two stacks, cross-attention)."""
    config = getattr(model, "config", None)
    return bool(getattr(config, "is_encoder_decoder", False)) and callable(
        getattr(model, "get_encoder", None)
    )


def boot_seq2seq(
    opts: BootOptions, config: Any = None, model: nn.Module | None = None, name: str = ""
) -> Seq2SeqDriver:
    """The driver of an encoder-decoder checkpoint (or of a loaded ``model``), certified.

    Raises:
        UserError: Options not served on encoder-decoders.
        ConfigError: Weights that do not fit, a block form tl does not know, or a run that
            does not reproduce the model.
    """
    refuse_unserved_options(opts, "encoder-decoders")
    tokenizer: Tokenizer
    if model is None:
        model = load_model(opts, config, None)
        tokenizer = load_tokenizer(
            opts.tokenizer if opts.tokenizer is not None else opts.model_name,
            config,
            revision=opts.revision if opts.tokenizer is None else None,
            trust_remote_code=opts.trust_remote_code,
            required=opts.tokenizer is not None,
        )
        name = str(opts.model_name)
    else:
        source = opts.tokenizer if opts.tokenizer is not None else (
            getattr(model, "name_or_path", None) or None
        )  # fmt: skip
        tokenizer = load_tokenizer(
            source, model.config, local_only=True, required=isinstance(opts.tokenizer, str)
        )
    if isinstance(tokenizer, HFTokenizer):
        # The encoder reads a prompt as the tokenizer's template closes it (T5's </s>).
        tokenizer = HFTokenizer(tokenizer.hf_tokenizer, close_prompts=True)
    driver = Seq2SeqDriver(model, tokenizer, name=name)
    try:
        certification = certify_seq2seq(driver, name=name or type(model).__name__)
    except KeyError as error:
        # A block that takes its stream under another name than hidden_states (FSMT,
        # Pegasus-X): tl cannot read it, so the model is refused, not served unchecked.
        raise ConfigError(
            f"tl cannot certify {name or type(model).__name__!r}: running it with tl's hooks "
            f"failed ({type(error).__name__}: {error}); its blocks are of a form tl does not "
            "serve yet"
        ) from error
    driver.set_certification(certification)
    return driver
