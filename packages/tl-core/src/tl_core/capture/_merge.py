"""``merge_stores``: join the parts of a sharded capture into one store.

The parts must be the same job (same fingerprint), each complete, with disjoint shards
that together cover the job. The merged store is assembled in a temporary folder next to
the output (shards hard-linked where the file system allows, else copied) and renamed into
place, so an interrupted merge leaves no half store behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tl_core._errors import UserError
from tl_core.capture._manifest import Manifest, identity_differences

__all__ = ["merge_stores"]


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def merge_stores(
    parts: Sequence[str | Path], output: str | Path, *, verify: bool = True
) -> Manifest:
    """Join complete parts of one job into a store at ``output``.

    Args:
        parts: The parts' store folders (any order).
        output: A new folder for the merged store.
        verify: Check every shard's SHA-256 (reads the whole store once). Without it each
            shard's size, header and manifest entry are still checked; a caller that had
            every part verified where it was written (as ``capture_on_ray`` does, on the
            parts' nodes in parallel) skips the second read.

    Returns:
        The merged store's manifest.

    Raises:
        UserError: A missing or unfinished part, parts of different jobs (naming the
            differences), a part given twice, shards missing from every part, a damaged
            shard, or an existing output.
    """
    folders = [Path(p) for p in parts]
    output = Path(output)
    if not folders:
        raise UserError("merge needs the parts' folders")
    if output.exists():
        raise UserError(f"{output} exists; merge writes a new store")
    manifests = [Manifest.load(f) for f in folders]
    first = manifests[0]
    count = first.part[1]
    for folder, manifest in zip(folders, manifests, strict=True):
        differences = identity_differences(first.identity, manifest.identity)
        if differences:
            raise UserError(
                f"{folder} is not part of the same capture as {folders[0]}:\n  "
                + "\n  ".join(differences)
            )
        if manifest.part[1] != count:
            raise UserError(
                f"{folder} is part of a job split {manifest.part[1]} ways, {folders[0]} of one split {count} ways"
            )
        if not manifest.complete:
            raise UserError(
                f"{folder} (part {manifest.part[0]}/{count}) is incomplete; rerun its capture to finish it"
            )
    indices = [m.part[0] for m in manifests]
    if len(set(indices)) != len(indices):
        raise UserError(f"a part is given twice: parts {sorted(indices)}")
    missing = sorted(set(range(count)) - set(indices))
    if missing:
        raise UserError(f"parts {missing} of {count} are missing; merge needs every part")
    total = first.total_shards
    assert total is not None  # complete parts know the job's size
    merged = Manifest(identity=first.identity, hooks=dict(first.hooks), total_shards=total)
    for folder, manifest in zip(folders, manifests, strict=True):
        if manifest.total_shards != total:
            raise UserError(
                f"{folder} counts {manifest.total_shards} shards, {folders[0]} {total}: the parts read different inputs"
            )
        manifest.check_shards(folder, checksum=verify)
        merged.shards.update(manifest.shards)
    gaps = [i for i in range(total) if i not in merged.shards]
    if gaps:
        raise UserError(f"no part holds shards {gaps}")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        for folder, manifest in zip(folders, manifests, strict=True):
            for record in manifest.shards.values():
                _link_or_copy(folder / record.file, staging / record.file)
        merged.save(staging)
        staging.rename(output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return merged
