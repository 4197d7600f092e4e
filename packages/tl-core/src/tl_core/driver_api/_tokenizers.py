"""The tokenizer protocol, the built-in byte-level tokenizer, and the one wrapper of
HuggingFace tokenizers that every driver uses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "detect_bos_eos", "padding_id"]


@runtime_checkable
class Tokenizer(Protocol):
    """What tl needs from a tokenizer. Drivers wrap their engine's tokenizer in this."""

    #: The id bridges prepend with ``prepend_bos``, or ``None`` when the model has none.
    bos_token_id: int | None
    #: The id that ends generation (with ``stop_at_eos``), or ``None``.
    eos_token_id: int | None
    #: The id ragged batches are padded with, or ``None`` (then EOS, see ``padding_id``).
    pad_token_id: int | None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without any special tokens."""
        ...

    def decode(self, ids: int | Sequence[int]) -> str:
        """Text of ``ids`` (one id, a sequence, or a 0-d or 1-d tensor); special tokens are dropped."""
        ...

    def token_to_str(self, token_id: int) -> str:
        """A readable form of one token (for ``to_str_tokens``)."""
        ...


def id_list(ids: Any) -> list[int]:
    """``ids`` for ``decode`` as a list: one id, a sequence of ids, or a 0-d or 1-d tensor."""
    if hasattr(ids, "tolist"):  # tensors and arrays; a 0-d one gives a plain number
        ids = ids.tolist()
    if isinstance(ids, int):
        return [ids]
    out = list(ids)
    if any(isinstance(i, (list, tuple)) for i in out):
        raise TypeError(
            "decode takes one sequence of token ids; decode each row of a batch on its own"
        )
    return [int(i) for i in out]


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

    #: 256 byte ids and the three special tokens.
    vocab_size = 259

    def __init__(self) -> None:
        #: BOS is id 256.
        self.bos_token_id: int | None = 256
        #: EOS is id 257.
        self.eos_token_id: int | None = 257
        #: PAD is id 258.
        self.pad_token_id: int | None = 258

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: int | Sequence[int]) -> str:
        """Bytes back to text; invalid UTF-8 shows as the replacement character."""
        return bytes(i for i in id_list(ids) if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_to_str(self, token_id: int) -> str:
        """Specials as ``<bos>``/``<eos>``/``<pad>``; bytes as text where printable."""
        names = {256: "<bos>", 257: "<eos>", 258: "<pad>"}
        if token_id in names:
            return names[token_id]
        if not 0 <= token_id < 256:
            return f"<{token_id}>"
        char = bytes([token_id]).decode("latin-1")
        return char if char.isprintable() or char in " \n\t" else f"<0x{token_id:02X}>"


def _as_id(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], int):
        return int(value[0])
    return None


def _template_ends(tokenizer: Any) -> tuple[int | None, int | None]:
    """The ids the tokenizer's own template adds before and after a text (each ``None``
    where it adds none), by comparing an encoding with and without special tokens."""
    try:
        plain = list(tokenizer.encode("a", add_special_tokens=False))
        special = list(tokenizer.encode("a", add_special_tokens=True))
    except Exception:
        return None, None
    if len(special) <= len(plain):
        return None, None
    start = next((n for n in range(len(special)) if special[n : n + len(plain)] == plain), None)
    if start is None:
        return None, None
    first = int(special[0]) if start > 0 else None
    last = int(special[-1]) if start + len(plain) < len(special) else None
    return first, last


def detect_bos_eos(tokenizer: Any) -> tuple[int | None, int | None]:
    """The BOS and EOS token ids of a transformers tokenizer.

    Uses ``bos_token_id``/``eos_token_id`` when set; otherwise compares an encoding with
    and without special tokens: an id added in front is the BOS, one added at the end the
    EOS (some tokenizers only reveal their specials this way).

    Args:
        tokenizer: A transformers tokenizer (anything with ``bos_token_id``,
            ``eos_token_id`` and ``encode(text, add_special_tokens=...)``).

    Returns:
        ``(bos_id, eos_id)``, each ``None`` when the tokenizer has none.
    """
    bos = _as_id(getattr(tokenizer, "bos_token_id", None))
    eos = _as_id(getattr(tokenizer, "eos_token_id", None))
    if bos is not None and eos is not None:
        return bos, eos
    first, last = _template_ends(tokenizer)
    return (bos if bos is not None else first), (eos if eos is not None else last)


class HFTokenizer:
    """A transformers tokenizer seen through tl's ``Tokenizer`` protocol.

    The one wrapper every driver uses for HuggingFace tokenizers, so the same checkpoint
    tokenizes, pads and prints tokens the same way on every driver: ``encode`` adds no
    special tokens (bridges prepend BOS themselves), ``decode`` drops them, specials are
    found by ``detect_bos_eos``, the pad id is the tokenizer's own (bridges fall back to
    EOS, see ``padding_id``), and ``token_to_str`` shows special tokens by name. Anything
    else (chat templates, ``__call__``, the vocabulary) is the wrapped tokenizer's.

    Args:
        tokenizer: A ``transformers.PreTrainedTokenizerBase`` (duck-typed: tl-core does
            not import transformers).
        close_prompts: Whether bridges close a prompt with the token the tokenizer's own
            template puts after a text, wherever they put the BOS first: an encoder reads
            ``[CLS] text [SEP]`` (BERT), ``<s> text </s>`` (RoBERTa). Causal LMs keep
            ``False``: their prompts go on.

    Attributes:
        hf_tokenizer: The wrapped tokenizer.
        closing_token_id: The id closing each prompt after the BOS (``None``: prompts are
            not closed).
    """

    def __init__(self, tokenizer: Any, *, close_prompts: bool = False) -> None:
        self.hf_tokenizer = tokenizer
        self.bos_token_id, self.eos_token_id = detect_bos_eos(tokenizer)
        self.closing_token_id: int | None = _template_ends(tokenizer)[1] if close_prompts else None
        #: The wrapped tokenizer's own pad id (``None`` when it has none).
        self.pad_token_id: int | None = _as_id(getattr(tokenizer, "pad_token_id", None))
        self._specials = frozenset(int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ())

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return list(self.hf_tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: int | Sequence[int]) -> str:
        """Text of ``ids`` (one id, a sequence, or a 0-d or 1-d tensor) with special tokens dropped."""
        return str(self.hf_tokenizer.decode(id_list(ids), skip_special_tokens=True))

    def token_to_str(self, token_id: int) -> str:
        """The text one token stands for; special tokens by name (``<|endoftext|>``)."""
        if int(token_id) in self._specials:
            return str(self.hf_tokenizer.convert_ids_to_tokens(int(token_id)))
        return str(self.hf_tokenizer.decode([int(token_id)]))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped tokenizer's own call (for tools that batch-encode through it)."""
        return self.hf_tokenizer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Everything else (chat templates, vocab, ...) comes from the wrapped tokenizer.
        if name.startswith("_") or name == "hf_tokenizer":
            raise AttributeError(name)
        return getattr(self.hf_tokenizer, name)
