"""Splicing a sparse dictionary into a bridge's forward pass (local drivers, for now).

The dictionary replaces the activation at its site with its reconstruction; with the error
term on, the output is ``reconstruction + (x - clean reconstruction)``, so an unedited
splice leaves the model unchanged (sae-lens's semantics), and an edit of the features moves
the activation by exactly the decoder's image of the edit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tl_core._errors import ConfigError, UnsupportedFeatureError
from tl_core.sae._dictionary import SparseDictionary

__all__ = ["Splice", "splice"]


@dataclass
class Splice:
    """A dictionary spliced into a bridge; ``remove()`` takes it out.

    Attributes:
        dictionary: The dictionary.
        hook_name: The canonical site it reads and writes.
        use_error_term: Whether the error term is added back (the model's output unchanged
            until a feature is edited).
    """

    dictionary: SparseDictionary
    hook_name: str
    use_error_term: bool
    _handles: list[Any]

    def remove(self) -> None:
        """Take the dictionary out of the forward pass."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _replacement(dictionary: SparseDictionary, use_error_term: bool) -> Any:
    def hook(x: torch.Tensor, *, hook: Any) -> torch.Tensor:
        flat = x.flatten(-2) if dictionary.flatten_heads else x
        recon = dictionary.reconstruct(flat)
        if use_error_term:
            recon = recon + (flat.to(recon.dtype) - recon.detach())
        return recon.to(x.dtype).reshape(x.shape)

    return hook


def splice(bridge: Any, dictionary: SparseDictionary, *, hook_name: str | None = None, use_error_term: bool = False) -> Splice:
    """Splice ``dictionary`` into ``bridge`` at its site until ``Splice.remove()``.

    Args:
        bridge: A bridge over a local driver (hf, native).
        dictionary: A sparse autoencoder (transcoders are not spliced yet).
        hook_name: The site (any name the bridge resolves); default the dictionary's own.
        use_error_term: Add the error term back (see the module docstring).

    Raises:
        ConfigError: No site is named, the site's width differs from the dictionary's, or the
            dictionary is a transcoder. Checked before any forward pass.
        UnsupportedFeatureError: The bridge's driver runs in another process (vLLM).
    """
    name = hook_name or dictionary.hook_name
    if name is None:
        raise ConfigError("the dictionary names no site (its cfg has no hook_name): pass hook_name=")
    if dictionary.output_hook_name is not None or dictionary.d_out != dictionary.d_in:
        raise ConfigError("splice() takes sparse autoencoders; transcoders are not spliced yet")
    if not hasattr(bridge, "hook_dict"):
        raise UnsupportedFeatureError(f"{type(bridge).__name__} cannot splice dictionaries yet; use a local driver (hf)")
    canonical = bridge.namespace.lookup(name)
    info = bridge.cfg
    width = info.n_heads * info.d_head if dictionary.flatten_heads else info.d_model
    if canonical.endswith(("hook_z", "hook_q", "hook_k", "hook_v")) != dictionary.flatten_heads or width != dictionary.d_in:
        raise ConfigError(
            f"the dictionary reads width {dictionary.d_in}"
            f"{' (heads flattened)' if dictionary.flatten_heads else ''}, but {canonical} is "
            f"{width} wide on this model; splice it where it was trained"
        )
    handles = bridge.add_hook(canonical, _replacement(dictionary, use_error_term), is_permanent=True)
    return Splice(dictionary, canonical, use_error_term, handles)
