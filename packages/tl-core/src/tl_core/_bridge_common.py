"""What both bridges share: text handling, hook bookkeeping and loss."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal, Union

import torch
import torch.nn.functional as F

from tl_core._batching import TokenBatch, pad_batch
from tl_core._errors import UserError
from tl_core._hook_point import HookHandle, HookPoint
from tl_core._tokenizer import Tokenizer, padding_id

__all__ = ["BridgeCommon", "HookSpec", "ModelInput", "NamesFilter", "next_token_loss"]

#: Text, texts, or token ids (1-D/2-D tensor, list, or ragged list of lists).
ModelInput = Union[str, Sequence[str], torch.Tensor, Sequence[int], Sequence[Sequence[int]]]
#: ``(hook name or predicate on canonical names, hook function)``.
HookSpec = tuple[Union[str, Callable[[str], bool]], Callable[..., Any]]
NamesFilter = Union[None, str, Iterable[str], Callable[[str], bool]]


class BridgeCommon:
    """Mixin holding everything a bridge does that does not depend on the engine.

    Subclasses provide ``tokenizer``, ``hook_dict`` and ``_resolve_hook``.
    """

    _permanent: list[HookHandle]
    #: Runs the model; each bridge defines it.
    forward: Callable[..., Any]

    @property
    def tokenizer(self) -> Tokenizer:
        """The driver's tokenizer."""
        raise NotImplementedError

    @property
    def hook_dict(self) -> dict[str, HookPoint]:
        """Canonical hook name -> HookPoint for every hook this bridge can fire."""
        raise NotImplementedError

    def _resolve_hook(self, name: str) -> str:
        raise NotImplementedError

    # -- tokens -----------------------------------------------------------------------

    def to_tokens(
        self,
        text: str | Sequence[str],
        *,
        prepend_bos: bool = True,
        padding_side: Literal["right", "left"] = "right",
    ) -> torch.Tensor:
        """Token ids ``[batch, pos]`` of one text or a list of texts (padded with the pad id)."""
        return self._token_batch(text, prepend_bos=prepend_bos, padding_side=padding_side).ids

    def to_string(self, tokens: torch.Tensor | Sequence[int] | Sequence[Sequence[int]]) -> str | list[str]:
        """Decode ``[pos]`` ids to a string, or ``[batch, pos]`` ids to a list of strings."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.tolist()
        items = list(tokens)
        if items and isinstance(items[0], (list, tuple)):
            return [self.tokenizer.decode(row) for row in items]
        return self.tokenizer.decode(items)

    def to_str_tokens(self, text: str | torch.Tensor | Sequence[int], *, prepend_bos: bool = True) -> list[str]:
        """One readable string per token of ``text`` (or of the given ids)."""
        if isinstance(text, str):
            ids = self._encode(text, prepend_bos)
        else:
            ids = text.flatten().tolist() if isinstance(text, torch.Tensor) else list(text)
        return [self.tokenizer.token_to_str(int(i)) for i in ids]

    def to_single_token(self, text: str) -> int:
        """The id of ``text`` if it is exactly one token.

        Raises:
            UserError: If it encodes to zero or several tokens.
        """
        ids = self.tokenizer.encode(text)
        if len(ids) != 1:
            raise UserError(f"{text!r} is {len(ids)} tokens ({ids}), not a single token")
        return ids[0]

    def _encode(self, text: str, prepend_bos: bool) -> list[int]:
        ids = self.tokenizer.encode(text)
        bos = self.tokenizer.bos_token_id
        return [bos, *ids] if prepend_bos and bos is not None else ids

    def _token_batch(
        self,
        inputs: ModelInput,
        *,
        prepend_bos: bool = True,
        padding_side: Literal["right", "left"] = "right",
    ) -> TokenBatch:
        """Tokenize text (or take ids as they are) into a right- or left-padded batch."""
        if isinstance(inputs, str):
            rows: Any = [self._encode(inputs, prepend_bos)]
        elif isinstance(inputs, Sequence) and inputs and all(isinstance(t, str) for t in inputs):
            rows = [self._encode(t, prepend_bos) for t in inputs]  # type: ignore[arg-type]
        else:
            rows = inputs
        if isinstance(rows, list) and any(len(r) == 0 for r in rows):
            raise UserError("an input text is empty and prepend_bos=False: nothing to run")
        return pad_batch(rows, pad_id=padding_id(self.tokenizer), padding_side=padding_side)

    def _generated(
        self, inputs: ModelInput, new_tokens: torch.Tensor, return_type: str | None
    ) -> str | list[str] | torch.Tensor:
        """What ``generate`` returns: text for text input (cut at EOS), else the new ids."""
        texts_in = isinstance(inputs, str) or (
            isinstance(inputs, Sequence) and bool(inputs) and all(isinstance(t, str) for t in inputs)
        )
        if (return_type or ("str" if texts_in else "tokens")) == "tokens":
            return new_tokens
        eos = self.tokenizer.eos_token_id
        rows = [row[: row.index(eos)] if eos in row else row for row in new_tokens.tolist()]
        texts = [self.tokenizer.decode(row) for row in rows]
        return texts[0] if isinstance(inputs, str) else texts

    # -- hooks ------------------------------------------------------------------------

    def get_hook_point(self, name: str) -> HookPoint:
        """The HookPoint for ``name`` (canonical or any alias)."""
        return self.hook_dict[self._resolve_hook(name)]

    def select_hooks(self, names_filter: NamesFilter) -> list[str]:
        """Canonical names chosen by a filter: ``None`` (all), a name, names, or a predicate.

        A predicate sees canonical names; names may be aliases.
        """
        if names_filter is None:
            return list(self.hook_dict)
        if isinstance(names_filter, str):
            return [self._resolve_hook(names_filter)]
        if callable(names_filter):
            return [n for n in self.hook_dict if names_filter(n)]
        return list(dict.fromkeys(self._resolve_hook(n) for n in names_filter))

    def add_hook(
        self,
        name: str | Callable[[str], bool],
        hook: Callable[..., Any],
        dir: Literal["fwd", "bwd"] = "fwd",
        *,
        is_permanent: bool = False,
    ) -> list[HookHandle]:
        """Attach ``hook`` to one named hook, or to every hook a predicate selects."""
        names = [n for n in self.hook_dict if name(n)] if callable(name) else [self._resolve_hook(name)]
        handles = [self.hook_dict[n].add_hook(hook, dir, is_permanent=is_permanent) for n in names]
        if is_permanent:
            self._permanent.extend(handles)
        return handles

    def reset_hooks(self, *, including_permanent: bool = False) -> None:
        """Remove every hook (permanent ones too when asked)."""
        for point in self.hook_dict.values():
            point.remove_hooks("both", including_permanent=including_permanent)

    def run_with_hooks(
        self,
        input: ModelInput,
        *,
        fwd_hooks: Sequence[HookSpec] = (),
        bwd_hooks: Sequence[HookSpec] = (),
        reset_hooks_end: bool = True,
        return_type: Any = "logits",
        **forward_kwargs: Any,
    ) -> Any:
        """Run with temporary hooks: ``[(name or predicate, fn(tensor, hook=...)), ...]``.

        Hooks are removed afterwards (unless ``reset_hooks_end=False``), also when the
        forward raises. On local drivers forward hooks may edit values, and backward hooks
        fire when you call ``.backward()`` on the result, so pass ``reset_hooks_end=False``
        for them or run the backward inside ``hooks()``. On remote drivers hooks read the
        captured values after the engine ran and must not change them.
        """
        with self.hooks(fwd_hooks, bwd_hooks, reset_hooks_end=reset_hooks_end):
            return self.forward(input, return_type, **forward_kwargs)

    @contextmanager
    def hooks(
        self,
        fwd_hooks: Sequence[HookSpec] = (),
        bwd_hooks: Sequence[HookSpec] = (),
        *,
        reset_hooks_end: bool = True,
    ) -> Iterator[Any]:
        """Attach hooks for the duration of a ``with`` block; they are removed on exit,
        also when the block raises (unless ``reset_hooks_end=False``)."""
        handles: list[HookHandle] = []
        try:
            for direction, specs in (("fwd", fwd_hooks), ("bwd", bwd_hooks)):
                for name, fn in specs:
                    handles.extend(self.add_hook(name, fn, direction))  # type: ignore[arg-type]
            yield self
        finally:
            if reset_hooks_end:
                for handle in handles:
                    handle.remove()


def next_token_loss(
    logits: torch.Tensor, tokens: torch.Tensor, lengths: Sequence[int], *, per_token: bool = False
) -> torch.Tensor:
    """Cross-entropy of predicting each next token, over real (unpadded) positions only.

    Args:
        logits: ``[batch, pos, vocab]``.
        tokens: ``[batch, pos]`` right-padded ids.
        lengths: Real length of each row.
        per_token: Return ``[batch, pos - 1]`` losses (zero at padding) instead of the mean.
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
