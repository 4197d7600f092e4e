"""Boot options to ``vllm.LLM`` arguments, and forward options to ``SamplingParams``.

Everything here is checked before an engine starts, so a bad option costs no boot.
"""

from __future__ import annotations

import os
from typing import Any

from tl_core import ConfigError
from tl_core.driver_api import SamplingOptions
from tl_driver_vllm._families import Layout
from tl_driver_vllm._wire import RESIDENT_KEY

__all__ = [
    "RUNNER_SWITCH",
    "WORKER_EXTENSION",
    "engine_kwargs",
    "engine_mode",
    "piecewise_cudagraphs",
    "require_v1_runner",
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

    Unset (``None``), the engine is compiled on vLLM's CPU build and eager elsewhere.
    ``enforce_eager=False`` on CUDA or ROCm boots vLLM compiled with piecewise CUDA graphs
    only (``piecewise_cudagraphs``): full CUDA graphs replay a whole step without running
    the op that hands residual-stream values to tl's captures, and a run on the eager
    forward must not be replaced by a replayed graph. That mode is not yet the GPU default
    because no GPU run has checked it (``scripts/gpu_check_vllm.py``'s ``compiled`` stage
    does).

    Args:
        kwargs: ``engine_kwargs``'s result.
        platform: vLLM's ``current_platform`` (read from vLLM when ``None``).

    Raises:
        ConfigError: ``enforce_eager=False`` on a platform without a compiled mode for the
            driver, or with a ``compilation_config`` that asks for full CUDA graphs.
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
        if not platform.is_cuda_alike():
            raise ConfigError(
                f"boot_vllm(enforce_eager=False) is served on vLLM's CPU build and on CUDA or "
                f"ROCm (piecewise CUDA graphs), not on {name}. Remove the option (the driver "
                "then runs vLLM eagerly there)."
            )
        config = piecewise_cudagraphs(kwargs.get("compilation_config"))
        return {**kwargs, "enforce_eager": False, "compilation_config": config}, None
    note = (
        f"tl runs vLLM eagerly on {name} (enforce_eager=True): its compiled mode with "
        "piecewise CUDA graphs (enforce_eager=False) has not been checked on a GPU yet "
        "(scripts/gpu_check_vllm.py checks it); see the README's 'Compilation'"
    )
    return {**kwargs, "enforce_eager": True}, note


#: CUDA-graph modes that capture whole steps (vLLM's ``CUDAGraphMode`` names).
_FULL_GRAPHS = frozenset({"FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"})


def piecewise_cudagraphs(config: Any) -> dict[str, Any]:
    """A ``compilation_config`` for a compiled tl engine on a GPU: the user's, with
    ``cudagraph_mode="PIECEWISE"`` unless it names a mode.

    Piecewise graphs are split at vLLM's splitting ops, and the worker adds tl's capture
    op (``tl_vllm::visit``) to them before the trace, so the op runs at every step;
    ``"NONE"`` (compiled, no CUDA graphs) is kept as asked.

    Raises:
        ConfigError: ``config`` is not a dict (or ``None``), or asks for full CUDA graphs.
    """
    if config is None:
        config = {}
    if not isinstance(config, dict):
        raise ConfigError(
            f"boot_vllm(compilation_config=...) must be a dict when tl's engine is compiled on a "
            f"GPU (the driver sets its cudagraph_mode), got {type(config).__name__}"
        )
    mode = config.get("cudagraph_mode")
    if mode is None:
        return {**config, "cudagraph_mode": "PIECEWISE"}
    label = str(getattr(mode, "name", mode)).upper()
    if label in _FULL_GRAPHS:
        raise ConfigError(
            f"compilation_config cudagraph_mode={label} is not supported by the vllm driver: a "
            "full CUDA graph replays a whole step without running tl's capture op, so "
            "captures would miss steps. Use 'PIECEWISE' (the driver's choice) or 'NONE'."
        )
    return config


#: vLLM's switch between its V1 and V2 model runners (an environment variable).
RUNNER_SWITCH = "VLLM_USE_V2_MODEL_RUNNER"


def require_v1_runner(environ: dict[str, str] | None = None) -> None:
    """Make vLLM pick its V1 model runner for the engines booted from now on.

    The worker reads each step's request layout from the V1 runner (``input_batch``,
    ``query_start_loc``, ``requests``); vLLM 0.32 picks its V2 runner by default where
    Triton is installed (CUDA builds), which has none of them. Unset, the switch is set to
    ``"0"`` in this process's environment (vLLM's engine and worker processes inherit it).

    Raises:
        ConfigError: The environment asks for the V2 runner.
    """
    env = os.environ if environ is None else environ
    value = env.get(RUNNER_SWITCH)
    if value is None:
        env[RUNNER_SWITCH] = "0"
    elif value.strip() not in ("0", ""):
        raise ConfigError(
            f"{RUNNER_SWITCH}={value!r} asks vLLM for its V2 model runner, but the vllm "
            "driver reads each step's batch layout from the V1 runner, which the V2 runner "
            f"does not have. Unset {RUNNER_SWITCH} (the driver sets it to 0)."
        )


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
