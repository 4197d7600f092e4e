"""``merge_stores``: join the parts of a sharded capture into one store.

The parts must be the same job (same fingerprint), each complete, with disjoint shards
that together cover the job. The merged store is assembled in a temporary folder next to
the output (shards hard-linked where the file system allows, else copied) and renamed into
place, so an interrupted merge leaves no half store behind.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from tl_core._errors import UserError
from tl_core.capture._manifest import Manifest, identity_differences
from tl_core.capture._model_files import MODEL_KEY, describe_model, model_mismatch, unrecorded

__all__ = ["merge_stores"]

_LOG = logging.getLogger("tl_core.capture")


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _check_models(folders: Sequence[Path], manifests: Sequence[Manifest]) -> None:
    """Refuse parts captured from different model files (or a mix of parts that record
    them and parts that do not); warn when no part records them.

    Raises:
        UserError: Naming both parts, both models' sources and digests, and what to do.
    """
    old = [f for f, m in zip(folders, manifests, strict=True) if unrecorded(m.identity)]
    if old and len(old) == len(folders):
        _LOG.warning(
            "tl capture merge: the parts were written by an earlier tl-core, which recorded the "
            "model's path and sizes but no digest of its weights and tokenizer, so this merge "
            "cannot check that every part holds rows of the same model"
        )
        return
    if old:
        new = next(f for f in folders if f not in old)
        raise UserError(
            f"{old[0]} was written by an earlier tl-core, which recorded no digest of the model's "
            f"weights and tokenizer, {new} by one that does, so the merge cannot check that they "
            f"hold rows of one model; recapture {old[0]} with this tl-core (same command, a new "
            f"output folder), then merge again"
        )
    reference = manifests[0].identity[MODEL_KEY]
    for folder, manifest in zip(folders[1:], manifests[1:], strict=True):
        model = manifest.identity[MODEL_KEY]
        what = model_mismatch(reference, model)
        if what is not None:
            raise UserError(
                f"{folder} and {folders[0]} hold rows of different models: {folders[0]} was "
                f"captured from {describe_model(reference)}, {folder} from "
                f"{describe_model(model)}; {what}. The checkpoint changed between the parts: "
                f"recapture every part whose model is not the one you want (the same command "
                f"with its --shard, into a new folder), then merge again"
            )


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
            differences; parts of different model files name both models' sources and
            digests), a part given twice, shards missing from every part, a damaged
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
    _check_models(folders, manifests)
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
