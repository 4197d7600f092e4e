"""Next-token cross-entropy over the real (unpadded) positions of a right-padded batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tl_core._errors import UserError

__all__ = ["next_token_loss"]


def next_token_loss(
    logits: torch.Tensor, tokens: torch.Tensor, lengths: Sequence[int], *, per_token: bool = False
) -> torch.Tensor:
    """Cross-entropy of predicting each next token, over real (unpadded) positions only.

    Args:
        logits: ``[batch, pos, vocab]``.
        tokens: ``[batch, pos]`` right-padded ids.
        lengths: Real length of each row.
        per_token: Return ``[batch, pos - 1]`` losses (zero at padding) instead of the mean.

    Raises:
        UserError: Prompts shorter than two tokens (nothing to predict).
    """
    if logits.shape[1] < 2:
        raise UserError("loss needs prompts of at least two tokens (one to predict)")
    log_probs = F.log_softmax(logits[:, :-1].float(), dim=-1)
    target = tokens[:, 1:].to(logits.device)
    nll = -log_probs.gather(-1, target[..., None]).squeeze(-1)
    cols = torch.arange(nll.shape[1], device=nll.device)
    valid = cols[None, :] < (torch.tensor(lengths, device=nll.device)[:, None] - 1)
    nll = nll * valid
    if per_token:
        return nll
    return nll.sum() / valid.sum().clamp(min=1)
