"""Test support: engine settings and structured comparisons (one failure lists every hook)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

#: Small engine settings: a 32-token step makes longer prompts span steps (chunked prefill).
#: The engine mode is the driver's default (compiled on vLLM's CPU build).
ENGINE_SIZES: dict[str, Any] = {
    "max_num_batched_tokens": 32,
    "max_num_seqs": 8,
    "max_model_len": 256,
    "kv_cache_memory_bytes": 32 * 2**20,
}
#: ``ENGINE_SIZES`` in an eager engine (about 1.5 s a boot here against 10-15 s compiled):
#: for the tests of what does not depend on the engine mode. The parity suite
#: (``test_parity.py``) checks every family in both modes.
ENGINE_OPTIONS: dict[str, Any] = {**ENGINE_SIZES, "enforce_eager": True}
#: How far a compiled engine's tensors may be from an eager engine's: 1e-5 of the tensor's
#: scale (its largest magnitude, at least 1).
COMPILED_RTOL = 1e-5


#: How many times the float32 hf driver's error (against the same checkpoint in float64) vLLM
#: may show (tl_core.certification.check_rounding): its CPU kernels (fused projections, its own
#: attention and norms) compute in other orders and forms than transformers'. Measured on the
#: 17 tiny families: up to 15x (Gemma 2's ln2.hook_scale; most hooks within 4x); a hook
#: served from the wrong site or layer is off by 10^4-10^6x.
VLLM_FACTOR = 32.0

#: Residual-stream and sublayer-output sites (``blocks.{i}.`` stripped): what
#: ``_tlv_reference`` reads; the hf driver is the reference for every other hook.
RESIDUAL_SITES = REFERENCE_SITES = (
    "hook_in", "hook_out", "attn.hook_out", "ln2.hook_in", "mlp.hook_out",
    "ln1_post.hook_in", "ln1_post.hook_out", "ln2_post.hook_in", "ln2_post.hook_out",
)  # fmt: skip


def reference_served(driver: Any) -> list[str]:
    """The served hooks ``_tlv_reference`` can read too."""
    return sorted(
        n for n in driver.supported_hook_points
        if not n.startswith("blocks.") or n.split(".", 2)[2] in REFERENCE_SITES
    )  # fmt: skip


def layer_calls(driver: Any) -> tuple[list[int], Any]:
    """Calls of decoder layer 0 in Python on the (in-process) worker, and the hook's handle.

    A hook added after boot runs in the eager forward only, never inside a compiled graph:
    an empty list after a run means the run stayed in the graph.
    """
    layout = driver._layout

    def install(worker: Any) -> Any:
        inner = worker.model_runner.get_model().get_submodule(layout.inner)
        calls: list[int] = []
        layer = getattr(inner, layout.layers)[0]
        return calls, layer.register_forward_pre_hook(lambda module, args: calls.append(1))

    [(calls, handle)] = driver._llm.collective_rpc(install)
    return calls, handle


def prompt_part(t: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """Prompt ``b``'s real positions of a padded capture (both axes of attention maps)."""
    if t.dim() == 4 and t.shape[-1] == t.shape[-2] and t.shape[1] != t.shape[2]:
        return t[b, :, :n, :n]
    return t[b, :n]


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference; equal entries (masked ``-inf`` scores too) count 0, inf on a
    shape mismatch or where only one side is infinite or NaN."""
    if a.shape != b.shape:
        return float("inf")
    if not a.numel():
        return 0.0
    a, b = a.float(), b.float()
    gap = (a - b).abs().masked_fill(a == b, 0.0)
    return float(gap.masked_fill(gap.isnan(), float("inf")).max())


def eager_ratio(compiled: torch.Tensor, eager: torch.Tensor) -> float:
    """A compiled engine's difference from an eager engine's tensor as a multiple of
    ``COMPILED_RTOL`` times the eager tensor's scale (<= 1 passes); inf on a shape mismatch."""
    finite = eager[eager.isfinite()].float()
    scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    return diff(compiled, eager) / (COMPILED_RTOL * scale)


def rounding_ratio(
    ours: torch.Tensor, theirs: torch.Tensor, exact: torch.Tensor, name: str = ""
) -> float:
    """vLLM's error against the hf driver in float64, as a multiple of the allowed
    ``VLLM_FACTOR`` x the float32 hf driver's own error (<= 1 passes); inf on a shape
    mismatch. The processor-independent band of every vLLM-vs-hf comparison."""
    from tl_core.certification import check_rounding

    if ours.shape != theirs.shape or ours.shape != exact.shape:
        return float("inf")
    return check_rounding(ours.cpu(), theirs, exact, name=name, factor=VLLM_FACTOR).ratio


def compare_modes(
    engines: Sequence[Any],
    prompts: list[list[int]],
    capture: list[str],
    intervene: Any,
    label: str = "",
) -> dict[str, float]:
    """One run on ``engines`` = (compiled vLLM, eager vLLM, float32 hf driver, float64 hf
    driver): per prompt and hook (and the logits), the compiled engine's ``rounding_ratio``
    against the hf drivers and, as ``... vs eager``, its ``eager_ratio`` to the eager engine."""
    ours, same, theirs, exact = (
        e.forward(prompts, capture=capture, intervene=intervene, max_new_tokens=0) for e in engines
    )
    assert ours.lengths == tuple(len(p) for p in prompts) == tuple(theirs.lengths)
    report: dict[str, float] = {}
    for b, n in enumerate(ours.lengths):
        for name in [*capture, "logits"]:
            got, eager, want, truth = (
                prompt_part(r.logits if name == "logits" else r.captured[name], b, n)
                for r in (ours, same, theirs, exact)
            )
            report[f"{label}p{b}:{name}"] = rounding_ratio(got, want, truth, name)
            report[f"{label}p{b}:{name} vs eager"] = eager_ratio(got, eager)
    return report


def check(report: Mapping[str, float], tol: float, what: str) -> None:
    """Fail naming every entry over ``tol``, with its difference."""
    bad = {k: v for k, v in report.items() if not v <= tol}
    assert not bad, f"{what}: {len(bad)} of {len(report)} over {tol:g}: " + ", ".join(
        f"{k}={v:.3g}" for k, v in sorted(bad.items())
    )
