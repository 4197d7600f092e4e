"""Which canonical hooks the vllm driver serves, which it can edit, and why the rest cannot fire."""

from __future__ import annotations

from dataclasses import dataclass

from tl_core import ModelInfo, canonical_hook_names
from tl_driver_vllm._families import Layout

__all__ = ["HookTable", "hook_table"]

_BLOCK_SERVED = ("hook_in", "attn.hook_out", "ln2.hook_in", "mlp.hook_out", "hook_out")
_SANDWICH_SERVED = ("ln1_post.hook_in", "ln1_post.hook_out", "ln2_post.hook_in", "ln2_post.hook_out")
_FINAL_SERVED = (
    "ln_final.hook_in",
    "ln_final.hook_scale",
    "ln_final.hook_normalized",
    "ln_final.hook_out",
    "unembed.hook_out",
)
#: Served for capture only: edits there would not reach what the engine samples from.
_READ_ONLY = frozenset({"ln_final.hook_scale", "ln_final.hook_normalized", "unembed.hook_out"})

_HEADS = (
    "vLLM computes queries, keys and values in one fused QKV projection, sharded by head "
    "across tensor-parallel ranks, and rotates them in place; the vllm driver serves no "
    "head-level sites (use the hf driver)"
)
_REASONS: dict[str, str] = {
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
_NORM_REASON = (
    "this norm runs as one fused vLLM kernel (with the residual add where the model has "
    "one); only the residual-stream sites around it are served"
)


@dataclass(frozen=True)
class HookTable:
    """What the driver can do at each canonical hook of one model.

    Attributes:
        served: Hooks the driver captures.
        editable: Served hooks that take intervention specs.
        non_fireable: Every other hook of the model's vocabulary, with the reason.
    """

    served: frozenset[str]
    editable: frozenset[str]
    non_fireable: dict[str, str]


def _suffix(name: str) -> str:
    parts = name.split(".", 2)
    return parts[2] if parts[0] == "blocks" else name


def hook_table(info: ModelInfo, layout: Layout) -> HookTable:
    """Build the hook table of a model.

    Args:
        info: The model's structure.
        layout: Where vLLM keeps its sites.

    Returns:
        The served, editable and non-fireable hooks.
    """
    served = {"embed.hook_out", *_FINAL_SERVED}
    if layout.pos_embed is not None:
        served.add("pos_embed.hook_out")
    per_block = _BLOCK_SERVED + (_SANDWICH_SERVED if layout.ln1_post is not None else ())
    served.update(f"blocks.{i}.{s}" for i in range(info.n_layers) for s in per_block)
    reasons: dict[str, str] = {}
    for name in canonical_hook_names(info, include_attn_result=True):
        if name in served:
            continue
        reasons[name] = _REASONS.get(_suffix(name), _NORM_REASON)
    editable = frozenset(served - _READ_ONLY)
    return HookTable(frozenset(served), editable, reasons)
