"""The vllm driver's hook namespace: what it serves, what it can edit, and why not the rest."""

from __future__ import annotations

from tl_core import ModelInfo
from tl_core.driver_api import HookNamespace, canonical_hook_names
from tl_driver_vllm._families import Layout

__all__ = ["INPUT_SITES", "hook_namespace"]

#: Sites the driver fills from the request itself (token and position ids), not the engine.
INPUT_SITES = frozenset({"embed.hook_in", "pos_embed.hook_in"})

_BLOCK_SERVED = ("hook_in", "attn.hook_out", "ln2.hook_in", "mlp.hook_out", "hook_out")
_SANDWICH_SERVED = ("ln1_post.hook_in", "ln1_post.hook_out", "ln2_post.hook_in", "ln2_post.hook_out")
_FINAL_SERVED = (
    "ln_final.hook_in",
    "ln_final.hook_scale",
    "ln_final.hook_normalized",
    "ln_final.hook_out",
    "unembed.hook_out",
)
#: Served for capture only, with the reason.
_READ_ONLY = {
    "ln_final.hook_scale": "derived from the final norm's input after the engine ran",
    "ln_final.hook_normalized": "derived from the final norm's input after the engine ran",
    "unembed.hook_out": "vLLM samples from logits it computes at the last position only; "
    "the sequence logits are rebuilt for capture",
}

_HEADS = (
    "vLLM computes queries, keys and values in one fused QKV projection, sharded by head "
    "across tensor-parallel ranks, and rotates them in place; the vllm driver serves no "
    "head-level sites (use the hf driver)"
)
_ROTARY = (
    "vLLM's rotary kernel reads cos/sin from a cached table inside the attention layer; the "
    "table is not passed between modules, so the vllm driver serves no hook on it"
)
_REASONS: dict[str, str] = {
    "attn.hook_cos": _ROTARY,
    "attn.hook_sin": _ROTARY,
    "attn.hook_q": _HEADS,
    "attn.hook_k": _HEADS,
    "attn.hook_v": _HEADS,
    "attn.hook_rot_q": _HEADS,
    "attn.hook_rot_k": _HEADS,
    "attn.hook_z": _HEADS,
    "attn.hook_attn_scores": "fused attention kernel (PagedAttention): attention scores are "
    "never materialised",
    "attn.hook_pattern": "fused attention kernel (PagedAttention): the attention pattern is "
    "never materialised",
    "attn.hook_result": "per-head outputs are summed inside the output projection's matmul "
    "and never materialised",
    "attn.hook_in": "vLLM fuses the residual add with the pre-attention norm in one kernel; "
    "capture blocks.{i}.hook_in instead",
    "mlp.hook_in": "vLLM fuses the residual add with the pre-MLP norm in one kernel; capture "
    "blocks.{i}.ln2.hook_in instead",
    "mlp.hook_pre": "vLLM fuses the MLP's input projections and activation; neuron-level "
    "sites are sharded across tensor-parallel ranks and not served (use the hf driver)",
}
for _name in ("mlp.hook_pre_linear", "mlp.hook_post"):
    _REASONS[_name] = _REASONS["mlp.hook_pre"]
for _norm in ("q_norm", "k_norm"):
    for _site in ("hook_in", "hook_scale", "hook_normalized", "hook_out"):
        _REASONS[f"attn.{_norm}.{_site}"] = _HEADS
_NORM_REASON = (
    "this norm runs as one fused vLLM kernel (with the residual add where the model has "
    "one); only the residual-stream sites around it are served"
)


def _suffix(name: str) -> str:
    parts = name.split(".", 2)
    return parts[2] if parts[0] == "blocks" else name


def hook_namespace(info: ModelInfo, layout: Layout) -> HookNamespace:
    """The namespace of a model served by vLLM.

    Args:
        info: The model's structure.
        layout: Where vLLM keeps its sites.

    Returns:
        The served, editable and non-fireable hooks, every one with its reason.
    """
    served = {"embed.hook_out", *_FINAL_SERVED, "embed.hook_in"}
    if layout.pos_embed is not None:
        served |= {"pos_embed.hook_in", "pos_embed.hook_out"}
    per_block = _BLOCK_SERVED + (_SANDWICH_SERVED if layout.ln1_post is not None else ())
    served.update(f"blocks.{i}.{s}" for i in range(info.n_layers) for s in per_block)
    reasons: dict[str, str] = {
        name: _REASONS.get(_suffix(name), _NORM_REASON)
        for name in canonical_hook_names(info, include_attn_result=True)
        if name not in served
    }
    reasons.update(_READ_ONLY)
    editable = served - set(_READ_ONLY) - INPUT_SITES
    return HookNamespace.build(info, served, editable=editable, reasons=reasons, driver="vllm")
