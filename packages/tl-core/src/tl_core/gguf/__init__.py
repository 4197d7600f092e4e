"""GGUF checkpoints for drivers: find the file a user named (``gguf_source``) and dequantise
it once into an ordinary checkpoint folder (``dequantized_gguf``) cached under
``gguf_cache_dir()`` and keyed by the file's content (``file_sha256``), which every driver
then boots like any folder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tl_core._lazy import attach

if TYPE_CHECKING:
    from tl_core.gguf._cache import (
        CACHE_ENV as CACHE_ENV,
        GGUF_RECORD as GGUF_RECORD,
        dequantized_gguf as dequantized_gguf,
        file_sha256 as file_sha256,
        gguf_cache_dir as gguf_cache_dir,
        gguf_source as gguf_source,
        require_gguf_packages as require_gguf_packages,
    )

__getattr__, __dir__, __all__ = attach(__name__)
