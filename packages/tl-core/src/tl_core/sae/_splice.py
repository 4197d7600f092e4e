"""Splicing a sparse dictionary into a bridge's forward pass, on any driver that can.

The dictionary reads its site and writes its output site (the same one for an
autoencoder). Hooks, captures and specs at the site itself see the model's own value; the
rest of the model sees the dictionary's output. With the error term on, the output is
``reconstruction + (value - clean reconstruction)``: an unedited splice leaves the model
unchanged (sae-lens's semantics), and an edit of the features moves the site by exactly the
decoder's image of the edit. Everything is checked before the model runs.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tl_core._dictionaries._dictionary import SparseDictionary
from tl_core._dictionaries._run import Attachment, DictionaryRun
from tl_core._errors import ConfigError, UnsupportedFeatureError
from tl_core.driver_api._capabilities import DictionaryDriver
from tl_core.driver_api._local import LocalDriver
from tl_core.hooks._dictionary_sites import DICTIONARY_SITES, DictionarySite
from tl_core.hooks._hook_point import HookPoint
from tl_core.hooks._namespace import HookNamespace
from tl_core.hooks._order import forward_order

__all__ = ["DEFAULT_TOP_K", "Splice", "plan_attachment", "splice"]

#: Features per token the sparse capture sites keep, unless the dictionary is a TopK one
#: (then its own ``k``) or ``top_k=`` says otherwise.
DEFAULT_TOP_K = 32


@dataclass
class Splice:
    """A dictionary spliced into a bridge; ``remove()`` takes it out.

    Attributes:
        attachment: The dictionary, its sites and settings.
    """

    attachment: Attachment
    _detach: Callable[[], None] = field(repr=False)

    @property
    def dictionary(self) -> SparseDictionary:
        """The dictionary."""
        return self.attachment.dictionary

    @property
    def hook_name(self) -> str:
        """The canonical site it reads (its sites are named under it)."""
        return self.attachment.site.hook

    @property
    def output_hook_name(self) -> str:
        """The canonical site it writes."""
        return self.attachment.site.output_hook

    @property
    def use_error_term(self) -> bool:
        """Whether the error term is added back."""
        return self.attachment.use_error_term

    def site(self, name: str) -> str:
        """The full name of one of its sites: ``splice.site("hook_sae_acts_post")``."""
        if name not in DICTIONARY_SITES:
            raise ConfigError(
                f"{name!r} is not a dictionary site; they are {', '.join(DICTIONARY_SITES)}"
            )
        return self.attachment.site.name(name)

    def remove(self) -> None:
        """Take the dictionary out of the forward pass (its sites go too)."""
        self._detach()
        self._detach = _nothing


def _nothing() -> None:
    return None


def plan_attachment(
    namespace: HookNamespace,
    dictionary: SparseDictionary,
    *,
    hook_name: str | None = None,
    output_hook_name: str | None = None,
    use_error_term: bool = False,
    top_k: int | None = None,
) -> Attachment:
    """Check a dictionary against a model's namespace and say where it goes.

    Raises:
        ConfigError: No site is named; a width differs from the site's; a transcoder without
            an output site, or with one the forward pass reaches before its input; a bad
            ``top_k``.
        HookNameError: A site the model does not serve (or not editably).
    """
    if not isinstance(dictionary, SparseDictionary):
        raise ConfigError(
            f"add_sae takes a SparseDictionary, got {type(dictionary).__name__}; load one with "
            "tl_core.sae.load_dictionary(folder) or from_sae_lens(sae)"
        )
    name = hook_name or dictionary.hook_name
    if name is None:
        raise ConfigError(
            "the dictionary names no site (its cfg has no hook_name): pass hook_name="
        )
    hook = namespace.lookup(name, edit=True)
    if dictionary.hook_head_index is not None:
        raise UnsupportedFeatureError(
            f"the dictionary was trained on head {dictionary.hook_head_index} of {hook!r} alone "
            f"(sae-lens's hook_head_index={dictionary.hook_head_index}); tl splices a dictionary "
            "over a whole site, not one head of it: run its encode/reconstruct on that head of "
            "a captured value instead"
        )
    out_name = output_hook_name or dictionary.output_hook_name
    if dictionary.is_transcoder and out_name is None:
        raise ConfigError(
            f"this dictionary is a transcoder (it reads {hook!r} and writes another site) but "
            "names no output site: pass output_hook_name=, e.g. 'blocks.0.mlp.hook_out'"
        )
    if (
        not dictionary.is_transcoder
        and out_name is not None
        and namespace.canonical(out_name) != hook
    ):
        raise ConfigError(
            f"output_hook_name={out_name!r}: a sparse autoencoder writes the site it reads "
            f"({hook!r}); only transcoders write another site"
        )
    output = hook if out_name is None else namespace.lookup(out_name, edit=True)
    if dictionary.is_transcoder and forward_order([output, hook])[0] != hook:
        raise ConfigError(
            f"a transcoder reads {hook!r} and writes {output!r}, but the forward pass reaches "
            f"{output!r} first; it must write a site after the one it reads"
        )
    _check_width(namespace, hook, dictionary.d_in, dictionary.flatten_heads, "reads")
    _check_width(namespace, output, dictionary.d_out, dictionary.flatten_heads, "writes")
    chosen = (
        top_k
        if top_k is not None
        else (dictionary.k if dictionary.architecture == "topk" else None)
    )
    chosen = min(DEFAULT_TOP_K, dictionary.d_sae) if chosen is None else chosen
    if (
        isinstance(chosen, bool)
        or not isinstance(chosen, int)
        or not 0 < chosen <= dictionary.d_sae
    ):
        raise ConfigError(
            f"top_k must be an int in 1..{dictionary.d_sae} (the dictionary's features), got {top_k!r}"
        )
    site = DictionarySite(hook, output, dictionary.d_in, dictionary.d_sae, dictionary.d_out, chosen)
    return Attachment(dictionary, site, bool(use_error_term))


def _check_width(
    namespace: HookNamespace, hook: str, width: int, flatten_heads: bool, verb: str
) -> None:
    shape = namespace.feature_shape(hook)
    if shape is None:
        raise ConfigError(
            f"a dictionary cannot read or write {hook!r}: its width is the prompt's length"
        )
    per_head = len(shape) == 2
    if per_head != flatten_heads or math.prod(shape) != width:
        flat = " with heads flattened" if flatten_heads else ""
        hint = (
            " (a per-head site needs a dictionary trained on flattened heads: sae-lens's reshape_activations='hook_z')"
            if per_head and not flatten_heads
            else ""
        )
        raise ConfigError(
            f"the dictionary {verb} width {width}{flat}, but {hook!r} has shape {shape} on this "
            f"model{hint}; attach it where it was trained"
        )


#: The keywords ``splice`` (and ``bridge.add_sae``) take besides the dictionary.
_OPTIONS = ("hook_name", "output_hook_name", "use_error_term", "top_k")


def _unknown_options(unknown: Mapping[str, Any]) -> ConfigError:
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, _OPTIONS, n=1, cutoff=0.6)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ConfigError(
        f"add_sae got unknown keywords {', '.join(hints)}; it takes the dictionary and "
        f"{', '.join(_OPTIONS)}"
    )


def splice(
    bridge: Any,
    dictionary: SparseDictionary,
    *,
    hook_name: str | None = None,
    output_hook_name: str | None = None,
    use_error_term: bool = False,
    top_k: int | None = None,
    **unknown: Any,
) -> Splice:
    """Splice ``dictionary`` into ``bridge``'s forward pass until ``Splice.remove()``.

    ``bridge.add_sae(...)`` is the same call. Its sites (``<hook>.hook_sae_acts_post`` and
    the rest of ``DICTIONARY_SITES``) then take captures, specs (``"features"`` picks the
    features an edit touches) and, on local drivers, Python hooks.

    Args:
        bridge: A bridge over a driver that can run dictionaries (hf, native, vllm).
        dictionary: A sparse autoencoder or transcoder.
        hook_name: The site it reads (any name the bridge resolves); default the
            dictionary's own ``hook_name``.
        output_hook_name: The site a transcoder writes (default the dictionary's own).
        use_error_term: Add the error term back (see the module docstring).
        top_k: Features per token that ``hook_sae_top_indices``/``_values`` keep (default:
            a TopK dictionary's ``k``, else 32).
        **unknown: Refused (a misspelled keyword), naming the nearest one.

    Raises:
        ConfigError, HookNameError: See ``plan_attachment``; an unknown keyword; all
            checked before any forward pass.
        UnsupportedFeatureError: The driver cannot run dictionaries.
    """
    if unknown:
        raise _unknown_options(unknown)
    attachment = plan_attachment(
        bridge.namespace, dictionary, hook_name=hook_name, output_hook_name=output_hook_name,
        use_error_term=use_error_term, top_k=top_k,
    )  # fmt: skip
    driver = bridge.driver
    if isinstance(driver, DictionaryDriver):
        driver.attach_dictionary(attachment)
        return Splice(attachment, lambda: driver.detach_dictionary(attachment.site.hook))
    if isinstance(driver, LocalDriver):
        return Splice(attachment, _attach_local(driver, attachment))
    raise UnsupportedFeatureError(
        f"driver {getattr(driver, 'name', type(driver).__name__)!r} cannot run dictionaries"
    )


def _attach_local(driver: LocalDriver, attachment: Attachment) -> Callable[[], None]:
    site = attachment.site
    attachment = Attachment(
        attachment.dictionary.to(driver.device), site, attachment.use_error_term
    )
    points = {name: HookPoint(name) for name in site.names}
    by_site = {short: points[site.name(short)] for short in DICTIONARY_SITES}

    def visit(short: str, value: torch.Tensor) -> torch.Tensor:
        point = by_site[short]
        return point(value) if point.has_hooks else value

    def wants_top_k() -> bool:
        return by_site["hook_sae_top_indices"].has_hooks or by_site["hook_sae_top_values"].has_hooks

    # Hooks may keep references to what they see (captures do), so nothing runs in place.
    run = DictionaryRun(attachment, visit, wants_top_k, copies=False)
    read, write = driver.hook_points[site.hook], driver.hook_points[site.output_hook]
    driver.add_dictionary_sites(site, points, run=run)
    read.replacement = run.read
    if site.output_hook != site.hook:
        write.replacement = run.write

    def detach() -> None:
        read.replacement = None
        write.replacement = None
        driver.remove_dictionary_sites(site.hook)

    return detach
