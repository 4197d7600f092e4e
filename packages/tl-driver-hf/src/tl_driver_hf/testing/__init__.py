"""Tiny randomly initialised HuggingFace checkpoints for tests and demos, built offline.

Only ``torch``, ``transformers`` and ``tokenizers`` are needed, so drivers other than
``hf`` (vLLM, inspect) and demos can use it too::

    from tl_driver_hf.testing import write_tiny_checkpoint

    folder = write_tiny_checkpoint("llama", tmp_path / "tiny-llama")
    # AutoModelForCausalLM.from_pretrained(folder), vllm.LLM(str(folder)), ...
"""

from __future__ import annotations

from tl_driver_hf.testing._checkpoint import TINY_FAMILIES, tiny_config, write_tiny_checkpoint
from tl_driver_hf.testing._default_configs import (
    TINY_SIZES,
    VLLM_TINY_SIZES,
    tiny_default_model,
    write_tiny_default_checkpoint,
)
from tl_driver_hf.testing._seq2seq import (
    SEQ2SEQ_SIZES,
    tiny_seq2seq_model,
    write_seq2seq_checkpoint,
)
from tl_driver_hf.testing._signal import (
    SIGNAL_SIZES,
    tiny_signal_model,
    write_signal_checkpoint,
)
from tl_driver_hf.testing._tokenizer import train_tiny_tokenizer

__all__ = [
    "SEQ2SEQ_SIZES",
    "SIGNAL_SIZES",
    "TINY_FAMILIES",
    "TINY_SIZES",
    "VLLM_TINY_SIZES",
    "tiny_config",
    "tiny_default_model",
    "tiny_seq2seq_model",
    "tiny_signal_model",
    "train_tiny_tokenizer",
    "write_tiny_checkpoint",
    "write_seq2seq_checkpoint",
    "write_signal_checkpoint",
    "write_tiny_default_checkpoint",
]
