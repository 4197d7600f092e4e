"""``CachePlotsMixin``: the figures a notebook user draws straight from a cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from tl_core._errors import UserError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["CachePlotsMixin", "PromptView"]


class PromptView(Protocol):
    """What the figures read from one prompt's cache (``ActivationCache`` is one)."""

    def __getitem__(self, name: str, /) -> torch.Tensor: ...

    def logit_lens(
        self,
        layer: int | None = ...,
        *,
        incl_mid: bool = ...,
        pos_slice: Any = ...,
        return_labels: Literal[True],
    ) -> tuple[torch.Tensor, list[str]]: ...


class CachePlotsMixin(ABC):
    """Plotting methods of ``ActivationCache`` (matplotlib: ``pip install 'tl-core[plots]'``).

    It reads the cache through ``PromptView`` only, so this module needs nothing of the
    cache's own (no import circle with ``_cache``).
    """

    @abstractmethod
    def _one_prompt(self, prompt: int) -> PromptView:
        """One prompt's cache, trimmed to its length, without a batch dimension."""

    def plot_pattern(
        self,
        layer: int,
        head: int,
        *,
        prompt: int = 0,
        tokens: Sequence[str] | None = None,
        title: str | None = None,
        ax: Axes | None = None,
    ) -> Figure:
        """Draw one head's attention pattern (``blocks.{layer}.attn.hook_pattern``).

        Args:
            layer: Block index.
            head: Head index.
            prompt: Which prompt of the batch (trimmed to its length).
            tokens: One label per position (``model.to_str_tokens(prompt)``).
            title: Figure title (default ``"blocks.{layer}.attn head {head}"``).
            ax: Draw into this axes instead of a new figure.

        Returns:
            The matplotlib figure.

        Raises:
            UserError: The pattern is not cached, ``head`` is out of range, or matplotlib
                is missing.
        """
        from tl_core.plots._figures import plot_pattern

        pattern = self._one_prompt(prompt)[f"blocks.{layer}.attn.hook_pattern"]
        n_heads = pattern.shape[0]
        if isinstance(head, bool) or not isinstance(head, int) or not -n_heads <= head < n_heads:
            raise UserError(f"head must be an int in 0..{n_heads - 1}, got {head!r}")
        return plot_pattern(
            pattern[head],
            tokens,
            title=title if title is not None else f"blocks.{layer}.attn head {head % n_heads}",
            ax=ax,
        )

    def plot_logit_lens(
        self,
        token: int | None = None,
        *,
        prompt: int = 0,
        tokens: Sequence[str] | None = None,
        tokenizer: Any = None,
        title: str | None = None,
        ax: Axes | None = None,
    ) -> Figure:
        """Draw the logit lens of one prompt: residual points down, positions across.

        Each cell is a probability read out through the final norm and the unembedding
        (``logit_lens``): of ``token`` when given, else of the top token there, whose text
        is written in the cell when ``tokenizer`` is given.

        Args:
            token: A token id to follow, or ``None`` for the top token of each cell.
            prompt: Which prompt of the batch (trimmed to its length).
            tokens: One label per position (``model.to_str_tokens(prompt)``).
            tokenizer: Anything with ``token_to_str(id)`` (``model.tokenizer``), to label
                cells with their top token.
            title: Figure title.
            ax: Draw into this axes instead of a new figure.

        Returns:
            The matplotlib figure.

        Raises:
            UserError: The residual stream or the readout is not cached, or matplotlib is
                missing.
        """
        from tl_core.plots._figures import plot_logit_lens

        one = self._one_prompt(prompt)
        logits, labels = one.logit_lens(return_labels=True)  # [layer, pos, vocab]
        probs = torch.softmax(logits.float(), dim=-1)
        if token is not None:
            if (
                isinstance(token, bool)
                or not isinstance(token, int)
                or not 0 <= token < probs.shape[-1]
            ):
                raise UserError(
                    f"token must be a token id in 0..{probs.shape[-1] - 1}, got {token!r}"
                )
            values = probs[..., token]
            label = f"p(token {token})"
            if tokenizer is not None:
                label = f"p({tokenizer.token_to_str(token)!r})"
        else:
            values, top = probs.max(dim=-1)
            label = "p(top token)"
        text = None
        if token is None and tokenizer is not None:
            text = [[tokenizer.token_to_str(int(i))[:8] for i in row] for row in top.tolist()]
        return plot_logit_lens(
            values, labels, tokens, cell_text=text, value_label=label, title=title, ax=ax
        )
