"""Sparse dictionaries (SAEs and transcoders) in tl: their tensors and sae-lens's inference
math (``SparseDictionary``), loaded from sae-lens's folder format or ``SAE`` objects.

Work in progress (issue #20): ``splice`` runs a dictionary in a local driver's forward
pass; feature-level sites, transcoders and vLLM come next.
"""

from tl_core.sae._dictionary import ARCHITECTURES, NORMALIZATIONS, SparseDictionary
from tl_core.sae._load import from_sae_lens, load_dictionary
from tl_core.sae._splice import Splice, splice

__all__ = ["ARCHITECTURES", "NORMALIZATIONS", "Splice", "SparseDictionary", "from_sae_lens", "load_dictionary", "splice"]
