"""Prompts to token rows and back, and the context-length check every bridge runs first.

Free functions over a tokenizer and the model's ``ModelInfo``: ``Bridge`` calls them, so
the refusals (with the prompt and position at fault) are written once for every driver.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tl_core._errors import UserError
from tl_core.driver_api._batching import TokenBatch, describe_value
from tl_core.driver_api._context import fits_context, most_new_tokens, positions_run
from tl_core.driver_api._tokenizers import Tokenizer
from tl_core.hooks._model_info import ModelInfo

__all__ = ["check_context", "encode", "generated_output", "prompt_rows"]

#: How to boot each driver with a longer context (shown when a prompt exceeds ``n_ctx``).
_CONTEXT_OPTIONS = {
    "hf": "boot it with a larger n_ctx: TransformerBridge.boot_transformers(model, n_ctx=N)",
    "native": "boot a model with a larger n_ctx: TransformerBridge.boot_native(config, n_ctx=N)",
    "vllm": "boot it with a larger max_model_len: RemoteBridge.boot_vllm(model, max_model_len=N)",
}


def encode(tokenizer: Tokenizer, text: str, prepend_bos: bool) -> list[int]:
    """The ids of ``text``, after the BOS token when asked and the tokenizer has one, and
    then before the tokenizer's closing token where it has one (an encoder's ``[SEP]``:
    ``HFTokenizer.closing_token_id``)."""
    ids = tokenizer.encode(text)
    bos = tokenizer.bos_token_id
    if not prepend_bos or bos is None:
        return ids
    closing = getattr(tokenizer, "closing_token_id", None)
    return [bos, *ids] if closing is None else [bos, *ids, int(closing)]


def prompt_rows(tokenizer: Tokenizer, inputs: object, prepend_bos: bool) -> Any:
    """Texts encoded to id lists; ids (lists, tensors) passed on for ``pad_batch``."""
    if isinstance(inputs, str):
        return [_encode_prompt(tokenizer, inputs, 0, prepend_bos)]
    if isinstance(inputs, torch.Tensor):
        return inputs
    if inputs is None or not isinstance(inputs, Sequence) or isinstance(inputs, bytes):
        hint = ""
        if isinstance(inputs, int) and not isinstance(inputs, bool):
            hint = f"; a single token id goes in a list: [{inputs!r}]"
        elif hasattr(inputs, "__array__"):
            hint = "; convert an array of token ids with torch.as_tensor(ids)"
        raise UserError(
            f"the input is {describe_value(inputs)}; expected a text, a list of texts, "
            f"or token ids (a list of ints, a list of such lists, or a [pos] or "
            f"[batch, pos] integer tensor){hint}"
        )
    items = list(inputs)
    if not items:
        raise UserError(
            "the input is an empty list, so there is no prompt to run; pass a text, a "
            "non-empty list of texts, or token ids"
        )
    if not any(isinstance(item, str) for item in items):
        return items  # token ids: pad_batch names the prompt and position at fault
    for index, item in enumerate(items):
        if not isinstance(item, str):
            raise UserError(
                f"prompt {index} is {describe_value(item)}, but the input is a list of "
                f"texts; every prompt in it must be a str (drop or replace that entry)"
            )
    return [_encode_prompt(tokenizer, text, index, prepend_bos) for index, text in enumerate(items)]


def _encode_prompt(tokenizer: Tokenizer, text: str, index: int, prepend_bos: bool) -> list[int]:
    """One prompt's ids, refusing text no tokenizer can encode and empty results."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UserError(
            f"prompt {index} holds {text[exc.start : exc.end]!r} at character {exc.start}, "
            f"a lone surrogate: it is not valid Unicode, so the tokenizer cannot encode "
            f"it; remove it, or clean the text with "
            f"text.encode('utf-8', errors='replace').decode('utf-8')"
        ) from None
    ids = encode(tokenizer, text, prepend_bos)
    if not ids:
        what = "is an empty text" if not text else f"({text!r}) encodes to no tokens"
        why = "prepend_bos=False" if not prepend_bos else "this tokenizer has no BOS token"
        fix = " or pass prepend_bos=True" if not prepend_bos else ""
        raise UserError(
            f"prompt {index} {what} and {why}, so it has nothing to run; give it some text{fix}"
        )
    return ids


def check_context(
    info: ModelInfo, driver_name: str, batch: TokenBatch, max_new_tokens: int = 0
) -> None:
    """Refuse prompts (plus new tokens) longer than the model's context ``info.n_ctx``.

    Every driver refuses the same inputs before any engine work: rotary models would
    otherwise run past their context without a word, and generation would decode up
    to the limit, fail there and lose the text.
    """
    n_ctx = info.n_ctx
    lengths = batch.lengths
    too_long = [n for n in lengths if not fits_context(n, max_new_tokens, n_ctx)]
    if not too_long:
        return
    longest = max(lengths)
    index = lengths.index(longest)
    others = (
        f" ({len(too_long)} of the {len(lengths)} prompts are too long)"
        if len(too_long) > 1
        else ""
    )
    shorten = "Shorten it (to_tokens(..., truncate=True) cuts text to n_ctx tokens), or"
    hint = _longer_context_hint(info, driver_name)
    if not max_new_tokens:
        raise UserError(
            f"prompt {index} is {longest} tokens long, which exceeds n_ctx={n_ctx}, the "
            f"longest input this model takes{others}. {shorten} {hint}"
        )
    most = most_new_tokens(longest, n_ctx)
    if not most:
        raise UserError(
            f"generate: prompt {index} is {longest} tokens long and this model's context "
            f"is n_ctx={n_ctx}, so there is no room for new tokens{others}. Nothing was "
            f"generated. {shorten} {hint}"
        )
    raise UserError(
        f"generate: prompt {index} is {longest} tokens and max_new_tokens="
        f"{max_new_tokens}, which runs the model on {positions_run(longest, max_new_tokens)} "
        f"positions (the last new token is not fed back), more than n_ctx={n_ctx}, this "
        f"model's context{others}; the largest max_new_tokens that fits is {most}. Nothing "
        f"was generated. Pass max_new_tokens={most} or less, shorten the prompt, or {hint}"
    )


def _longer_context_hint(info: ModelInfo, driver_name: str) -> str:
    """How to boot this model with a longer context, where that can work."""
    if driver_name != "native" and info.positional_embedding_type == "standard":
        return (
            f"use another model: this one has {info.n_ctx} learned positions, so it "
            f"cannot take longer inputs"
        )
    how = _CONTEXT_OPTIONS.get(
        driver_name, "boot it with the driver's context-length option (n_ctx=N on hf)"
    )
    return f"if the model supports longer contexts, {how}"


def generated_output(
    tokenizer: Tokenizer, inputs: object, new_tokens: torch.Tensor, return_type: str | None
) -> str | list[str] | torch.Tensor:
    """What ``generate`` returns: text for text input (cut at EOS), else the new ids."""
    texts_in = isinstance(inputs, str) or _is_texts(inputs)
    if (return_type or ("str" if texts_in else "tokens")) == "tokens":
        return new_tokens
    eos = tokenizer.eos_token_id
    rows = [row[: row.index(eos)] if eos in row else row for row in new_tokens.tolist()]
    texts = [tokenizer.decode(row) for row in rows]
    return texts[0] if isinstance(inputs, str) else texts


def _is_texts(inputs: object) -> bool:
    return (
        isinstance(inputs, Sequence)
        and not isinstance(inputs, str)
        and bool(inputs)
        and all(isinstance(t, str) for t in inputs)
    )
