"""Choosing the next token: greedy, temperature, top-k and top-p sampling."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from tl_core._errors import UserError

__all__ = ["SamplingOptions", "next_tokens"]


class SamplingOptions:
    """Validated decoding options.

    Args:
        do_sample: Sample instead of taking the argmax.
        temperature: Softmax temperature (> 0) when sampling.
        top_k: Keep only the ``top_k`` most likely tokens.
        top_p: Keep the smallest set of tokens whose probability reaches ``top_p``.
        seed: Seed of a private generator, so sampling is reproducible.
    """

    def __init__(
        self,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> None:
        if not isinstance(do_sample, bool):
            raise UserError(f"do_sample must be True or False, got {do_sample!r}")
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
            raise UserError(f"temperature must be a number > 0, got {temperature!r}")
        if not math.isfinite(temperature) or temperature <= 0:
            raise UserError(
                f"temperature must be > 0, got {temperature}; use do_sample=False for greedy"
            )
        if top_k is not None and (
            isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1
        ):
            raise UserError(f"top_k must be an int >= 1 (or None), got {top_k!r}")
        if top_p is not None and (
            isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1
        ):
            raise UserError(f"top_p must be a number in (0, 1] (or None), got {top_p!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise UserError(f"seed must be an int (or None), got {seed!r}")
        self.do_sample: bool = do_sample
        self.temperature: float = float(temperature)
        self.top_k: int | None = top_k
        self.top_p: float | None = None if top_p is None else float(top_p)
        self.seed: int | None = seed
        #: The private generator seeded with ``seed``; ``None`` (the global RNG) without one.
        self.generator: torch.Generator | None = None
        if seed is not None:
            self.generator = torch.Generator().manual_seed(seed)

    def keywords(self) -> dict[str, Any]:
        """The options as ``Driver.forward`` keywords (the inverse of ``pop_from``)."""
        return {
            "do_sample": self.do_sample,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "seed": self.seed,
        }

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.keywords().items())
        return f"SamplingOptions({shown})"

    #: The ``Driver.forward`` keywords that choose tokens.
    KEYS = ("do_sample", "temperature", "top_k", "top_p", "seed")

    @classmethod
    def pop_from(cls, kwargs: dict[str, Any]) -> SamplingOptions:
        """Take the sampling keywords out of a ``forward``'s ``**kwargs`` and check them.

        What is left in ``kwargs`` is not a sampling option: a driver refuses it.

        Raises:
            UserError: A sampling option with a bad value.
        """
        return cls(**{k: kwargs.pop(k) for k in cls.KEYS if k in kwargs})


def next_tokens(logits: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """Pick one token per row of ``logits`` (``[batch, vocab]``)."""
    if not options.do_sample:
        return logits.argmax(dim=-1)
    scores = logits.float() / options.temperature
    if options.top_k is not None:
        k = min(options.top_k, scores.shape[-1])
        kth = scores.topk(k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if options.top_p is not None:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token once the mass before it already reaches top_p (the first always stays).
        drop_sorted = (cumulative - sorted_scores.softmax(dim=-1)) >= options.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    probs = scores.softmax(dim=-1).cpu()
    return torch.multinomial(probs, 1, generator=options.generator).squeeze(-1).to(logits.device)
