"""inspect chat messages -> prompt token ids, with the tokenizer's own chat template."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

__all__ = ["prompt_ids"]

_log = logging.getLogger(__name__)
_warned: set[int] = set()


def _messages(messages: Sequence[Any]) -> list[dict[str, str]]:
    return [{"role": str(m.role), "content": m.text} for m in messages]


def prompt_ids(tokenizer: Any, messages: Sequence[Any]) -> list[int]:
    """Token ids of ``messages`` as the model's tokenizer formats a chat.

    With a chat template the template decides everything (BOS included) and the
    generation prompt is added; without one, messages are joined as ``role: text`` lines
    after BOS, and a log line says so (once per tokenizer).

    Args:
        tokenizer: A tl ``Tokenizer`` (``HFTokenizer`` exposes the wrapped tokenizer).
        messages: inspect ``ChatMessage`` objects.
    """
    chat = _messages(messages)
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is not None and getattr(hf, "chat_template", None):
        text = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        return [int(i) for i in hf.encode(text, add_special_tokens=False)]
    if id(tokenizer) not in _warned:
        _warned.add(id(tokenizer))
        _log.warning(
            "tl_driver_inspect: the tokenizer has no chat template; prompts are the messages "
            "joined as 'role: text' lines after BOS"
        )
    text = "".join(f"{m['role']}: {m['content']}\n" for m in chat) + "assistant:"
    ids = list(tokenizer.encode(text))
    bos = tokenizer.bos_token_id
    return [bos, *ids] if bos is not None else ids
