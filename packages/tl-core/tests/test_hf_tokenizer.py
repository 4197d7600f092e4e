"""``HFTokenizer``'s special tokens, on duck-typed tokenizers (tl-core has no transformers).

The reference is the wrapped tokenizer's own template: what ``encode(text,
add_special_tokens=True)`` puts before and after the text.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings, strategies as st

from tl_core.bridges._prompts import encode
from tl_core.driver_api import HFTokenizer


class _Template:
    """A character-level tokenizer whose template wraps a text in ``first`` and ``last``."""

    def __init__(self, first: int | None, last: int | None) -> None:
        self.first, self.last = first, last
        self.bos_token_id = self.eos_token_id = self.pad_token_id = None
        self.all_special_ids = [i for i in (first, last) if i is not None]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [10 + ord(c) % 50 for c in text]
        if not add_special_tokens:
            return ids
        return (
            [i for i in (self.first,) if i is not None]
            + ids
            + ([self.last] if self.last is not None else [])
        )

    def __call__(self, text: str) -> dict[str, Any]:
        return {"input_ids": self.encode(text)}


@settings(max_examples=40, deadline=None)
@given(
    text=st.text(alphabet="abcxyz ", min_size=1, max_size=12),
    first=st.sampled_from([None, 1]),
    last=st.sampled_from([None, 2]),
    close=st.booleans(),
    prepend_bos=st.booleans(),
)
def test_a_closed_prompt_is_the_tokenizers_own_template(
    text: str, first: int | None, last: int | None, close: bool, prepend_bos: bool
) -> None:
    own = _Template(first, last)
    wrapped = HFTokenizer(own, close_prompts=close)
    assert wrapped.closing_token_id == (last if close else None)
    ids = encode(wrapped, text, prepend_bos)
    plain = own.encode(text, add_special_tokens=False)
    if not prepend_bos or first is None:
        assert ids == plain  # nothing added without a BOS to add
    elif close:
        assert ids == own(text)["input_ids"]  # [CLS] text [SEP], as the tokenizer does
    else:
        assert ids == [first, *plain]  # a causal LM's prompt goes on after the text
