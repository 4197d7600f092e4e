"""The tokenizer protocol and the built-in byte-level tokenizer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["ByteTokenizer", "Tokenizer", "padding_id"]


@runtime_checkable
class Tokenizer(Protocol):
    """What tl needs from a tokenizer. Drivers wrap their engine's tokenizer in this."""

    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without any special tokens."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are dropped."""
        ...

    def token_to_str(self, token_id: int) -> str:
        """A readable form of one token (for ``to_str_tokens``)."""
        ...


def padding_id(tokenizer: Tokenizer) -> int:
    """The id to pad with: the pad token, else EOS, else 0 (padding is never attended to)."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return candidate
    return 0


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus BOS/EOS/PAD: works offline for any text.

    Ids ``0..255`` are bytes; ``256`` is BOS, ``257`` EOS and ``258`` PAD. Models need
    ``d_vocab >= 259``.
    """

    vocab_size = 259

    def __init__(self) -> None:
        self.bos_token_id: int | None = 256
        self.eos_token_id: int | None = 257
        self.pad_token_id: int | None = 258

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text; invalid UTF-8 shows as the replacement character."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def token_to_str(self, token_id: int) -> str:
        """Specials as ``<bos>``/``<eos>``/``<pad>``; bytes as text where printable."""
        names = {256: "<bos>", 257: "<eos>", 258: "<pad>"}
        if token_id in names:
            return names[token_id]
        if not 0 <= token_id < 256:
            return f"<{token_id}>"
        char = bytes([token_id]).decode("latin-1")
        return char if char.isprintable() or char in " \n\t" else f"<0x{token_id:02X}>"
