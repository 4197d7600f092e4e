"""Wrap a transformers tokenizer in tl's ``Tokenizer`` protocol."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tl_core import UserError

__all__ = ["HFTokenizer", "MissingTokenizer", "detect_tokenizer_bos_eos"]


def _as_id(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], int):
        return int(value[0])
    return None


def detect_tokenizer_bos_eos(tokenizer: Any) -> tuple[int | None, int | None]:
    """The BOS and EOS token ids of a transformers tokenizer.

    Uses ``bos_token_id``/``eos_token_id`` when set; otherwise compares an encoding with
    and without special tokens: an id added in front is the BOS, one added at the end the
    EOS (some tokenizers only reveal their specials this way).

    Args:
        tokenizer: A transformers tokenizer (anything with ``bos_token_id``, ``eos_token_id``
            and ``__call__``/``encode``).

    Returns:
        ``(bos_id, eos_id)``, each ``None`` when the tokenizer has none.
    """
    bos = _as_id(getattr(tokenizer, "bos_token_id", None))
    eos = _as_id(getattr(tokenizer, "eos_token_id", None))
    if bos is not None and eos is not None:
        return bos, eos
    try:
        plain = list(tokenizer.encode("a", add_special_tokens=False))
        special = list(tokenizer.encode("a", add_special_tokens=True))
    except Exception:
        return bos, eos
    if len(special) > len(plain):
        start = next((n for n in range(len(special)) if special[n : n + len(plain)] == plain), None)
        if start is not None:
            if bos is None and start > 0:
                bos = int(special[0])
            if eos is None and start + len(plain) < len(special):
                eos = int(special[-1])
    return bos, eos


class HFTokenizer:
    """A transformers tokenizer seen through tl's ``Tokenizer`` protocol.

    ``encode`` adds no special tokens (the bridge prepends BOS itself); ``decode`` drops
    them. Without a pad token, EOS pads.

    Attributes:
        hf_tokenizer: The wrapped tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.hf_tokenizer = tokenizer
        self.bos_token_id, self.eos_token_id = detect_tokenizer_bos_eos(tokenizer)
        pad = _as_id(getattr(tokenizer, "pad_token_id", None))
        self.pad_token_id: int | None = pad if pad is not None else self.eos_token_id

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return list(self.hf_tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens dropped."""
        return str(self.hf_tokenizer.decode([int(i) for i in ids], skip_special_tokens=True))

    def token_to_str(self, token_id: int) -> str:
        """The text of one token as the tokenizer decodes it alone."""
        return str(self.hf_tokenizer.decode([int(token_id)]))

    def __getattr__(self, name: str) -> Any:
        # Everything else (chat templates, vocab, ...) comes from the wrapped tokenizer.
        if name.startswith("_") or name == "hf_tokenizer":
            raise AttributeError(name)
        return getattr(self.hf_tokenizer, name)


class MissingTokenizer:
    """Stands in when no tokenizer could be loaded: ids work, text raises a clear error."""

    def __init__(self, config: Any, reason: str) -> None:
        self.bos_token_id = _as_id(getattr(config, "bos_token_id", None))
        self.eos_token_id = _as_id(getattr(config, "eos_token_id", None))
        pad = _as_id(getattr(config, "pad_token_id", None))
        self.pad_token_id: int | None = pad if pad is not None else self.eos_token_id
        self._reason = reason

    def _fail(self) -> UserError:
        return UserError(
            f"this bridge has no tokenizer ({self._reason}); pass token ids, or boot with "
            f"tokenizer=AutoTokenizer.from_pretrained(...)"
        )

    def encode(self, text: str) -> list[int]:
        """Raises: no tokenizer."""
        raise self._fail()

    def decode(self, ids: Sequence[int]) -> str:
        """Raises: no tokenizer."""
        raise self._fail()

    def token_to_str(self, token_id: int) -> str:
        """``<id>`` (there is no vocabulary to look it up in)."""
        return f"<{int(token_id)}>"
