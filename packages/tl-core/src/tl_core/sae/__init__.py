"""Sparse dictionaries (SAEs and transcoders) in tl: their tensors and sae-lens's inference
math (``SparseDictionary``), loaded from sae-lens's folder format or ``SAE`` objects, and
spliced into a driver's forward pass (``splice`` / ``bridge.add_sae``), where their sites
(``<hook>.hook_sae_acts_post``, ...) take captures and feature-level specs.

``evaluate_dictionary`` scores one over a corpus (CE recovered, KL, explained variance, L0,
dead features) on any driver. Driver authors find the pieces that run a dictionary inside
an engine (``Attachment``, ``DictionaryRun``) in ``tl_core.driver_api``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tl_core._lazy import attach

if TYPE_CHECKING:
    from tl_core._dictionaries._dictionary import (
        ARCHITECTURES as ARCHITECTURES,
        NORMALIZATIONS as NORMALIZATIONS,
        SparseDictionary as SparseDictionary,
    )
    from tl_core.hooks._dictionary_sites import (
        DICTIONARY_SITES as DICTIONARY_SITES,
        DictionarySite as DictionarySite,
    )
    from tl_core.sae._evaluate import (
        DictionaryEvaluation as DictionaryEvaluation,
        evaluate_dictionary as evaluate_dictionary,
    )
    from tl_core.sae._load import from_sae_lens as from_sae_lens, load_dictionary as load_dictionary
    from tl_core.sae._random import random_dictionary as random_dictionary
    from tl_core.sae._splice import (
        DEFAULT_TOP_K as DEFAULT_TOP_K,
        Splice as Splice,
        splice as splice,
    )

__getattr__, __dir__, __all__ = attach(__name__)
