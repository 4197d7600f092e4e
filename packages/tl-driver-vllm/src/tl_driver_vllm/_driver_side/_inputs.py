"""Engine-specific checks of a request that run before any engine work."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tl_core import SpecError, UserError
from tl_core.driver_api import fits_context, most_new_tokens

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


def check_room(lengths: Sequence[int], max_new_tokens: int, *, n_ctx: int) -> None:
    """Refuse prompts that, with their new tokens, do not fit the engine's context.

    The rule is ``tl_core.driver_api.fits_context``; ``n_ctx`` is the engine's
    ``max_model_len`` less one (vLLM counts the sampled token against it).

    Raises:
        UserError: Naming the prompt and its length.
    """
    for b, length in enumerate(lengths):
        if not fits_context(length, max_new_tokens, n_ctx):
            most = most_new_tokens(length, n_ctx)
            fewer = f", lower max_new_tokens to {most}," if most else ""
            raise UserError(
                f"prompt {b} has {length} tokens; with {max(1, max_new_tokens)} new "
                f"token(s) that exceeds the engine's max_model_len={n_ctx + 1} (n_ctx={n_ctx}: "
                f"vLLM counts the sampled token too); shorten it{fewer} or boot with a larger "
                "max_model_len"
            )
