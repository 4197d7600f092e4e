"""The vllm driver's hook namespace: what it serves, what it can edit, and why not the rest."""

from __future__ import annotations

import re
from collections.abc import Mapping

from tl_core import ModelInfo
from tl_core.architecture import FamilyDescription
from tl_core.driver_api import HookNamespace, canonical_hook_names
from tl_driver_vllm._families import Layout

__all__ = ["INPUT_SITES", "hook_namespace"]

#: Sites the driver fills from the request itself (token and position ids), not the engine.
INPUT_SITES = frozenset({"embed.hook_in", "pos_embed.hook_in"})

_NORM = ("hook_in", "hook_scale", "hook_normalized", "hook_out")
_FINAL_SERVED = (
    "ln_final.hook_in",
    "ln_final.hook_scale",
    "ln_final.hook_normalized",
    "ln_final.hook_out",
    "unembed.hook_out",
)

_DERIVED = (
    "derived from the norm's input (vLLM's norm kernels return only the norm's output), so "
    "an edit could not reach the forward pass; edit {alt} instead"
)
_PATTERN = (
    "vLLM's fused attention kernel never materialises it: the driver rebuilds it after the "
    "run from the queries and keys attention received, so an edit could not reach the "
    "forward pass; edit blocks.{i}.attn.hook_{q}/hook_{k} or hook_v instead"
)
_ROUTING = (
    "vLLM's fused mixture-of-experts kernel chooses and weights the experts from the router "
    "logits inside one call; the driver derives them from the logits for capture, so an "
    "edit could not re-route (use the hf driver to edit the routing)"
)
_ROTARY = (
    "vLLM's rotary kernel reads cos/sin from a cached table inside the rotary layer; the "
    "table is never passed between modules, so the vllm driver serves no hook on it "
    "(hook_rot_q/hook_rot_k hold the rotated values)"
)
_SPLIT = (
    "per-head copies of the block input exist only on local drivers (native, hf), which "
    "can run one projection per head; vLLM runs one fused QKV projection"
)
_TRANSFORMERS_ROTARY = (
    "vLLM runs {arch} on its Transformers backend, whose rotary table the vllm driver does "
    "not hook (hook_rot_q/hook_rot_k hold the rotated values)"
)
_IN_GRAPH = re.compile(r"blocks\.\d+\.hook_(in|out)|ln_final\.hook_(in|out)|unembed\.hook_out")
_EAGER_ONLY = (
    "a compiled engine traces only the residual stream and the final norm's output into its "
    "graph; a run that reads or edits this hook runs the engine's eager forward"
)
_EAGER_ONLY_ALL = (
    "this compiled engine has no tl site in its graph ({why}); a run that reads or edits "
    "any hook runs the engine's eager forward"
)
_PARTIAL = (
    "under tensor parallelism vLLM's {arch} keeps each rank's attention and MLP outputs as "
    "partial sums and all-reduces them once, after adding them to each other, so no rank "
    "holds this value; capture blocks.{{i}}.hook_out (or boot with tensor_parallel_size=1)"
)
_PARTIAL_RESULT = (
    "under tensor parallelism vLLM's {arch} all-reduces the attention output only after "
    "adding the MLP's, so an edit of the per-head results cannot be placed on one rank; "
    "served for capture (edit attn.hook_z instead, or boot with tensor_parallel_size=1)"
)
_LATENT = (
    "the vllm driver does not serve multi-head latent attention's compressed latents (it "
    "serves no such family on vLLM 0.32); the hf driver serves them"
)
_SHARED_EXPERT = (
    "vLLM's {arch} runs the shared expert, its gate and the routed experts inside one fused "
    "mixture-of-experts layer that returns only their sum (under tensor parallelism before "
    "the ranks are reduced), so the driver does not serve these sites yet; use mlp.hook_out "
    "here, or the hf driver, which serves them"
)


def _suffix(name: str) -> str:
    parts = name.split(".", 2)
    return parts[2] if parts[0] == "blocks" else name


def _block_sites(layout: Layout, family: FamilyDescription, attn_result: bool) -> list[str]:
    """Every per-block hook (``blocks.{i}.`` stripped) the driver serves on this family."""
    sites = ["hook_in"]
    if layout.ln1 is not None:
        sites += [f"ln1.{s}" for s in _NORM]
    sites.append("attn.hook_in")
    sites += ["attn.hook_q", "attn.hook_k", "attn.hook_v"]
    if family.qk_norm != "none":
        sites += [f"attn.{n}.{s}" for n in ("q_norm", "k_norm") for s in _NORM]
    if layout.rotary is not None:
        sites += ["attn.hook_rot_q", "attn.hook_rot_k"]
    sites += ["attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z"]
    if attn_result:
        sites.append("attn.hook_result")
    sites.append("attn.hook_out")
    if layout.ln1_post is not None:
        sites += [f"ln1_post.{s}" for s in _NORM]
    sites += [f"ln2.{s}" for s in _NORM] if layout.ln2 is not None else ["ln2.hook_in"]
    sites.append("mlp.hook_in")
    if family.moe:
        sites += ["mlp.hook_router_logits", "mlp.hook_expert_weights", "mlp.hook_expert_indices"]
    else:
        sites += ["mlp.hook_pre", "mlp.hook_post"]
        if family.gated:
            sites.append("mlp.hook_pre_linear")
    sites.append("mlp.hook_out")
    if layout.ln2_post is not None:
        sites += [f"ln2_post.{s}" for s in _NORM]
    sites.append("hook_out")
    return sites


def _read_only(i: int, layout: Layout, family: FamilyDescription) -> dict[str, str]:
    """Why each served-but-read-only hook of block ``i`` takes no specs."""
    p = f"blocks.{i}."
    q, k = ("rot_q", "rot_k") if layout.rotary is not None else ("q", "k")
    pattern = _PATTERN.format(i=i, q=q, k=k)
    out = {p + "attn.hook_attn_scores": pattern, p + "attn.hook_pattern": pattern}
    norms = [
        (n, f"{n}.hook_in or {n}.hook_out")
        for n, path in (("ln1", layout.ln1), ("ln2", layout.ln2))
        if path
    ]
    if layout.ln1_post is not None:
        norms += [("ln1_post", "ln1_post.hook_in or ln1_post.hook_out"),
                  ("ln2_post", "ln2_post.hook_in or ln2_post.hook_out")]  # fmt: skip
    if family.qk_norm != "none":
        norms += [
            (f"attn.{n}", f"attn.{n}.hook_in or attn.{n}.hook_out") for n in ("q_norm", "k_norm")
        ]
    for prefix, alt in norms:
        reason = _DERIVED.format(alt=f"blocks.{i}.{alt}".replace(" or ", f" or blocks.{i}."))
        out[f"{p}{prefix}.hook_scale"] = reason
        out[f"{p}{prefix}.hook_normalized"] = reason
    if family.moe:
        out[p + "mlp.hook_router_logits"] = _ROUTING
        out[p + "mlp.hook_expert_weights"] = _ROUTING
    return out


def hook_namespace(
    info: ModelInfo,
    layout: Layout,
    family: FamilyDescription,
    *,
    attn_result: bool = False,
    tp_size: int = 1,
    withheld: Mapping[str, str] | None = None,
    compiled: bool = False,
    resident: bool = False,
) -> HookNamespace:
    """The namespace of a model served by vLLM.

    Args:
        info: The model's structure.
        layout: Where vLLM keeps its sites.
        family: The family's description, settled for the checkpoint (what it lacks, and
            why, is ``FamilyDescription.absent_templates``).
        attn_result: Also serve the opt-in ``attn.hook_result``.
        tp_size: Tensor-parallel ranks (``Layout.partial_outputs`` families serve less
            under tensor parallelism).
        withheld: Hooks the layout places but certification did not prove (names, or
            templates such as ``"blocks.{i}.ln2.hook_in"``), with the reason: not served.
        compiled: The engine is compiled: every engine-side hook outside its graph is
            eager-only.
        resident: The compiled engine has the residual-stream sites in its graph
            (``_worker_side._resident``); without them every engine-side hook is eager-only.

    Returns:
        The served, editable and non-fireable hooks, every one with its reason.
    """
    served = {"embed.hook_out", *_FINAL_SERVED, "embed.hook_in"}
    if layout.pos_embed is not None:
        served |= {"pos_embed.hook_in", "pos_embed.hook_out"}
    if layout.embed_norm is not None:
        served.update(f"embed_ln.{s}" for s in _NORM)
    per_block = _block_sites(layout, family, attn_result)
    served.update(f"blocks.{i}.{s}" for i in range(info.n_layers) for s in per_block)
    read_only: dict[str, str] = {
        "ln_final.hook_scale": _DERIVED.format(alt="ln_final.hook_in or ln_final.hook_out"),
        "ln_final.hook_normalized": _DERIVED.format(alt="ln_final.hook_in or ln_final.hook_out"),
        "unembed.hook_out": "vLLM samples from logits it computes at the last position only; "
        "the sequence logits are rebuilt for capture",
    }
    if layout.embed_norm is not None:
        for site in ("hook_scale", "hook_normalized"):
            read_only[f"embed_ln.{site}"] = _DERIVED.format(
                alt="embed_ln.hook_in or embed_ln.hook_out"
            )
    for i in range(info.n_layers):
        read_only.update(_read_only(i, layout, family))
    reasons: dict[str, str] = {}
    if layout.partial_outputs and tp_size > 1:
        for i in range(info.n_layers):
            for site in ("attn.hook_out", "mlp.hook_out"):
                served.discard(f"blocks.{i}.{site}")
                reasons[f"blocks.{i}.{site}"] = _PARTIAL.format(arch=info.architecture).replace(
                    "{i}", str(i)
                )
            if attn_result:
                read_only[f"blocks.{i}.attn.hook_result"] = _PARTIAL_RESULT.format(
                    arch=info.architecture
                )
    lacks = family.absent_templates()
    for name in canonical_hook_names(
        info, include_attn_result=attn_result, include_split_qkv_input=True
    ):
        if name in served or name in reasons:
            continue
        suffix = _suffix(name)
        arch = info.architecture
        if block_template(name) in lacks:
            reasons[name] = lacks[block_template(name)]
        elif suffix in ("attn.hook_cos", "attn.hook_sin"):
            reasons[name] = _TRANSFORMERS_ROTARY.format(arch=arch) if layout.batched else _ROTARY
        elif suffix.startswith("attn.hook_") and suffix.endswith("_input"):
            reasons[name] = _SPLIT
        elif suffix.startswith(("mlp.shared_expert.", "mlp.experts.")):
            reasons[name] = _SHARED_EXPERT.format(arch=arch)
        elif suffix in ("attn.hook_q_latent", "attn.hook_kv_latent"):
            reasons[name] = _LATENT
    for name in sorted(served):
        why = _withheld_reason(name, withheld or {})
        if why is not None:
            served.discard(name)
            read_only.pop(name, None)
            reasons[name] = why
    editable = served - set(read_only) - INPUT_SITES
    editable -= {n for n in served if n.endswith("mlp.hook_expert_indices")}
    eager_only: dict[str, str] = {}
    if compiled and resident:
        eager_only = {n: _EAGER_ONLY for n in served - INPUT_SITES if not _in_graph(n)}
    elif compiled:
        why = (
            "vLLM runs it on its Transformers backend"
            if layout.batched
            else "its layers are split into pipeline stages"
        )
        eager_only = dict.fromkeys(served - INPUT_SITES, _EAGER_ONLY_ALL.format(why=why))
    return HookNamespace.build(
        info, served, editable=editable, read_only=read_only, reasons=reasons, driver="vllm",
        eager_only=eager_only,
    )  # fmt: skip


def _in_graph(name: str) -> bool:
    """Whether a compiled engine serves ``name`` inside its compiled graph."""
    return bool(_IN_GRAPH.fullmatch(name))


def block_template(name: str) -> str:
    """``"blocks.{i}.attn.hook_q"`` for ``"blocks.3.attn.hook_q"``; other names unchanged."""
    return re.sub(r"^blocks\.\d+\.", "blocks.{i}.", name)


def _withheld_reason(name: str, withheld: Mapping[str, str]) -> str | None:
    return withheld.get(name, withheld.get(block_template(name)))
