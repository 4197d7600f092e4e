"""Boot options to ``vllm.LLM`` arguments, and forward options to ``SamplingParams``.

Everything here is checked before an engine starts, so a bad option costs no boot.
"""

from __future__ import annotations

from typing import Any

from tl_core import ConfigError
from tl_core.driver_api import SamplingOptions
from tl_driver_vllm._families import Layout
from tl_driver_vllm._wire import RESIDENT_KEY

__all__ = [
    "WORKER_EXTENSION",
    "engine_kwargs",
    "engine_mode",
    "sampling_params",
    "with_compiled_setup",
]

WORKER_EXTENSION = "tl_driver_vllm._worker_side._worker.TLWorkerExtension"

# Options the driver must own: captures need every prompt position computed, and the
# worker extension is ours.
_FIXED: dict[str, tuple[bool, str]] = {
    "enable_prefix_caching": (
        False,
        "cached prefix positions are never recomputed, so they would have no activations",
    ),
}
_REFUSED = {
    "worker_extension_cls": "the vllm driver installs its own worker extension",
    "speculative_config": "speculative decoding runs draft tokens through the model that "
    "captures and edits cannot tell apart from accepted ones",
}


def engine_kwargs(
    model: str,
    *,
    tokenizer: str | None,
    dtype: Any,
    gpu_memory_utilization: float | None,
    max_model_len: int | None,
    max_num_batched_tokens: int | None,
    enable_batching: bool,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    vllm_kwargs: dict[str, Any],
) -> dict[str, Any]:
    """Arguments for ``vllm.LLM`` with the driver's required settings.

    Raises:
        ConfigError: A setting the driver cannot work with, or an invalid size.
    """
    for key, (fixed, why) in _FIXED.items():
        if key in vllm_kwargs and vllm_kwargs[key] != fixed:
            raise ConfigError(
                f"boot_vllm({key}={vllm_kwargs[key]!r}) is not supported: the vllm driver "
                f"sets {key}={fixed!r} because {why}. Remove the option."
            )
    for key, why in _REFUSED.items():
        if vllm_kwargs.get(key) is not None:
            raise ConfigError(f"boot_vllm({key}=...) is not supported: {why}.")
    for key, size in (
        ("tensor_parallel_size", tensor_parallel_size),
        ("pipeline_parallel_size", pipeline_parallel_size),
    ):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"{key} must be an int >= 1, got {size!r}")
    eager = vllm_kwargs.get("enforce_eager")
    if eager is not None and not isinstance(eager, bool):
        raise ConfigError(
            f"enforce_eager must be True, False or None (compiled where the driver serves "
            f"it), got {eager!r}"
        )
    if not enable_batching:
        if vllm_kwargs.get("max_num_seqs", 1) != 1:
            raise ConfigError(
                f"enable_batching=False runs one request at a time (max_num_seqs=1), which "
                f"contradicts max_num_seqs={vllm_kwargs['max_num_seqs']!r}; drop one of them"
            )
        vllm_kwargs = {**vllm_kwargs, "max_num_seqs": 1}
    out: dict[str, Any] = {
        "model": model,
        "tokenizer": tokenizer,
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        **vllm_kwargs,
        "enable_prefix_caching": False,
        # None until engine_mode() resolves it for the platform.
        "enforce_eager": eager,
        "worker_extension_cls": WORKER_EXTENSION,
    }
    if dtype is not None:
        out["dtype"] = str(dtype).removeprefix("torch.") if not isinstance(dtype, str) else dtype
    sizes: tuple[tuple[str, float | None], ...] = (
        ("gpu_memory_utilization", gpu_memory_utilization),
        ("max_model_len", max_model_len),
        ("max_num_batched_tokens", max_num_batched_tokens),
    )
    for key, value in sizes:
        if value is not None:
            out[key] = value
    return out


def engine_mode(kwargs: dict[str, Any], platform: Any = None) -> tuple[dict[str, Any], str | None]:
    """``kwargs`` with ``enforce_eager`` decided, and a note to log when the default was eager.

    Unset (``None``), the engine is compiled where the driver serves compiled mode (vLLM's
    CPU build) and eager elsewhere. Compiled mode on a GPU is refused: a run with hooks
    executes the model's eager forward inside the compiled engine, but vLLM's GPU runner
    would replay captured CUDA graphs for some steps, which run no Python at all, so
    captures and edits would silently miss those steps.

    Args:
        kwargs: ``engine_kwargs``'s result.
        platform: vLLM's ``current_platform`` (read from vLLM when ``None``).

    Raises:
        ConfigError: ``enforce_eager=False`` on a platform other than the CPU.
    """
    eager = kwargs.get("enforce_eager")
    if eager is True:
        return kwargs, None
    if platform is None:
        from vllm.platforms import current_platform

        platform = current_platform
    name = type(platform).__name__
    if platform.is_cpu():
        return {**kwargs, "enforce_eager": False}, None
    if eager is False:
        raise ConfigError(
            f"boot_vllm(enforce_eager=False) runs only on vLLM's CPU build for now: on {name} "
            "vLLM replays CUDA graphs that run no tl hook, so captures and edits would miss "
            "steps. Remove the option (the driver then runs vLLM eagerly there)."
        )
    note = (
        f"tl runs vLLM eagerly on {name} (enforce_eager=True): compiled mode with CUDA "
        "graphs is served on vLLM's CPU build only for now; see the README's 'Compilation'"
    )
    return {**kwargs, "enforce_eager": True}, note


def with_compiled_setup(kwargs: dict[str, Any], layout: Layout, d_model: int) -> dict[str, Any]:
    """``kwargs`` with the family's residual-stream layout in vLLM's ``additional_config``,
    for a compiled engine (otherwise ``kwargs``).

    The worker reads it right after vLLM loads the model, before the warm-up traces it: it
    installs the checkpoint's MLP activation (``Layout.activation``) and, on vLLM's own
    model classes, the residual-stream sites (``_worker_side._resident``). vLLM hashes it
    into its compile cache key, so no graph traced without them is reused.
    """
    if kwargs["enforce_eager"]:
        return kwargs
    extra = dict(kwargs.get("additional_config") or {})
    extra[RESIDENT_KEY] = {
        "inner": layout.inner,
        "layers": layout.layers,
        "final_norm": layout.final_norm,
        "layer_input": layout.layer_input,
        "residual_offset": layout.residual_offset,
        "residual_pair": layout.residual_pair,
        "d_model": d_model,
        "mlp": layout.mlp,
        "activation": None if layout.activation is None else list(layout.activation),
        # The Transformers backend's tensors carry a batch axis: no sites there.
        "sites": not layout.batched,
    }
    return {**kwargs, "additional_config": extra}


def sampling_params(options: SamplingOptions) -> dict[str, Any]:
    """tl's (validated) sampling options as ``SamplingParams`` fields.

    Greedy decoding unless ``do_sample`` (as on every tl driver).
    """
    if not options.do_sample:
        return {"temperature": 0.0}
    out: dict[str, Any] = {"temperature": options.temperature}
    if options.top_k is not None:
        out["top_k"] = options.top_k
    if options.top_p is not None:
        out["top_p"] = options.top_p
    if options.seed is not None:
        out["seed"] = options.seed
    return out
