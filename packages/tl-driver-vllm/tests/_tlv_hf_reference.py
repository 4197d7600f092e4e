"""The hf driver as the per-prompt generation reference, for families ``_tlv_reference``
does not map (GPT-J, OPT, BLOOM, Falcon, GPT-NeoX, OLMo 2).

Same interface as ``_tlv_reference.Reference`` (``run`` and ``generate``): one prompt at a
time through the hf driver, whose own suite checks it hook by hook against plain
transformers. Captures and specs are compared with the hf driver in batches anyway; this
only gives greedy generation a per-prompt reference on those families.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from _tlv_support import prompt_part


class DriverReference:
    """One prompt at a time on an hf driver.

    Args:
        driver: The hf driver of the checkpoint (float32).
    """

    def __init__(self, driver: Any) -> None:
        self.driver = driver

    @torch.no_grad()
    def run(
        self, ids: Sequence[int], capture: Sequence[str], intervene: Mapping[str, Any] | None = None
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Captures ``[len, ...]`` of one prompt and its logits ``[len, vocab]``."""
        n = len(ids)
        result = self.driver.forward(
            [list(ids)], capture=list(capture), intervene=intervene, max_new_tokens=0
        )
        return {name: prompt_part(result.captured[name], 0, n) for name in capture}, result.logits[
            0, :n
        ]

    @torch.no_grad()
    def generate(
        self, ids: Sequence[int], n: int, intervene: Mapping[str, Any] | None = None
    ) -> list[int]:
        """Greedy tokens with the specs active at every step."""
        result = self.driver.forward(
            [list(ids)], intervene=intervene, max_new_tokens=n, stop_at_eos=False
        )
        assert result.new_tokens is not None
        return [int(t) for t in result.new_tokens[0]]
