"""Choosing the next token: greedy, temperature, top-k and top-p sampling."""

from __future__ import annotations

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
        if temperature <= 0:
            raise UserError(
                f"temperature must be > 0, got {temperature}; use do_sample=False for greedy"
            )
        if top_k is not None and top_k < 1:
            raise UserError(f"top_k must be >= 1, got {top_k}")
        if top_p is not None and not 0 < top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {top_p}")
        self.do_sample = do_sample
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        #: The private generator seeded with ``seed``; ``None`` (the global RNG) without one.
        self.generator: torch.Generator | None = None
        if seed is not None:
            self.generator = torch.Generator().manual_seed(seed)

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
