"""Per-sample activation files (safetensors, written atomically) and their summaries."""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union

import torch

from tl_core import UserError

__all__ = [
    "Positions",
    "Reduce",
    "TOKENS_KEY",
    "check_output_dir",
    "reduce_and_select",
    "sample_path",
    "summarise",
    "write_sample",
]

#: The tensor holding the token ids (prompt then generated) in every file.
TOKENS_KEY = "tokens"
#: ``None`` (every position), ``"mean"``/``"last"`` over the positions, or a callable.
Reduce = Union[None, Literal["mean", "last"], Callable[[torch.Tensor], torch.Tensor]]
#: ``None`` (all), ``"prompt"``, ``"generated"`` or explicit indices (negative from the end).
Positions = Union[None, Literal["prompt", "generated"], Sequence[int]]
_SMALL = 64  # reduce results up to this many numbers are copied into the summary
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def check_output_dir(output_dir: str | os.PathLike[str]) -> Path:
    """Create ``output_dir`` if needed and prove it is writable (a probe file is removed).

    Raises:
        UserError: It cannot be created or written.
    """
    path = Path(output_dir).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".tl-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise UserError(
            f"capture_activations: output_dir {str(path)!r} is not a writable folder "
            f"({error.strerror or error}); pass a folder this process can write"
        ) from None
    return path


def sample_path(output_dir: Path, sample_id: object, epoch: int) -> Path:
    """``<output_dir>/<sample_id>_epoch<k>.safetensors`` (unsafe characters become ``_``)."""
    return output_dir / f"{_UNSAFE.sub('_', str(sample_id))}_epoch{int(epoch)}.safetensors"


def reduce_and_select(
    tensor: torch.Tensor, layout: str, *, prompt_len: int, positions: Positions, reduce: Reduce
) -> torch.Tensor:
    """Pick positions (the query axis for attention patterns), then reduce over them.

    Args:
        tensor: One hook's capture without the batch dimension.
        layout: The hook's layout (``"b p d"``, ``"b h q k"``, ...).
        prompt_len: Prompt tokens at the start of the sequence.
        positions: Which positions to keep.
        reduce: How to reduce over them.
    """
    axis = 1 if layout == "b h q k" else 0
    length = tensor.shape[axis]
    if positions == "prompt":
        index = list(range(min(prompt_len, length)))
    elif positions == "generated":
        index = list(range(prompt_len, length))
    elif positions is None:
        index = list(range(length))
    else:
        index = [p + length if p < 0 else p for p in positions]
        bad = [p for p, i in zip(positions, index, strict=True) if not 0 <= i < length]
        if bad:
            raise UserError(
                f"capture_activations: positions {bad} are out of range for a sequence of "
                f"{length} tokens"
            )
    picked = tensor.index_select(axis, torch.tensor(index, dtype=torch.long, device=tensor.device))
    if reduce is None:
        return picked
    if not index:
        raise UserError(
            f"capture_activations: reduce={reduce!r} over no positions ({positions!r} is empty here)"
        )
    if reduce == "mean":
        return picked.float().mean(dim=axis).to(picked.dtype)
    if reduce == "last":
        return picked.select(axis, -1)
    result = reduce(picked)
    if not isinstance(result, torch.Tensor):
        raise UserError(
            f"capture_activations: reduce callable returned {type(result).__name__}, expected a tensor"
        )
    return result


def write_sample(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    tokens: Sequence[int],
    metadata: Mapping[str, Any],
) -> None:
    """Write one sample's tensors and token ids to ``path`` atomically (temp file + rename)."""
    from safetensors.torch import save_file

    data = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    data[TOKENS_KEY] = torch.tensor(list(tokens), dtype=torch.long)
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items()}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(data, tmp, metadata=meta)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def summarise(tensors: Mapping[str, torch.Tensor], *, reduced: bool) -> dict[str, Any]:
    """Per hook: shape and norm, and the values themselves when a reduce made them small."""
    out: dict[str, Any] = {"shapes": {}, "norms": {}}
    for name, t in tensors.items():
        out["shapes"][name] = list(t.shape)
        out["norms"][name] = float(t.float().norm())
        if reduced and t.numel() <= _SMALL:
            out.setdefault("values", {})[name] = [float(x) for x in t.float().flatten().tolist()]
    return out
