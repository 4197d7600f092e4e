"""The engine's HuggingFace tokenizer seen through tl's ``Tokenizer`` protocol."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["HFTokenizer"]


class HFTokenizer:
    """Wraps a ``transformers`` tokenizer: encoding adds no special tokens.

    Args:
        tokenizer: A ``transformers.PreTrainedTokenizerBase``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.hf = tokenizer
        self.bos_token_id: int | None = tokenizer.bos_token_id
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self.pad_token_id: int | None = tokenizer.pad_token_id

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens dropped."""
        return str(self.hf.decode([int(i) for i in ids], skip_special_tokens=True))

    def token_to_str(self, token_id: int) -> str:
        """The text one token stands for (special tokens by name)."""
        if token_id in self.hf.all_special_ids:
            return str(self.hf.convert_ids_to_tokens(int(token_id)))
        return str(self.hf.decode([int(token_id)]))
