"""Block indices given by the user (``start_at_layer``, ``stop_at_layer``), checked once."""

from __future__ import annotations

from tl_core._errors import UserError

__all__ = ["block_index"]


def block_index(value: object, name: str, n_layers: int) -> int:
    """``value`` as a block index in ``0..n_layers``; a negative one counts back from the end.

    Args:
        value: What the user passed (``stop_at_layer=-2``, say).
        name: The argument's name, for the error.
        n_layers: The model's block count (``n_layers`` itself is the end of the last block).

    Raises:
        UserError: Not an int, or out of ``-n_layers..n_layers``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{name} must be an int, got {value!r}")
    if not -n_layers <= value <= n_layers:
        raise UserError(
            f"{name}={value} is out of range for a model with {n_layers} blocks; use an int "
            f"from {-n_layers} to {n_layers} (negatives count back from the end)"
        )
    return value + n_layers if value < 0 else value
