"""inspect's ``GenerateConfig`` -> tl sampling options, and model output -> ``ModelOutput``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tl_core import UserError
from tl_core.driver_api import most_new_tokens

__all__ = ["DEFAULT_MAX_TOKENS", "Completion", "cut_at_stop", "logprobs_of", "sampling_options"]

#: ``max_tokens`` when neither the eval nor the task sets one.
DEFAULT_MAX_TOKENS = 128


def sampling_options(config: Any, *, prompt_len: int, n_ctx: int) -> tuple[int, dict[str, Any]]:
    """``(max_new_tokens, sampling keywords of Driver.forward)`` for a ``GenerateConfig``.

    ``temperature`` 0 or unset means greedy decoding; ``max_tokens`` is capped so prompt
    plus completion fit the model's context.

    Raises:
        UserError: The prompt leaves no room for a token, or an option is out of range.
    """
    wanted = config.max_tokens if config.max_tokens is not None else DEFAULT_MAX_TOKENS
    most = most_new_tokens(prompt_len, n_ctx)  # the one context rule (fits_context)
    room = wanted if most is None else most
    if room < 1:
        raise UserError(
            f"the prompt is {prompt_len} tokens and the model's context is {n_ctx}: no room "
            "to generate; shorten the sample's input"
        )
    max_new = max(1, min(int(wanted), room))
    temperature = config.temperature
    sampling: dict[str, Any] = {"do_sample": bool(temperature), "stop_at_eos": True}
    if temperature:
        sampling["temperature"] = float(temperature)
        if config.top_p is not None:
            sampling["top_p"] = float(config.top_p)
        if config.top_k is not None:
            sampling["top_k"] = int(config.top_k)
        if config.seed is not None:
            sampling["seed"] = int(config.seed)
    return max_new, sampling


@dataclass(frozen=True)
class Completion:
    """One generated continuation: ids, text and why it stopped."""

    ids: list[int]
    text: str
    stop_reason: str


def cut_at_stop(
    new_ids: Sequence[int],
    *,
    eos: int | None,
    max_new: int,
    stop_seqs: Sequence[str] | None,
    decode: Any,
) -> Completion:
    """Cut raw new tokens at EOS and at the first stop sequence.

    The ids kept are the shortest prefix whose text reaches the stop sequence (the text
    itself ends before it), so captures cover the tokens the model emitted for the answer.
    """
    ids = [int(i) for i in new_ids]
    hit_eos = eos is not None and eos in ids
    if eos is not None and hit_eos:
        ids = ids[: ids.index(eos)]
    text = decode(ids)
    for stop in stop_seqs or ():
        at = text.find(stop) if stop else -1
        if at < 0:
            continue
        for n in range(1, len(ids) + 1):
            if stop in decode(ids[:n]):
                ids = ids[:n]
                break
        return Completion(ids, text[:at], "stop")
    reason = "stop" if hit_eos or len(ids) < max_new else "max_tokens"
    return Completion(ids, text, reason)


def logprobs_of(
    logits: torch.Tensor, ids: Sequence[int], top: int | None, token_text: Any
) -> list[dict[str, Any]]:
    """Per generated token: its log probability and the ``top`` most likely alternatives.

    Args:
        logits: ``[n, vocab]`` logits that predicted each of ``ids``.
        ids: The generated ids.
        top: How many alternatives (``None``/0: none).
        token_text: id -> text of that token.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    out: list[dict[str, Any]] = []
    for row, token in zip(logp, ids, strict=True):
        entry: dict[str, Any] = {
            "token": token_text(token),
            "logprob": _finite(row[token]),
        }
        if top:
            values, indices = row.topk(min(int(top), row.shape[-1]))
            entry["top_logprobs"] = [
                {"token": token_text(int(i)), "logprob": _finite(v)}
                for v, i in zip(values, indices, strict=True)
            ]
        out.append(entry)
    return out


def _finite(value: torch.Tensor) -> float:
    number = float(value)
    return number if math.isfinite(number) else -1e30
