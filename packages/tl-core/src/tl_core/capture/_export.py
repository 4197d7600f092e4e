"""Export a store in sae-lens's cached-activations format.

sae-lens (``use_cached_activations=True``) reads a ``datasets`` folder written by
``save_to_disk`` with one ``Array2D(context_size, d_in)`` column per hook, named by the
hook name its config uses, and a ``token_ids`` column of ``context_size`` int32 ids. A
store becomes that when every context holds the same number of rows: packed contexts, or
contexts padded to full length (``drop_padding=False``). The job's last context may be
short; it is left out and counted.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tl_core._errors import UserError
from tl_core.capture._reader import CaptureStore

__all__ = ["SaeLensExport", "export_sae_lens"]

_ARROW_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "float32"}


@dataclass(frozen=True)
class SaeLensExport:
    """What an export wrote.

    Attributes:
        path: The ``datasets`` folder.
        columns: Store hook -> column name.
        context_size: Rows per exported context (sae-lens's ``context_size``).
        d_in: Column -> width of one row (sae-lens's ``d_in``; multi-axis rows are flattened).
        contexts: Contexts exported.
        dropped_rows: Rows of the short final context that was left out (0 if none).
    """

    path: Path
    columns: dict[str, str]
    context_size: int
    d_in: dict[str, int]
    contexts: int
    dropped_rows: int


def _context_rows(store: CaptureStore) -> tuple[int, int]:
    """``(rows per context, contexts of that size)``; only the job's last context may be short."""
    counts: list[int] = []
    last: int | None = None
    for chunk in store.iter_batches("contexts", batch_size=1 << 20):
        values, sizes = (t.tolist() for t in torch.unique_consecutive(chunk, return_counts=True))
        if counts and values and values[0] == last:  # a context continued from the last chunk
            counts[-1] += sizes[0]
            values, sizes = values[1:], sizes[1:]
        counts.extend(sizes)
        last = values[-1] if values else last
    if not counts:
        raise UserError(f"{store.folder} holds no rows to export")
    width = counts[0]
    full = counts if counts[-1] == width else counts[:-1]
    if any(n != width for n in full):
        raise UserError(
            f"{store.folder}: contexts hold {min(counts)} to {max(counts)} rows, but sae-lens "
            f"needs contexts of one size; capture with pack=True (or drop_padding=False) and "
            f"without drop_bos when separators are BOS tokens"
        )
    return width, len(full)


def export_sae_lens(
    store: CaptureStore | str | Path,
    output: str | Path,
    *,
    hooks: Sequence[str] | None = None,
    columns: Mapping[str, str] | None = None,
) -> SaeLensExport:
    """Write ``store`` as a sae-lens cached-activations dataset at ``output``.

    Args:
        store: A complete store (or its folder).
        output: A new folder.
        hooks: Hooks to export (default: all).
        columns: Hook -> column name (default: each hook's name as it was requested, e.g.
            ``blocks.0.hook_resid_post``, which is what sae-lens's ``hook_name`` must say).

    Raises:
        UserError: ``datasets`` missing, an existing output, contexts of different sizes.
    """
    if isinstance(hooks, str):
        raise UserError(
            f"hooks must be a list of hook names, got the string {hooks!r}; e.g. hooks=[{hooks!r}]"
        )
    try:
        import datasets
    except ImportError:
        raise UserError(
            "exporting to sae-lens writes a `datasets` folder: pip install datasets"
        ) from None
    if not isinstance(store, CaptureStore):
        store = CaptureStore(store)
    output = Path(output)
    if output.exists():
        raise UserError(f"{output} exists; the export writes a new folder")
    names = [store.field(h) for h in (hooks or store.hooks)]
    if not names or any(n not in store.manifest.hooks for n in names):
        raise UserError(f"hooks must name captured hooks; the store holds {store.hooks}")
    chosen = {n: (columns or {}).get(n) or store.manifest.hooks[n].requested for n in names}
    width, n_contexts = _context_rows(store)
    d_in = {chosen[n]: math.prod(store.manifest.hooks[n].shape) for n in names}
    features = datasets.Features(
        {
            **{
                chosen[n]: datasets.Array2D(
                    shape=(width, d_in[chosen[n]]),
                    dtype=_ARROW_DTYPES[store.manifest.hooks[n].dtype],
                )
                for n in names
            },
            "token_ids": datasets.Sequence(datasets.Value("int32"), length=width),
        }
    )
    rows = width * n_contexts

    def generate() -> Iterator[dict[str, Any]]:
        per_chunk = max(1, (1 << 16) // width) * width
        batches = store.iter_batches(names[0], batch_size=per_chunk, fields=[*names[1:], "tokens"])
        seen = 0
        for batch in batches:
            batch = batch if isinstance(batch, dict) else {names[0]: batch}
            keep = min(per_chunk, rows - seen)
            if keep <= 0:
                break
            seen += keep
            contexts = keep // width
            shaped = {
                chosen[n]: batch[n][:keep].float().reshape(contexts, width, -1).numpy()
                for n in names
            }
            token_ids = batch["tokens"][:keep].reshape(contexts, width).numpy()
            for c in range(contexts):
                yield {
                    **{col: value[c] for col, value in shaped.items()},
                    "token_ids": token_ids[c],
                }

    scratch = Path(tempfile.mkdtemp(prefix="tl-export-"))
    try:
        dataset = datasets.Dataset.from_generator(
            generate, features=features, cache_dir=str(scratch)
        )
        dataset.save_to_disk(str(output))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return SaeLensExport(
        path=output,
        columns=chosen,
        context_size=width,
        d_in=d_in,
        contexts=n_contexts,
        dropped_rows=len(store) - rows,
    )
