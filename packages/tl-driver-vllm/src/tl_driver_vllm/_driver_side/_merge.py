"""Driver side: merge the workers' batched results.

Every worker returns one ``[batch, width, ...]`` tensor per hook. Replicated sites (residual-stream and module-output sites, after tensor-parallel
all-reduce) come from tensor-parallel rank 0 of whichever pipeline stage holds them;
vocabulary shards of the logits are concatenated in rank order; head- and neuron-level
sites come from every rank with the place of its piece (``_shards.Shard``) and are put
together in global head or neuron order (a key/value head replicated on several ranks is
taken once). When asked, the other ranks' copies of replicated values (and of replicated
key/value heads) are compared with the first and a mismatch fails loudly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from tl_core import TLError
from tl_driver_vllm._wire import unpack

__all__ = ["merge_batched", "pad_rows"]

_SHARDED = ("logits", "unembed.hook_out")


def merge_batched(
    results: Sequence[dict[str, Any]], *, vocab: int, check_ranks: bool
) -> dict[str, torch.Tensor]:
    """Per hook (and ``"logits"``): the whole batch's tensor, merged across workers.

    Args:
        results: What ``tl_collect`` returned on every worker (shared-memory references
            already read by ``SharedFiles.receive``).
        vocab: Vocabulary size (padding of sharded vocabularies is cut off).
        check_ranks: Compare replicated captures across tensor-parallel ranks.

    Replicated hooks come from tensor-parallel rank 0 (the others' copies compared when
    ``check_ranks``); sharded hooks are put together along their head (or neuron) axis;
    vocabulary shards are concatenated in rank order.

    Raises:
        TLError: Ranks disagree on a replicated hook, or a shard is missing.
    """
    merged: dict[str, torch.Tensor] = {}
    pieces: dict[str, list[tuple[int, int, int, int, torch.Tensor]]] = {}
    shards: dict[str, list[tuple[int, torch.Tensor]]] = {}
    others: list[tuple[int, int, str, torch.Tensor]] = []
    for result in results:
        tp_rank, pp_rank = int(result["tp_rank"]), int(result["pp_rank"])
        placed = result.get("shards", {})
        for name, packed in result.get("batched", {}).items():
            tensor = unpack(packed)
            if name in placed:
                axis, start, count = (int(v) for v in placed[name])
                # The batch axis comes first here.
                pieces.setdefault(name, []).append((start, tp_rank, axis + 1, count, tensor))
            elif name in _SHARDED:
                shards.setdefault(name, []).append((tp_rank, tensor))
            elif tp_rank == 0:
                merged[name] = tensor
            else:
                others.append((tp_rank, pp_rank, name, tensor))
    for name, found in pieces.items():
        merged[name] = _assemble(name, found, check_ranks)
    for name, parts in shards.items():
        parts.sort(key=lambda item: item[0])
        full = torch.cat([t for _, t in parts], dim=-1) if len(parts) > 1 else parts[0][1]
        merged[name] = full if full.shape[-1] == vocab else full[..., :vocab]
    if check_ranks:
        for tp_rank, pp_rank, name, tensor in others:
            _check_rank(merged.get(name), tensor, tp_rank, pp_rank, name)
    return merged


def _assemble(
    name: str, found: list[tuple[int, int, int, int, torch.Tensor]], check_ranks: bool
) -> torch.Tensor:
    """One hook's pieces from every rank, in global head (or neuron) order."""
    found.sort(key=lambda item: (item[0], item[1]))
    parts: list[torch.Tensor] = []
    axis, end = found[0][2], 0
    for start, rank, _, count, tensor in found:
        if start < end:
            # A key/value head replicated on several ranks (more ranks than kv heads).
            if check_ranks:
                _check_rank(parts[-1], tensor, rank, 0, name)
            continue
        if start != end:
            raise TLError(
                f"the tensor-parallel ranks returned no slice {end}..{start - 1} of hook "
                f"{name!r}; the vllm driver's shard table does not fit this model"
            )
        parts.append(tensor)
        end = start + count
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts, dim=axis)


def _check_rank(
    reference: torch.Tensor | None, tensor: torch.Tensor, rank: int, stage: int, name: str
) -> None:
    if reference is not None and reference.shape == tensor.shape:
        ref, other = reference.float(), tensor.float()
        tol = 1e-5 * max(1.0, float(ref.abs().max()))
        if torch.equal(ref, other) or float((ref - other).abs().max()) <= tol:
            return
        detail = f"max abs difference {float((ref - other).abs().max()):.3g} (allowed {tol:.3g})"
    else:
        shape = None if reference is None else tuple(reference.shape)
        detail = f"rank 0 has shape {shape}, rank {rank} has {tuple(tensor.shape)}"
    raise TLError(
        f"tensor-parallel ranks disagree on replicated hook {name!r} (pipeline stage {stage}, "
        f"tensor-parallel rank {rank} vs 0): {detail}. This hook should be identical on every "
        "rank after the all-reduce; the vllm driver's site table does not fit this model or "
        "vLLM version. Please report it with the model and the vLLM version."
    )


def pad_rows(rows: Sequence[torch.Tensor | None], lengths: Sequence[int]) -> torch.Tensor:
    """Right-pad per-prompt ``[length, ...]`` tensors into ``[batch, max_length, ...]``.

    Raises:
        TLError: A prompt's tensor is missing or has the wrong length.
    """
    first = next((r for r in rows if r is not None), None)
    if first is None or any(r is None for r in rows):
        raise TLError("the engine returned no values for some prompts; see the worker logs")
    for b, (row, length) in enumerate(zip(rows, lengths, strict=True)):
        assert row is not None
        if row.shape[0] != length:
            raise TLError(
                f"prompt {b}: the engine returned {row.shape[0]} positions, expected {length}; "
                "some positions were not recomputed (prefix caching?)"
            )
    full = [r for r in rows if r is not None]
    width = max(lengths)
    inner = first.shape[1:]
    # Whole prompts copied as flat 1-D blocks: torch's stack/cat of [pos, heads, d_head]
    # pieces takes a strided path ~25x slower than these memcpy-like copies.
    if all(n == width for n in lengths):
        return torch.stack([r.reshape(-1) for r in full]).view(len(full), width, *inner)
    per_pos = math.prod(inner)
    out = first.new_zeros((len(full), width * per_pos))
    for b, (row, length) in enumerate(zip(full, lengths, strict=True)):
        out[b, : length * per_pos] = row.reshape(-1)
    return out.view(len(full), width, *inner)
