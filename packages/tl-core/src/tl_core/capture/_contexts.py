"""Cut a document stream into model contexts, the same way on every run.

Contexts are numbered from 0 in input order and depend only on the input and the
tokenization options, so every process of a job (a resumed run, one part of a sharded
job) sees the same context under the same number.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from tl_core._errors import UserError
from tl_core.capture._config import CaptureConfig
from tl_core.capture._source import Document
from tl_core.driver_api._tokenizers import Tokenizer, padding_id

__all__ = ["NOT_A_DOCUMENT", "Context", "Tokens", "contexts", "most_contexts"]

#: The document index of a position holding an inserted token (BOS, separator, padding).
NOT_A_DOCUMENT = -1


@dataclass(frozen=True)
class Context:
    """One model input.

    Attributes:
        index: The context's number in the job.
        tokens: Its token ids (at most ``context_size``).
        documents: Per position, the index of the document the token comes from
            (``NOT_A_DOCUMENT`` for inserted tokens).
        stored: Per position, whether it goes into the store (not a dropped BOS or pad).
        progress: Fraction of the input read when this context was cut.
    """

    index: int
    tokens: list[int]
    documents: list[int]
    stored: list[bool]
    progress: float


@dataclass(frozen=True)
class Tokens:
    """The special ids tokenization needs, checked against the options."""

    bos: int | None
    separator: int | None
    pad: int
    #: The id closing each context after its text, with ``prepend_bos`` on a tokenizer that
    #: closes prompts (an encoder's ``[SEP]``, ``HFTokenizer.closing_token_id``), else ``None``.
    closing: int | None = None

    @classmethod
    def of(cls, tokenizer: Tokenizer, config: CaptureConfig) -> Tokens:
        bos = tokenizer.bos_token_id
        if (config.prepend_bos or (config.pack and config.separator == "bos")) and bos is None:
            raise UserError(
                "the tokenizer has no BOS token; pass prepend_bos=False (--no-prepend-bos) "
                "and a separator other than 'bos'"
            )
        separator = {"bos": bos, "eos": tokenizer.eos_token_id, "none": None}[config.separator]
        if config.separator == "eos" and separator is None:
            raise UserError("the tokenizer has no EOS token; choose separator 'bos' or 'none'")
        closing = getattr(tokenizer, "closing_token_id", None) if config.prepend_bos else None
        return cls(
            bos=bos,
            separator=separator,
            pad=padding_id(tokenizer),
            closing=int(closing) if closing is not None else None,
        )


def contexts(
    documents: Iterable[Document], tokenizer: Tokenizer, config: CaptureConfig
) -> Iterator[Context]:
    """The job's contexts, in order; stops after the context reaching ``max_tokens``."""
    special = Tokens.of(tokenizer, config)
    prefix = [special.bos] if config.prepend_bos and special.bos is not None else []
    # An encoder's context is closed as its prompts are: [CLS] text [SEP].
    suffix = [special.closing] if prefix and special.closing is not None else []
    width = config.context_size - len(prefix) - len(suffix)
    cut = _packed if config.pack else _one_per_document
    fed = 0
    for index, (body, docs, progress) in enumerate(cut(documents, tokenizer, special, width)):
        tokens = prefix + body + suffix
        owners = [NOT_A_DOCUMENT] * len(prefix) + docs + [NOT_A_DOCUMENT] * len(suffix)
        stored = [not (config.drop_bos and t == special.bos) for t in tokens]
        if not config.drop_padding and len(tokens) < config.context_size:
            missing = config.context_size - len(tokens)
            tokens, owners = tokens + [special.pad] * missing, owners + [NOT_A_DOCUMENT] * missing
            stored += [True] * missing
        yield Context(index, tokens, owners, stored, progress)
        fed += len(tokens)
        if config.max_tokens is not None and fed >= config.max_tokens:
            return


_Body = tuple[list[int], list[int], float]


def _packed(
    documents: Iterable[Document], tokenizer: Tokenizer, special: Tokens, width: int
) -> Iterator[_Body]:
    tokens: list[int] = []
    owners: list[int] = []
    progress = 0.0
    started = False
    for document in documents:
        ids = tokenizer.encode(document.text) if document.text else []
        progress = document.progress
        if not ids:
            continue
        if started and special.separator is not None:
            tokens.append(special.separator)
            owners.append(NOT_A_DOCUMENT)
        started = True
        tokens.extend(ids)
        owners.extend([document.index] * len(ids))
        while len(tokens) >= width:
            yield tokens[:width], owners[:width], progress
            del tokens[:width], owners[:width]
    if tokens:
        yield tokens, owners, progress


def _one_per_document(
    documents: Iterable[Document], tokenizer: Tokenizer, special: Tokens, width: int
) -> Iterator[_Body]:
    for document in documents:
        ids = tokenizer.encode(document.text) if document.text else []
        for start in range(0, len(ids), width):
            chunk = ids[start : start + width]
            yield chunk, [document.index] * len(chunk), document.progress


def most_contexts(documents: Iterable[Document], config: CaptureConfig) -> int:
    """An upper bound of the contexts the job cuts from ``documents``, without a tokenizer.

    A token covers at least one byte of text (byte-level BPE, SentencePiece with byte
    fallback, WordPiece, the byte tokenizer), and one more is allowed per document for a
    tokenizer that adds a word-start marker, so a document of ``b`` bytes is at most
    ``b + 1`` tokens.
    """
    # Room for a BOS and, on an encoder, its closing token: fewer tokens per context only
    # raises the bound.
    width = max(1, config.context_size - (2 if config.prepend_bos else 0))
    tokens = contexts_cut = documents_seen = 0
    for document in documents:
        if not document.text:
            continue
        most = len(document.text.encode("utf-8")) + 1
        documents_seen += 1
        tokens += most
        contexts_cut += -(-most // width)
    if config.pack:
        separators = documents_seen - 1 if config.separator != "none" and documents_seen else 0
        contexts_cut = -(-(tokens + separators) // width)
    if config.max_tokens is not None:
        contexts_cut = min(contexts_cut, config.max_tokens)
    return contexts_cut
