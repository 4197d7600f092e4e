"""The sites a sparse dictionary adds under the hook it is attached to (sae-lens's names).

A dictionary attached at ``blocks.3.hook_out`` adds ``blocks.3.hook_out.hook_sae_input``,
``...hook_sae_acts_pre``, ``...hook_sae_acts_post`` and so on. Only names are here (plain
data); the dictionary's math lives in ``tl_core.sae``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from tl_core._errors import HookNameError, UserError
from tl_core.hooks._vocabulary import BEFORE_BLOCKS, split_canonical

__all__ = ["DICTIONARY_SITES", "DictionarySite", "check_start", "split_dictionary_name"]

#: The sites under an attached dictionary, in the order the forward pass reaches them:
#: its input (heads flattened for ``attn.hook_z``), the encoder's pre-activations, the
#: feature activations, the ``top_k`` largest activations per token as indices and values
#: (sparse capture, read-only), the decoder's output before the input's normalisation is
#: undone (sae-lens's ``hook_sae_recons``), the error term (the site's value minus the
#: clean reconstruction) and what the site passes on.
DICTIONARY_SITES: tuple[str, ...] = (
    "hook_sae_input",
    "hook_sae_acts_pre",
    "hook_sae_acts_post",
    "hook_sae_top_indices",
    "hook_sae_top_values",
    "hook_sae_recons",
    "hook_sae_error",
    "hook_sae_output",
)
_READ_ONLY = ("hook_sae_top_indices", "hook_sae_top_values")
_MARK = ".hook_sae_"


@dataclass(frozen=True)
class DictionarySite:
    """Where one dictionary sits and how wide its sites are.

    Attributes:
        hook: The canonical site it reads (its sites are named under it).
        output_hook: The canonical site it writes: ``hook`` for a sparse autoencoder, another
            site for a transcoder.
        d_in: Width it reads (heads flattened on a per-head site).
        d_sae: Number of features.
        d_out: Width it writes.
        top_k: How many features per token ``hook_sae_top_indices``/``_values`` keep.
    """

    hook: str
    output_hook: str
    d_in: int
    d_sae: int
    d_out: int
    top_k: int

    def name(self, site: str) -> str:
        """The full name of one of ``DICTIONARY_SITES`` under this dictionary."""
        return f"{self.hook}.{site}"

    @property
    def names(self) -> tuple[str, ...]:
        """Every site it adds, in forward order."""
        return tuple(self.name(s) for s in DICTIONARY_SITES)

    @property
    def editable(self) -> tuple[str, ...]:
        """The sites specs may edit (all but the sparse top-k capture)."""
        return tuple(self.name(s) for s in DICTIONARY_SITES if s not in _READ_ONLY)

    def layout(self, site: str) -> str:
        """The tensor layout of one site: ``b p s`` (features), ``b p k`` (top-k), or
        ``b p d`` (the input's or the output's width)."""
        if site in ("hook_sae_acts_pre", "hook_sae_acts_post"):
            return "b p s"
        if site in _READ_ONLY:
            return "b p k"
        return "b p d"

    def feature_shape(self, site: str) -> tuple[int, ...]:
        """The per-position shape of one site."""
        layout = self.layout(site)
        if layout == "b p s":
            return (self.d_sae,)
        if layout == "b p k":
            return (self.top_k,)
        return (self.d_in,) if site in ("hook_sae_input",) else (self.d_out,)


def split_dictionary_name(name: str) -> tuple[str, str] | None:
    """``(the hook it sits under, the site)`` for a dictionary site name, else ``None``.

    Raises:
        HookNameError: The name has a ``.hook_sae_`` part that is not one of
            ``DICTIONARY_SITES``.
    """
    at = name.rfind(_MARK)
    if at < 0:
        return None
    base, site = name[:at], name[at + 1 :]
    if site not in DICTIONARY_SITES:
        raise HookNameError(
            f"{name!r}: {site!r} is not a dictionary site; the sites under an attached "
            f"dictionary are {', '.join(DICTIONARY_SITES)}"
        )
    return base, site


def _block_of(hook: str) -> float:
    """The block a canonical hook fires in: -1 before the blocks, ``inf`` after them."""
    split = split_canonical(hook)
    if split is None or split[1] is None:
        return -1 if hook in BEFORE_BLOCKS or split is None else math.inf
    return split[1]


def check_start(sites: Iterable[DictionarySite], start: int | None) -> None:
    """Refuse a forward from block ``start`` that runs a transcoder's output site but not
    the site it reads: its input would be missing (or another forward's).

    A forward that stops between the two is fine: what it returns does not depend on the
    site the transcoder writes.

    Raises:
        UserError: Naming the transcoder's two sites and the blocks to start at instead.
    """
    if start is None:
        return
    for site in sites:
        read, write = _block_of(site.hook), _block_of(site.output_hook)
        if read < start <= write:
            earlier = (
                "leave start_at_layer out (run from the tokens)"
                if read < 0
                else f"start at block {int(read)} or earlier"
            )
            raise UserError(
                f"start_at_layer={start} begins the forward at block {start}, after "
                f"{site.hook!r}, which the transcoder writing {site.output_hook!r} reads; "
                "the residual stream given cannot supply its input, so "
                f"{earlier}, or remove the transcoder for this forward"
            )
