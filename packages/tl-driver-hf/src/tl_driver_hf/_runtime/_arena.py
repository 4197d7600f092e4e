"""Buffers for the values the driver computes itself, reused once nobody holds them.

Capturing every hook keeps hundreds of tensors alive, so the memory each forward writes
them into is fresh: glibc hands the previous cache's pages back to the kernel when it is
freed, and every first touch of a page is a fault (about 0.8 us per 4 KiB page here; on a
GPT-2-small-shaped forward, capturing every hook took 123 k faults a call, a plain forward
50 k: ``docs/cache.md``). The values transformers' own modules compute land wherever torch's allocator
puts them, but the ones the driver computes (attention scores, pattern and ``z`` of the
hooked attention, an RMS norm's normalized value) can be written into buffers the driver keeps,
and so can the logits, where the head is a plain bias-free ``nn.Linear`` (the same matrix
product, into a kept buffer).

A buffer is handed out as a view, so the driver can tell from the storage's use count
whether anything else (a cache, a view of it, a hook's stash, autograd) still holds it;
only then is it written again. After each forward the arena keeps exactly the buffers that
forward used, so what it holds between calls is bounded by one forward's own values.
Only CPU tensors without gradients take part: CUDA's caching allocator already reuses
memory, and autograd does not record ``out=`` writes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = ["CaptureArena", "head_into_arena"]

#: Shape, dtype, and whether made under ``torch.inference_mode`` (such a tensor cannot be
#: written outside it, so each mode has its own buffers).
_Key = tuple[tuple[int, ...], torch.dtype, bool]


#: torch's count of a storage's references (what inductor's CUDA graph trees read to tell
#: whether outputs are still alive); without it the arena hands out nothing.
_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _use_count(buffer: torch.Tensor) -> int:
    """References to ``buffer``'s storage (tensors and views sharing it)."""
    assert _STORAGE_USE_COUNT is not None
    return int(_STORAGE_USE_COUNT(buffer.untyped_storage()._cdata))


class CaptureArena:
    """Reusable CPU buffers for the driver's own captured values, one forward's worth.

    ``HFDriver.capture_arena``; ``clear()`` frees what it keeps between calls, and
    ``enabled = False`` stops it (every value then takes fresh memory, and nothing is kept).
    A forward's values past ``max_bytes`` take fresh memory and are not kept, so a call
    with huge logits does not leave them held after the caller let them go.
    """

    #: The default of ``max_bytes``: 2 GiB.
    DEFAULT_MAX_BYTES = 2 << 30

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        #: Whether forwards write into kept buffers (and keep them for the next forward).
        self.enabled = True
        #: The most bytes one forward's buffers may hold (and the arena keep after it).
        self.max_bytes = max_bytes
        self._taken_bytes = 0
        #: Buffers kept from earlier forwards: key -> [(buffer, its use count when free)].
        self._kept: dict[_Key, list[tuple[torch.Tensor, int]]] = {}
        #: Buffers handed out during the current forward (``None`` outside a forward).
        self._taken: dict[_Key, list[tuple[torch.Tensor, int]]] | None = None

    @contextmanager
    def forward(self) -> Iterator[None]:
        """Hand out buffers for one forward; afterwards keep only the ones it used."""
        if self._taken is not None:  # a forward inside a forward (certification probes)
            yield
            return
        if not self.enabled:
            self._kept = {}
            yield
            return
        self._taken, self._taken_bytes = {}, 0
        try:
            yield
        finally:
            self._kept, self._taken = self._taken, None

    def empty(self, shape: tuple[int, ...] | torch.Size, like: torch.Tensor) -> torch.Tensor | None:
        """An uninitialised CPU tensor of ``shape`` and ``like``'s dtype to write into with
        ``out=``: a kept buffer nobody else holds when there is one, else a fresh one.

        ``None`` where the arena takes no part (outside ``forward()``, off the CPU, with
        gradients enabled, or past ``max_bytes`` for this forward): the caller then
        computes as usual.
        """
        if (
            self._taken is None
            or like.device.type != "cpu"
            or torch.is_grad_enabled()
            or _STORAGE_USE_COUNT is None
        ):
            return None
        size = like.element_size() * math.prod(shape)
        if self._taken_bytes + size > self.max_bytes:
            return None
        key = (tuple(shape), like.dtype, torch.is_inference_mode_enabled())
        kept = self._kept.get(key, [])
        for index, (buffer, free_count) in enumerate(kept):
            if _use_count(buffer) == free_count:
                del kept[index]
                break
        else:
            buffer = torch.empty(shape, dtype=like.dtype)
            free_count = _use_count(buffer)
        self._taken_bytes += size
        self._taken.setdefault(key, []).append((buffer, free_count))
        return buffer.view(buffer.shape)

    @property
    def nbytes(self) -> int:
        """Bytes the arena keeps (whether or not something else still holds them)."""
        return sum(b.untyped_storage().nbytes() for group in self._kept.values() for b, _ in group)

    def clear(self) -> None:
        """Forget every kept buffer (freed once nothing else holds it)."""
        self._kept = {}


@contextmanager
def head_into_arena(head: nn.Module, arena: CaptureArena) -> Iterator[None]:
    """For one forward, a bias-free ``nn.Linear`` head writes its logits into ``arena``.

    ``nn.Linear`` without a bias computes ``x @ W.T`` as one ``mm`` over the flattened
    positions; the head does the same ``mm`` into the arena's buffer, so the logits keep
    their bits. Any other head (a bias, a subclass, accelerate's hooks on ``forward``) is
    left alone, as is every call the arena takes no part in.
    """
    if type(head) is not nn.Linear or head.bias is not None or "forward" in vars(head):
        yield
        return
    weight = head.weight

    def forward(x: torch.Tensor) -> torch.Tensor:
        fits = x.dim() >= 2 and x.dtype == weight.dtype and x.device == weight.device
        out = arena.empty((*x.shape[:-1], weight.shape[0]), x) if fits else None
        if out is None:
            return nn.functional.linear(x, weight)
        torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out=out.view(-1, weight.shape[0]))
        return out

    head.forward = forward
    try:
        yield
    finally:
        del head.forward
