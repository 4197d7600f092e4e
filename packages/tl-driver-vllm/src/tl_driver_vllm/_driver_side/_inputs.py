"""Engine-specific checks of a request that run before any engine work."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tl_core import SpecError, UserError

__all__ = ["check_room", "refuse_positions"]


def refuse_positions(per_prompt: Sequence[Mapping[str, Any]]) -> None:
    """Raise if a spec has ``pos`` (engines booted with ``enable_position_interventions=False``).

    Raises:
        SpecError: Naming the hook and the prompt.
    """
    for b, mapping in enumerate(per_prompt):
        for hook, specs in mapping.items():
            if any(spec.pos is not None for spec in specs):
                raise SpecError(
                    f"intervention on {hook!r} for prompt {b}: key 'pos' is not allowed, this "
                    "engine was booted with enable_position_interventions=False; drop 'pos' "
                    "or boot with enable_position_interventions=True"
                )


def check_room(lengths: Sequence[int], max_new_tokens: int, *, limit: int) -> None:
    """Refuse prompts that, with their new tokens, do not fit the engine's ``max_model_len``.

    Raises:
        UserError: Naming the prompt and its length.
    """
    for b, length in enumerate(lengths):
        if length + max(1, max_new_tokens) > limit:
            raise UserError(
                f"prompt {b} has {length} tokens; with {max(1, max_new_tokens)} new "
                f"token(s) that exceeds the engine's max_model_len={limit}; shorten it or "
                "boot with a larger max_model_len"
            )
