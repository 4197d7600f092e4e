"""One dictionary's work inside a forward pass, the same on every driver.

A driver hands the value at the dictionary's site to ``encode_and_decode`` and, at the site
the dictionary writes (the same site for an autoencoder), the value there to ``finish``.
Both take a ``visit`` function that fires the named dictionary site (capturing it, applying
specs or Python hooks) and returns the possibly edited value: HookPoints on local drivers,
the run's edit tables and capture buffers inside vLLM's workers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tl_core._dictionaries._dictionary import Linear, SparseDictionary
from tl_core._errors import TLError
from tl_core.hooks._dictionary_sites import DictionarySite

__all__ = ["Attachment", "Decoded", "DictionaryRun", "Visit", "encode_and_decode", "finish"]

#: ``visit(site, value) -> value``: fire one of ``DICTIONARY_SITES`` (its short name) and
#: return the value the dictionary goes on with.
Visit = Callable[[str, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Attachment:
    """A dictionary attached to a model: where, and how its output is formed.

    Attributes:
        dictionary: The dictionary.
        site: Its sites' names and widths.
        use_error_term: Add back what the dictionary misses, so that an unedited splice
            leaves the model's output unchanged (sae-lens's ``use_error_term``); without
            it the reconstruction replaces the site's value.
        encoder: The engine's kernel for ``x @ W_enc + b_enc`` (default torch's).
        decoder: The engine's kernel for ``acts @ W_dec + b_dec`` (default torch's).
    """

    dictionary: SparseDictionary
    site: DictionarySite
    use_error_term: bool
    encoder: Linear = field(default=None, compare=False, repr=False)
    decoder: Linear = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Decoded:
    """What ``encode_and_decode`` hands to ``finish``.

    Attributes:
        output: The (possibly edited) reconstruction, in the dictionary's dtype.
        clean: The reconstruction without any edit, for the error term (``None`` when the
            error term is off).
    """

    output: torch.Tensor
    clean: torch.Tensor | None


def encode_and_decode(
    attachment: Attachment, x: torch.Tensor, visit: Visit, *, top_k: bool, copies: bool = False
) -> Decoded:
    """Run the dictionary on ``x`` (``[..., d_in]``, heads already flattened), firing its
    sites from ``hook_sae_input`` to ``hook_sae_recons``.

    Args:
        attachment: The dictionary and its settings.
        x: The site's value (any dtype; the dictionary computes in its own).
        visit: Fires a site and returns the value to go on with.
        top_k: Whether to compute ``hook_sae_top_indices``/``_values`` (someone reads them).
        copies: Whether ``visit`` copies what it keeps (then the stage reuses its own
            buffers in place); local drivers' hooks may keep references, so ``False``.
    """
    d = attachment.dictionary
    raw = x.to(d.dtype)
    sae_in = visit("hook_sae_input", raw)
    normed, undo = d.normalize(sae_in)
    pre = d.pre_activations(normed, attachment.encoder)
    seen_pre = visit("hook_sae_acts_pre", pre)
    acts = d.activate(seen_pre, inplace=copies)
    seen_acts = visit("hook_sae_acts_post", acts)
    if top_k:
        values, indices = seen_acts.topk(attachment.site.top_k, dim=-1)
        visit("hook_sae_top_values", values)
        visit("hook_sae_top_indices", indices)
    linear = d.decode_linear(seen_acts, attachment.decoder)
    seen_linear = visit("hook_sae_recons", linear)
    output = d.denormalize(seen_linear, undo)
    skip = d.skip(raw)
    if skip is not None:
        output = output + skip
    clean = None
    if attachment.use_error_term:
        # An in-place activation leaves seen_pre holding the activations: only identity counts.
        edited = (
            sae_in is not raw
            or seen_pre is not pre
            or seen_acts is not acts
            or seen_linear is not linear
        )
        with torch.no_grad():
            clean = (
                d.reconstruct(raw, attachment.encoder, attachment.decoder)
                if edited
                else output.detach()
            )
    return Decoded(output, clean)


def finish(
    attachment: Attachment, actual: torch.Tensor, decoded: Decoded, visit: Visit
) -> torch.Tensor:
    """What the written site passes on: the reconstruction, plus the error term ``actual -
    clean reconstruction`` when it is on (``hook_sae_error``, computed without gradient as
    sae-lens does), through ``hook_sae_output``. In the dictionary's dtype.

    Args:
        attachment: The dictionary and its settings.
        actual: The model's value at the written site, ``[..., d_out]``.
        decoded: From ``encode_and_decode`` on this forward's input.
        visit: Fires a site and returns the value to go on with.
    """
    output = decoded.output
    if decoded.clean is not None:
        with torch.no_grad():
            error = visit("hook_sae_error", actual.to(decoded.clean.dtype) - decoded.clean)
        output = output + error
    return visit("hook_sae_output", output)


class DictionaryRun:
    """One attachment at work in a driver's forwards: the driver hands ``read`` the value at
    the site the dictionary reads and ``write`` the value at the site a transcoder writes,
    and passes on what they return.

    Args:
        attachment: The dictionary and its settings.
        visit: Fires one of its sites (by short name) and returns the value to go on with.
        wants_top_k: Whether someone reads ``hook_sae_top_indices``/``_values`` now.
        copies: Whether ``visit`` copies what it keeps (see ``encode_and_decode``).
    """

    def __init__(
        self, attachment: Attachment, visit: Visit, wants_top_k: Callable[[], bool], *, copies: bool
    ) -> None:
        self.attachment = attachment
        self._visit = visit
        self._wants_top_k = wants_top_k
        self._copies = copies
        self._pending: Decoded | None = None

    def reset(self) -> None:
        """Forget a transcoder's reconstruction waiting for its output site: it belongs to
        the forward that read it (drivers call this when a forward begins and ends, so a
        forward that stopped between the two sites leaves nothing for the next one)."""
        self._pending = None

    def read(self, x: torch.Tensor) -> torch.Tensor:
        """Run the dictionary on its site's value (heads flattened where it reads them so):
        an autoencoder's output, in ``x``'s dtype and shape, replaces it; a transcoder keeps
        its reconstruction for ``write`` and leaves ``x`` as it is."""
        attachment = self.attachment
        flat = x.flatten(-2) if attachment.dictionary.flatten_heads else x
        decoded = encode_and_decode(
            attachment, flat, self._visit, top_k=self._wants_top_k(), copies=self._copies
        )
        if attachment.site.output_hook != attachment.site.hook:
            self._pending = decoded
            return x
        return finish(attachment, flat, decoded, self._visit).to(x.dtype).reshape(x.shape)

    def write(self, y: torch.Tensor) -> torch.Tensor:
        """What a transcoder's output site passes on, in ``y``'s dtype.

        Raises:
            TLError: The site it reads did not fire first in this forward.
        """
        site = self.attachment.site
        if self._pending is None:
            raise TLError(
                f"the transcoder writing {site.output_hook!r} found no input: {site.hook!r} did not fire first"
            )
        decoded, self._pending = self._pending, None
        return finish(self.attachment, y, decoded, self._visit).to(y.dtype)
