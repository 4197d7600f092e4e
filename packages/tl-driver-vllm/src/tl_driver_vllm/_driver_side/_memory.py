"""A KV-cache size for the CPU build when the user gives none.

vLLM's CPU backend reads ``gpu_memory_utilization`` (default 0.9) as the fraction of the
machine's *total* memory to reserve, and refuses to boot unless that much is free: on a
machine where anything else holds memory, ``LLM(model)`` with no options fails. The KV
cache a run needs is known before boot: ``max_num_seqs`` sequences of ``max_model_len``
tokens, each token costing ``2 x layers x kv_heads x head_dim x dtype bytes``. This
module sizes it that way, capped at a share of the memory available now, and leaves
every explicit setting (and the GPU build) to vLLM.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tl_core import ConfigError, ModelInfo

__all__ = ["MEMORY_OPTIONS", "AVAILABLE_SHARE", "KVCacheChoice", "available_memory", "cpu_kv_cache"]

#: ``vllm.LLM`` arguments that size the KV cache; any of them means "the user decided".
MEMORY_OPTIONS = ("kv_cache_memory_bytes", "gpu_memory_utilization", "num_gpu_blocks_override")
#: vLLM's legacy CPU setting (GiB), read from the environment.
_ENV = "VLLM_CPU_KVCACHE_SPACE"
#: At most this share of the memory available at boot goes to the default KV cache, so
#: the weights, activations and whatever else runs on the machine keep the rest.
AVAILABLE_SHARE = 0.25
#: vLLM's CPU defaults, used when the caller does not set them (vllm 0.32
#: ``EngineArgs.get_batch_defaults`` for the ``LLM`` class, per parallel worker).
_CPU_MAX_NUM_SEQS = 256
_CPU_BLOCK_SIZE = 128
_DTYPE_BYTES = {"float32": 4, "float": 4, "float64": 8, "double": 8}


@dataclass(frozen=True)
class KVCacheChoice:
    """The default the driver picked.

    Attributes:
        kwargs: The ``vllm.LLM`` arguments with ``kv_cache_memory_bytes`` (and, when the
            model's own context does not fit, ``max_model_len=-1``) added.
        message: One log line: what was chosen, from what, and how to override it.
    """

    kwargs: dict[str, Any]
    message: str


def _gib(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{int(n)} B"


def _dtype_bytes(dtype: Any, kv_cache_dtype: Any, config_dtype: Any) -> int:
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype.startswith("fp8"):
        return 1
    name = str(dtype).removeprefix("torch.") if dtype not in (None, "auto") else None
    if name is None:
        # vLLM's "auto" keeps a half-precision checkpoint's dtype and downcasts float32
        # checkpoints to half precision, so only an explicit dtype gives 4 or 8 bytes.
        return 2 if str(config_dtype).removeprefix("torch.") != "float64" else 8
    return _DTYPE_BYTES.get(name, 2)


def available_memory() -> int:
    """Bytes available to the engine now, as vLLM's CPU worker counts them.

    vLLM's count honours a container's cgroup limit and the NUMA node the worker runs
    on; psutil's system-wide number is the fallback.
    """
    try:
        from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

        node = max(0, get_allowed_cpu_list()[0].numa_node)
        return int(get_memory_node_info(node).available_memory)
    except Exception:  # an older or newer layout of vLLM's helpers: count system-wide
        import psutil

        return int(psutil.virtual_memory().available)


def cpu_kv_cache(
    info: ModelInfo,
    kwargs: Mapping[str, Any],
    *,
    config_dtype: Any,
    available: int,
    environ: Mapping[str, str] = os.environ,
) -> KVCacheChoice | None:
    """The KV-cache size for a CPU engine booted without a memory option.

    Args:
        info: The model's sizes (layers, key/value heads, head size, context length).
        kwargs: The ``vllm.LLM`` arguments the driver built.
        config_dtype: The checkpoint's dtype (what vLLM's ``dtype="auto"`` starts from).
        available: Bytes of memory available now (see ``available_memory``).
        environ: The environment (for ``VLLM_CPU_KVCACHE_SPACE``).

    Returns:
        ``None`` when the user set a memory option (theirs wins), else the choice: room for
        ``max_num_seqs`` sequences of ``max_model_len`` tokens, capped at
        ``AVAILABLE_SHARE`` of ``available`` (vLLM then queues what does not fit). When not
        even one sequence of the model's own context fits under the cap and the user gave
        no ``max_model_len``, the cap is used with ``max_model_len=-1`` (vLLM fits the
        context to the cache).

    Raises:
        ConfigError: One sequence of the ``max_model_len`` the user asked for does not
            fit under the cap.
    """
    if any(kwargs.get(key) is not None for key in MEMORY_OPTIONS) or environ.get(_ENV, "") != "":
        return None
    tp = int(kwargs.get("tensor_parallel_size", 1))
    pp = int(kwargs.get("pipeline_parallel_size", 1))
    # Each tensor-parallel rank holds its share of the key/value heads (one at least:
    # vLLM replicates heads when there are fewer than ranks); each stage its layers.
    kv_heads = info.n_key_value_heads or info.n_heads
    per_rank_heads = max(1, kv_heads // tp)
    layers = math.ceil(info.n_layers / pp)
    width = _dtype_bytes(kwargs.get("dtype"), kwargs.get("kv_cache_dtype"), config_dtype)
    per_token = 2 * layers * per_rank_heads * info.d_head * width
    workers = tp * pp
    block = int(kwargs.get("block_size") or _CPU_BLOCK_SIZE)
    asked_len = kwargs.get("max_model_len")
    length = int(asked_len) if asked_len is not None and int(asked_len) > 0 else info.n_ctx
    blocks_per_seq = math.ceil(length / block)
    seqs = int(kwargs.get("max_num_seqs") or _CPU_MAX_NUM_SEQS * workers)
    wanted = seqs * blocks_per_seq * block * per_token
    one = blocks_per_seq * block * per_token
    cap = int(available * AVAILABLE_SHARE) // workers
    cap -= cap % (block * per_token)
    override = (
        "pass kv_cache_memory_bytes=<bytes per worker>, gpu_memory_utilization=<share of "
        f"total memory> or set {_ENV}=<GiB> to choose yourself"
    )
    out = dict(kwargs)
    where = (
        f"{_gib(per_token)} per token: K and V of {layers} layers x {per_rank_heads} heads x "
        f"{info.d_head} at {width} bytes"
    )
    if wanted <= cap:
        size = wanted
        why = f"room for max_num_seqs={seqs} sequences of max_model_len={length} tokens"
    elif one <= cap:
        size = cap
        fits = cap // one
        why = (
            f"{AVAILABLE_SHARE:.0%} of the {_gib(available)} available: {fits} of "
            f"max_num_seqs={seqs} sequences of {length} tokens fit at once, vLLM queues the rest"
        )
    elif asked_len is None:
        size = cap
        out["max_model_len"] = -1
        why = (
            f"{AVAILABLE_SHARE:.0%} of the {_gib(available)} available; the model's context of "
            f"{length} tokens needs {_gib(one)} per sequence, so vLLM shortens max_model_len "
            "to what fits"
        )
    else:
        raise ConfigError(
            f"boot_vllm(max_model_len={length}) with no memory option: one sequence of "
            f"{length} tokens needs {_gib(one)} of KV cache per worker, more than the "
            f"{AVAILABLE_SHARE:.0%} of the {_gib(available)} available memory that the "
            f"driver's CPU default takes; lower max_model_len, or {override}"
        )
    if size <= 0:
        raise ConfigError(
            f"only {_gib(available)} of memory is available, too little for a KV cache of "
            f"this model ({_gib(one)} per sequence of {length} tokens); free memory, or {override}"
        )
    out["kv_cache_memory_bytes"] = size
    message = (
        f"vllm driver, CPU build, no memory option given: KV cache of {_gib(size)} per worker "
        f"({why}; {where}); {override}"
    )
    return KVCacheChoice(out, message)
