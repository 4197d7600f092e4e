"""Preparing a capture: the hooks as this model serves them, the store's identity, and the
checks that let a rerun continue a store (same job, intact shards) or refuse it."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tl_core._errors import UserError
from tl_core._version import __version__
from tl_core.capture._config import CaptureConfig
from tl_core.capture._manifest import MANIFEST, HookRecord, Manifest, identity_differences
from tl_core.capture._model_files import (
    MODEL_KEY,
    comparable,
    describe_model,
    model_mismatch,
    unrecorded,
)
from tl_core.capture._shards import check_shard, shard_name
from tl_core.driver_api._discovery import available_drivers
from tl_core.hooks._vocabulary import BEFORE_BLOCKS, split_canonical

__all__ = [
    "HookPlan",
    "check_resumable",
    "identity",
    "open_store",
    "plan_hooks",
    "refuse_other_model",
    "shard_contexts",
    "stop_layer",
]

#: Bytes of one row's per-row fields (int32 token, int64 document, int64 context, int32 position).
_ROW_FIELD_BYTES = 4 + 8 + 8 + 4
_SHARD_BYTES = 256 * 2**20
_LOG = logging.getLogger("tl_core.capture")


@dataclass(frozen=True)
class HookPlan:
    """The hooks to capture: canonical name -> record (requested name, row shape, dtype)."""

    hooks: dict[str, HookRecord]

    @property
    def names(self) -> list[str]:
        """Canonical names in capture order."""
        return list(self.hooks)

    def row_bytes(self) -> int:
        """Bytes one stored position takes, hooks and row fields together."""
        total = _ROW_FIELD_BYTES
        for record in self.hooks.values():
            itemsize = torch.empty((), dtype=getattr(torch, record.dtype)).element_size()
            total += math.prod(record.shape) * itemsize
        return total


def plan_hooks(bridge: Any, config: CaptureConfig, probe_token: int) -> HookPlan:
    """Resolve the requested hooks on ``bridge`` and learn each one's row shape and dtype.

    A two-token probe run gives the dtypes the driver returns; the shapes are checked
    against the namespace's.

    Raises:
        UserError: An unknown or unservable name, a duplicate, or a hook whose rows have no
            fixed width (attention patterns and scores span the key positions).
    """
    namespace = bridge.namespace
    requested: dict[str, str] = {}
    for name in config.hooks:
        canonical = namespace.lookup(name)
        if canonical in requested:
            raise UserError(
                f"hooks {requested[canonical]!r} and {name!r} are the same hook ({canonical}); list it once"
            )
        if namespace.feature_shape(canonical) is None:
            raise UserError(
                f"{name!r} ({canonical}) has one value per key position, so its rows have no "
                f"fixed width; a capture store holds per-token rows. Capture q/k (hook_rot_q, "
                f"hook_rot_k) and rebuild patterns, or use run_with_cache"
            )
        requested[canonical] = name
    _, cache = bridge.run_with_cache(
        [[probe_token, probe_token]],
        names_filter=list(requested),
        return_type=None,
        prepend_bos=False,
        device="cpu",
    )
    hooks: dict[str, HookRecord] = {}
    for canonical, name in requested.items():
        tensor = cache[canonical]
        shape = tuple(int(n) for n in tensor.shape[2:])
        expected = namespace.feature_shape(canonical)
        if shape != expected:
            raise UserError(
                f"the driver serves {canonical} with rows of shape {shape}, its namespace says "
                f"{expected}: the driver breaks its contract (report it to its authors)"
            )
        dtype = (
            config.dtype
            if config.dtype and tensor.is_floating_point()
            else str(tensor.dtype).removeprefix("torch.")
        )
        hooks[canonical] = HookRecord(name, shape, dtype)
    return HookPlan(hooks)


def shard_contexts(config: CaptureConfig, plan: HookPlan) -> int:
    """Contexts per shard: the configured number, or about 256 MiB of rows (whole batches)."""
    if config.shard_contexts is not None:
        return config.shard_contexts
    per_context = plan.row_bytes() * config.context_size
    batches = max(1, _SHARD_BYTES // (per_context * config.batch_size))
    return batches * config.batch_size


def stop_layer(names: list[str], n_layers: int) -> int | None:
    """The block to stop before when every hook lies before it (``None``: run to the end,
    as always on an encoder-decoder, whose two stacks have no one block to stop before)."""
    last = -1
    for name in names:
        if not name.startswith(("blocks.", *BEFORE_BLOCKS)):
            return None
        split = split_canonical(name)
        layer = None if split is None else split[1]
        if layer is None and name not in BEFORE_BLOCKS:
            return None  # a hook after the blocks (final norm, unembedding)
        last = max(last, -1 if layer is None else layer)
    stop = last + 1
    return stop if stop < n_layers else None


def _versions(driver: str) -> dict[str, str]:
    row = available_drivers().get(driver)
    versions = {"tl-core": __version__}
    if row is not None:
        versions["driver"] = f"{row.distribution} {row.version}"
        versions["engine"] = row.engine
    return versions


def attach_dictionaries(
    bridge: Any, config: CaptureConfig, dictionaries: Sequence[Any]
) -> list[Any]:
    """Attach ``dictionaries`` (loaded from ``config.dictionaries``' folders, in order) to
    ``bridge`` with each entry's options; the caller removes each (``Splice``).

    Raises:
        UserError: A dictionary that does not fit the model (see ``tl_core.sae.splice``);
            nothing stays attached then.
    """
    attached: list[Any] = []
    try:
        for entry, dictionary in zip(config.dictionaries, dictionaries, strict=True):
            options = {k: v for k, v in entry.items() if k != "path"}
            attached.append(bridge.add_sae(dictionary, **options))
    except BaseException:
        for splice in attached:
            splice.remove()
        raise
    return attached


def _dictionary_digest(folder: str) -> str:
    """The sha256 of a dictionary folder's config and weights (a store records what it used)."""
    digest = hashlib.sha256()
    for name in ("cfg.json", "sae_weights.safetensors"):
        with (Path(folder) / name).open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def identity(
    config: CaptureConfig,
    plan: HookPlan,
    bridge: Any,
    input_digest: str,
    contexts_per_shard: int,
    model: dict[str, Any],
) -> dict[str, Any]:
    """What decides a store's content; two runs may share a store only when it is equal.

    ``model`` is the record of the model's files (``model_files``): the sizes in
    ``bridge.cfg`` stay the same when a checkpoint's weights are replaced by others of the
    same shapes, its digests do not.
    """
    info = {k: v for k, v in asdict(bridge.cfg).items() if k != "device"}
    wanted = {
        "config": {**config.to_json(), "shard_contexts": contexts_per_shard},
        "input_digest": input_digest,
        "model": info,
        MODEL_KEY: model,
        "hooks": {name: [h.requested, list(h.shape), h.dtype] for name, h in plan.hooks.items()},
        "versions": _versions(config.driver),
    }
    if config.dictionaries:
        wanted["dictionaries"] = [
            _dictionary_digest(entry["path"]) for entry in config.dictionaries
        ]
    # As the manifest records it (tuples become lists), so an unchanged job compares equal.
    return dict(json.loads(json.dumps(wanted)))


def check_resumable(
    folder: Path,
    config: CaptureConfig,
    input_digest: str,
    part: tuple[int, int],
    model: dict[str, Any],
) -> None:
    """Refuse, before the model boots, a store that holds shards of another job or part.

    Compares what needs no model: the model's files (``model``, see ``model_files``), the
    config and the input's digest (and the shard size when the config sets it).
    ``open_store`` compares the whole identity after the boot.

    Raises:
        UserError: Another model (naming both records), or the differences, as
            ``open_store`` names them.
    """
    if not (folder / MANIFEST).is_file():
        return
    recorded = Manifest.load(folder)
    if not recorded.shards:
        return  # a store without a shard is started over (see open_store)
    if comparable(model):  # a hub id not cached yet is compared once the boot fetched it
        refuse_other_model(folder, recorded.identity, model)
    mine: dict[str, Any] = json.loads(
        json.dumps({"config": config.to_json(), "input_digest": input_digest})
    )
    theirs: dict[str, Any] = {
        "config": dict(recorded.identity.get("config") or {}),
        "input_digest": recorded.identity.get("input_digest"),
    }
    if config.shard_contexts is None:  # sized from the hooks' widths, known after the boot
        mine["config"].pop("shard_contexts", None)
        theirs["config"].pop("shard_contexts", None)
    _refuse_other_job(folder, identity_differences(theirs, mine), recorded.part, part)


def refuse_other_model(folder: Path, recorded: dict[str, Any], model: dict[str, Any]) -> None:
    """Refuse to add rows of ``model`` to the store in ``folder`` whose identity is
    ``recorded`` when that store holds rows of other model files, or records none.

    Raises:
        UserError: Naming both models' sources and digests, and what to do.
    """
    if unrecorded(recorded):
        raise UserError(
            f"{folder} was written by an earlier tl-core, which recorded the model's path and "
            f"sizes but no digest of its weights and tokenizer, so this run cannot check that it "
            f"reads the model the store's shards came from (a checkpoint replaced by another of "
            f"the same sizes would go unnoticed). Capture into a new output folder (or delete "
            f"{folder} and rerun)"
        )
    theirs = recorded[MODEL_KEY]
    what = model_mismatch(theirs, model)
    if what is not None:
        raise UserError(
            f"{folder} holds rows of another model than this run reads, so this run cannot "
            f"continue it: the store was captured from {describe_model(theirs)}, this run reads "
            f"{describe_model(model)}; {what}. Rerun with the checkpoint the store was "
            f"captured from, or capture into a new output folder"
        )


def _refuse_other_job(
    folder: Path, differences: list[str], recorded: tuple[int, int], part: tuple[int, int]
) -> None:
    if recorded != part and not differences:
        raise UserError(
            f"{folder} holds part {recorded[0]}/{recorded[1]} of the job; this run "
            f"is part {part[0]}/{part[1]}. Give each part its own folder."
        )
    if recorded != part:
        differences = [*differences, f"part: {recorded[0]}/{recorded[1]} -> {part[0]}/{part[1]}"]
    if differences:
        raise UserError(
            f"{folder} holds a capture with another configuration, so this run cannot "
            f"continue it:\n  " + "\n  ".join(differences) + "\nUse a new output folder, or rerun "
            "with the recorded settings."
        )


def open_store(
    folder: Path, wanted: dict[str, Any], plan: HookPlan, part: tuple[int, int], *, repair: bool
) -> tuple[Manifest, list[str]]:
    """The manifest to continue (checked against this job), or a new one; and what was found.

    A new manifest is not written here: the writer records it with the first shard, so a
    run that fails before its first shard leaves no store behind. A manifest that records
    no shard (a run that failed before its first, or one written by an older tl-core) is
    replaced by this job's, whatever its configuration; the notes say so.

    Leftovers of an interrupted run are removed: partial files, and shard files the manifest
    does not list (written, but not recorded before the interruption). Every recorded shard
    is checked in full (its entry against its size and header, and its checksum), then the
    manifest's totals against the entries.

    Raises:
        UserError: Another job's store (naming the differences), another part, or a
            damaged shard or edited entry or total (unless ``repair``).
    """
    notes: list[str] = []
    fresh = Manifest(identity=wanted, hooks=dict(plan.hooks), part=part)
    manifest = fresh
    if (folder / MANIFEST).exists():
        recorded = Manifest.load(folder)
        differences = identity_differences(recorded.identity, wanted)
        if recorded.shards:
            refuse_other_model(folder, recorded.identity, wanted[MODEL_KEY])
            _refuse_other_job(folder, differences, recorded.part, part)
            manifest = recorded
        elif differences or recorded.part != part:
            if recorded.part != part:
                differences.append(
                    f"part: {recorded.part[0]}/{recorded.part[1]} -> {part[0]}/{part[1]}"
                )
            note = (
                f"{folder} held the manifest of a capture that wrote no shard, with another "
                f"configuration ({'; '.join(differences)}); starting over with this one"
            )
            _LOG.warning("tl capture: %s", note)
            notes.append(note)
        else:
            manifest = recorded
    for leftover in sorted(folder.glob(".*.partial")):
        leftover.unlink()
        notes.append(f"removed {leftover.name}, left by an interrupted write")
    listed = {s.file for s in manifest.shards.values()}
    for stray in sorted(folder.glob("shard-*.safetensors")):
        if stray.name not in listed:
            stray.unlink()
            notes.append(
                f"{stray.name} was written but not recorded before an interruption; redoing it"
            )
    redone = False
    for index in sorted(manifest.shards):
        try:
            check_shard(folder, manifest.shards[index], manifest.fingerprint, checksum=True)
        except UserError as error:
            if not repair:
                raise
            del manifest.shards[index]
            (folder / shard_name(index)).unlink(missing_ok=True)
            notes.append(f"repair: redoing shard {index}: {error}")
            redone = True
    if not repair:
        manifest.check_totals(folder)
    elif manifest.edited_totals() and not redone:  # a removed shard changes them anyway
        notes.append(
            f"repair: rewrote the manifest's totals ({'; '.join(manifest.edited_totals())})"
        )
    if notes and manifest is not fresh:
        manifest.save(folder)
    return manifest, notes
