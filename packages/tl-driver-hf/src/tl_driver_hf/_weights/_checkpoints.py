"""Training checkpoints of checkpointed families: Pythia ``step{N}``, stanford-crfm ``checkpoint-{N}``."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tl_core import UserError

__all__ = ["CheckpointSeries", "checkpoint_revision", "series_for"]


@dataclass(frozen=True)
class CheckpointSeries:
    """A family whose hub repositories keep training checkpoints as revisions.

    Attributes:
        name: Human-readable name.
        pattern: Regular expression matched against the hub id.
        revision_format: ``str.format`` template with ``{step}``.
        steps: Every published step, ascending.
    """

    name: str
    pattern: str
    revision_format: str
    steps: tuple[int, ...]


# Pythia: step 0, log-spaced steps 1..512, then every 1000 steps up to 143000.
_PYTHIA = CheckpointSeries(
    "Pythia",
    r"^EleutherAI/pythia-",
    "step{step}",
    (0, *(2**i for i in range(10)), *range(1000, 143_001, 1000)),
)
# stanford-crfm GPT-2 (Mistral project): denser early, every 1000 steps from 20000 to 400000.
_CRFM = CheckpointSeries(
    "stanford-crfm",
    r"^stanford-crfm/",
    "checkpoint-{step}",
    (
        *range(0, 100, 10),
        *range(100, 2000, 50),
        *range(2000, 20_000, 100),
        *range(20_000, 400_001, 1000),
    ),
)
SERIES: tuple[CheckpointSeries, ...] = (_PYTHIA, _CRFM)


def series_for(model_name: str | None) -> CheckpointSeries | None:
    """The checkpoint series of a hub id, or ``None``."""
    if not isinstance(model_name, str):
        return None
    return next((s for s in SERIES if re.search(s.pattern, model_name)), None)


def checkpoint_revision(
    model_name: str | None, checkpoint_index: int | None, checkpoint_value: int | None
) -> str:
    """The hub revision of a checkpoint, by position in the series or by step.

    Raises:
        UserError: Both or neither given, a model without checkpoints, an index out of
            range or a step that was not published (the nearest ones are named).
    """
    if (checkpoint_index is None) == (checkpoint_value is None):
        raise UserError("pass exactly one of checkpoint_index and checkpoint_value")
    series = series_for(model_name)
    if series is None:
        known = ", ".join(f"{s.name} ({s.pattern.lstrip('^')}*)" for s in SERIES)
        raise UserError(
            f"checkpoint_index/checkpoint_value only apply to checkpointed families ({known}); "
            f"{model_name!r} has no training checkpoints. Use revision=... for another hub "
            f"revision, or drop the checkpoint option."
        )
    steps = series.steps
    if checkpoint_index is not None:
        if isinstance(checkpoint_index, bool) or not isinstance(checkpoint_index, int):
            raise UserError(f"checkpoint_index must be an int, got {checkpoint_index!r}")
        if not -len(steps) <= checkpoint_index < len(steps):
            raise UserError(
                f"checkpoint_index={checkpoint_index} is out of range: {series.name} has "
                f"{len(steps)} checkpoints (indices 0..{len(steps) - 1}, or negative from the end)"
            )
        step = steps[checkpoint_index]
    else:
        step = int(checkpoint_value)  # type: ignore[arg-type]
        if step not in steps:
            near = sorted(steps, key=lambda s: abs(s - step))[:3]
            raise UserError(
                f"checkpoint_value={checkpoint_value!r} is not a published {series.name} "
                f"checkpoint; the nearest are {sorted(near)}"
            )
    return series.revision_format.format(step=step)
