"""The stand-in tokenizer for a model loaded without one.

Real tokenizers are wrapped in tl-core's ``HFTokenizer`` (one wrapper for every driver);
``detect_tokenizer_bos_eos`` is tl-core's ``detect_bos_eos`` under its TransformerLens name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tl_core import UserError
from tl_core.driver_api import detect_bos_eos

__all__ = ["MissingTokenizer", "detect_tokenizer_bos_eos"]

#: tl-core's ``tl_core.driver_api.detect_bos_eos`` under its TransformerLens name.
detect_tokenizer_bos_eos = detect_bos_eos


class MissingTokenizer:
    """Stands in when no tokenizer could be loaded: ids work, text raises a clear error."""

    def __init__(self, config: Any, reason: str) -> None:
        self.bos_token_id = _token_id(getattr(config, "bos_token_id", None))
        self.eos_token_id = _token_id(getattr(config, "eos_token_id", None))
        self.pad_token_id: int | None = _token_id(getattr(config, "pad_token_id", None))
        self._reason = reason

    def _fail(self) -> UserError:
        return UserError(
            f"this bridge has no tokenizer ({self._reason}); pass token ids, or boot with "
            f"tokenizer=AutoTokenizer.from_pretrained(...)"
        )

    def encode(self, text: str) -> list[int]:
        """Raises: no tokenizer."""
        raise self._fail()

    def decode(self, ids: int | Sequence[int]) -> str:
        """Raises: no tokenizer."""
        raise self._fail()

    def token_to_str(self, token_id: int) -> str:
        """``<id>`` (there is no vocabulary to look it up in)."""
        return f"<{int(token_id)}>"


def _token_id(value: Any) -> int | None:
    # Configs list several EOS ids for some families; the first is the one to pad with.
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None
