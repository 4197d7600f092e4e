"""Llama-style decoders: pre-RMSNorm, rotary, separate q/k/v, gated SiLU MLP."""

from __future__ import annotations

from tl_driver_hf.adapters._base import ArchitectureAdapter

ADAPTERS = (
    ArchitectureAdapter(
        family="llama",
        model_types=("llama",),
        architectures=("LlamaForCausalLM",),
        hub_patterns=(r"^meta-llama/", r"llama", r"^TinyLlama/", r"^HuggingFaceTB/SmolLM"),
        known_models=(
            "meta-llama/Llama-3.2-1B",
            "meta-llama/Llama-3.1-8B",
            "meta-llama/Llama-2-7b-hf",
            "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
            "HuggingFaceTB/SmolLM2-135M",
        ),
    ),
    ArchitectureAdapter(
        family="mistral",
        model_types=("mistral",),
        architectures=("MistralForCausalLM",),
        hub_patterns=(r"^mistralai/Mistral-",),
        known_models=("mistralai/Mistral-7B-v0.1", "mistralai/Mistral-7B-Instruct-v0.3"),
    ),
    ArchitectureAdapter(
        family="qwen2",
        model_types=("qwen2",),
        architectures=("Qwen2ForCausalLM",),
        hub_patterns=(r"^Qwen/Qwen2(\.5)?-",),
        known_models=("Qwen/Qwen2-0.5B", "Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-7B-Instruct"),
    ),
    ArchitectureAdapter(
        family="qwen3",
        model_types=("qwen3",),
        architectures=("Qwen3ForCausalLM",),
        # q_norm/k_norm sit between hook_q/hook_k (projection outputs) and hook_rot_q/k.
        q_norm="q_norm",
        k_norm="k_norm",
        hub_patterns=(r"^Qwen/Qwen3-",),
        known_models=("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B", "Qwen/Qwen3-8B"),
    ),
)
