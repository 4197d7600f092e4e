"""The one context rule every driver and the bridges apply: ``fits_context``.

A prompt of ``length`` tokens with ``max_new_tokens`` new ones runs the model on
``length + max_new_tokens - 1`` positions: the last new token is sampled and never fed back.
The run fits when those positions fit the model's context ``n_ctx``. An engine that counts
the sampled token against its own limit (vLLM's ``max_model_len``) reports an ``n_ctx`` one
less than that limit, so the same rule holds for it.
"""

from __future__ import annotations

__all__ = ["fits_context", "most_new_tokens", "positions_run"]


def positions_run(length: int, max_new_tokens: int) -> int:
    """How many positions the model runs for a prompt of ``length`` tokens and
    ``max_new_tokens`` new ones (a forward alone is ``max_new_tokens=0``)."""
    return length + max(max_new_tokens - 1, 0)


def fits_context(length: int, max_new_tokens: int, n_ctx: int) -> bool:
    """Whether that run fits a context of ``n_ctx`` positions (``n_ctx <= 0``: no known limit)."""
    return n_ctx <= 0 or positions_run(length, max_new_tokens) <= n_ctx


def most_new_tokens(length: int, n_ctx: int) -> int | None:
    """The largest ``max_new_tokens`` that fits after a prompt of ``length`` tokens: 0 when the
    prompt alone does not fit, ``None`` when ``n_ctx`` sets no limit."""
    if n_ctx <= 0:
        return None
    return n_ctx - length + 1 if length <= n_ctx else 0
