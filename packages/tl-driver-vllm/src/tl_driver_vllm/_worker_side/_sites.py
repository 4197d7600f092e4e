"""Worker side: install, per run, the hooks at each physical site the run needs.

``install_sites`` walks the family's ``Layout`` (module paths only; no per-family code), with
the facts of its settled ``FamilyDescription`` (norm kind, parallel block, embedding scale,
routing), and
puts a hook from ``_site_hooks`` on each module some request captures or edits at. Only
the sites some request needs are hooked, and the hooks are removed when the run ends, so a
run without captures or edits runs the bare engine. Block shapes other than Llama's use the
hooks of ``_block_hooks``; on the Transformers backend every hook goes through its
``Unbatched`` adapter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from tl_core import ConfigError
from tl_core.architecture import FamilyDescription, NormKind
from tl_core.driver_api import norm_module_eps
from tl_driver_vllm._families import Layout
from tl_driver_vllm._worker_side._block_hooks import (
    CallThrough,
    ResidualInput,
    SharedNormInput,
    Unbatched,
)
from tl_driver_vllm._worker_side._patterns import AttentionFacts
from tl_driver_vllm._worker_side._run_state import NORMED, RunState
from tl_driver_vllm._worker_side._site_hooks import (
    AttentionInput,
    GateUpSplit,
    InputSite,
    NormSite,
    OutputProjection,
    OutputSite,
    QKVSplit,
    ResidualSite,
    RouterSite,
    normalized,
)

__all__ = [
    "attention_inputs",
    "install_sites",
    "normalized",
    "pattern_needs",
    "residual_site",
    "sub",
]


def sub(module: nn.Module | None, path: str | None) -> nn.Module | None:
    """The submodule at dotted ``path`` (``""``: ``module`` itself), or ``None``.

    Pipeline stages hold placeholders (``PPMissingLayer``) for other stages' modules; they
    count as absent, and so does a ``None`` path (a module the family does not have).
    """
    if module is None or path is None:
        return None
    for part in path.split(".") if path else ():
        module = getattr(module, part, None)
        if module is None:
            return None
    if type(module).__name__ == "PPMissingLayer":
        return None
    return module


def norm_eps(module: nn.Module, kind: NormKind) -> float:
    """A norm module's epsilon: its attribute, or measured where the module writes it in
    code (OLMo's LayerNorm on the Transformers backend)."""
    try:
        return norm_module_eps(module, kind, width=64)  # the module's own width where it has one
    except AttributeError as exc:
        raise ConfigError(
            f"cannot recompute the scale of norm {type(module).__name__}: {exc}"
        ) from exc


def attention_inputs(layout: Layout, layer: int) -> tuple[str, str]:
    """The hooks holding the queries and keys that layer ``layer``'s attention receives."""
    p = f"blocks.{layer}.attn."
    return (p + "hook_rot_q", p + "hook_rot_k") if layout.rotary else (p + "hook_q", p + "hook_k")


def residual_site(
    k: int, n_layers: int, layer_input: int, residual_offset: int
) -> tuple[list[str], int, int]:
    """The residual stream entering block ``k`` (``k == n_layers``: the final norm).

    Returns:
        Its hooks in forward order, the position of the hidden states among the module's
        arguments, and the position of the ``residual`` (fused add-norm families).
    """
    names = [f"blocks.{k - 1}.hook_out"] if k else []
    if k == n_layers:
        return [*names, "ln_final.hook_in"], 0, 1
    return [*names, f"blocks.{k}.hook_in"], layer_input, layer_input + residual_offset


def pattern_needs(layout: Layout, n_layers: int) -> dict[str, tuple[str, ...]]:
    """Per pattern and scores hook, the captures it is rebuilt from."""
    needs: dict[str, tuple[str, ...]] = {}
    for i in range(n_layers):
        qk = attention_inputs(layout, i)
        needs[f"blocks.{i}.attn.hook_pattern"] = qk
        needs[f"blocks.{i}.attn.hook_attn_scores"] = qk
    return needs


class _Installer:
    def __init__(
        self,
        state: RunState,
        handles: list[RemovableHandle],
        layout: Layout,
        family: FamilyDescription,
    ) -> None:
        self.state, self.handles, self.layout, self.family = state, handles, layout, family
        self.needed = state.needed()

    def add(self, module: nn.Module, hook: Any, kind: str = "forward") -> None:
        """Register ``hook`` (``"forward"``, ``"pre"`` or ``"pre_kwargs"``) on ``module``."""
        if self.layout.batched:
            hook = Unbatched(hook, kind)
        if kind == "forward":
            self.handles.append(module.register_forward_hook(hook))
        else:
            self.handles.append(
                module.register_forward_pre_hook(hook, with_kwargs=kind == "pre_kwargs")
            )

    def attention_input(self, module: nn.Module, hook: Any) -> None:
        """A pre-hook on vLLM's ``Attention`` layer, however the model calls it."""
        if self.layout.batched:
            # The Transformers backend calls Attention.forward directly (no module hooks);
            # its query/key/value arrive flat, [tokens, heads * d_head].
            self.handles.append(CallThrough(module, hook))  # type: ignore[arg-type]
        else:
            self.handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def want(self, *names: str) -> tuple[str, ...]:
        return tuple(n for n in names if n in self.needed)

    def one(self, name: str) -> str | None:
        return name if name in self.needed else None

    def output(self, module: nn.Module | None, *names: str) -> None:
        kept = self.want(*names)
        if module is not None and kept:
            self.add(module, OutputSite(self.state, kept))

    def norm(self, module: nn.Module | None, prefix: str, *, mode: Any, pair: bool, kind: NormKind,
             heads: int | None = None, flat: bool = False) -> None:  # fmt: skip
        names = [f"{prefix}.{s}" for s in ("hook_scale", "hook_normalized", "hook_out")]
        if mode is not None:
            names.append(f"{prefix}.hook_in")
        if module is None or not self.want(*names):
            return
        site = NormSite(self.state, prefix, mode=mode, pair=pair, kind=kind, eps=norm_eps(module, kind),
                        heads=heads, flat=flat)  # fmt: skip
        self.add(module, site.pre, "pre")
        self.add(module, site.post)


def install_sites(
    model: nn.Module,
    layout: Layout,
    family: FamilyDescription,
    n_layers: int,
    state: RunState,
    *,
    attention: Mapping[int, AttentionFacts],
    tp_size: int = 1,
    top_k: int | None = None,
) -> list[RemovableHandle]:
    """Hook every physical site that the run's captures and edits need.

    Args:
        model: vLLM's top-level ``*ForCausalLM`` module on this worker.
        layout: Where the family keeps its sites.
        family: The family's description, settled for the checkpoint.
        n_layers: Number of decoder layers of the whole model.
        state: The run (its ``needed()`` hooks decide which sites are hooked).
        attention: Per layer held on this worker, its attention facts (heads on this rank).
        tp_size: Tensor-parallel ranks (``hook_result`` edits are summed across them).
        top_k: Experts per token (mixture-of-experts families).

    Returns:
        Handles to remove after the run.
    """
    inner = sub(model, layout.inner)
    assert inner is not None
    layers = getattr(inner, layout.layers)
    handles: list[RemovableHandle] = []
    at = _Installer(state, handles, layout, family)
    kind = family.norm_kind

    if not family.embed_scaled:
        at.output(sub(inner, layout.embed), "embed.hook_out")
    if layout.pos_embed:
        at.output(sub(inner, layout.pos_embed), "pos_embed.hook_out")
    # BLOOM's norm on the embedding; its input is the embedding's output, edited for it only.
    at.norm(sub(inner, layout.embed_norm), "embed_ln", mode="norm", pair=False, kind=kind)
    final_norm = sub(inner, layout.final_norm)
    for k in range(n_layers + 1):
        names, index, residual_at = residual_site(
            k, n_layers, layout.layer_input, layout.residual_offset
        )
        if k == 0 and family.embed_scaled:
            # Gemma scales the embedding after its module: the embedding as it enters the
            # residual stream is block 0's input (no position embedding comes between).
            names.insert(0, "embed.hook_out")
        derived = (
            at.want("ln_final.hook_scale", "ln_final.hook_normalized") if k == n_layers else ()
        )
        kept = at.want(*names)
        target = final_norm if k == n_layers else sub(layers[k], "")
        if target is None or not (kept or derived):
            continue
        final = (kind, norm_eps(target, kind)) if k == n_layers else None
        hook = ResidualSite(state, kept, index, layout.residual_pair, final, residual_at)
        at.add(target, hook, "pre_kwargs")
    for i in range(n_layers):
        layer = sub(layers[i], "")
        if layer is not None and i in attention:
            _install_layer(at, layer, f"blocks.{i}.", layout, attention[i], tp_size, top_k)
    at.output(final_norm, "ln_final.hook_out", NORMED)
    return handles


def _install_layer(
    at: _Installer,
    layer: nn.Module,
    p: str,
    layout: Layout,
    facts: AttentionFacts,
    tp_size: int,
    top_k: int | None,
) -> None:
    state, pair, kind = at.state, layout.residual_pair, at.family.norm_kind
    ln1 = sub(layer, layout.ln1)
    at.norm(ln1, p + "ln1", mode="norm", pair=pair, kind=kind)
    attn = sub(layer, layout.attn)
    assert attn is not None
    if at.want(p + "attn.hook_in"):
        at.add(
            attn, InputSite(state, (p + "attn.hook_in",), position=layout.attn_input), "pre_kwargs"
        )
    _install_attention(at, attn, p + "attn.", layout, facts, tp_size)
    at.output(attn, p + "attn.hook_out", p + "ln1_post.hook_in")
    at.norm(sub(layer, layout.ln1_post), p + "ln1_post", mode=None, pair=False, kind=kind)
    mlp = sub(layer, layout.mlp)
    assert mlp is not None
    # An MLP whose projections sit in the layer (OPT) starts at its input projection and
    # ends at its output projection.
    mlp_in = sub(mlp, layout.fc_in) if layout.mlp_inline else mlp
    mlp_out = sub(mlp, layout.down) if layout.mlp_inline else mlp
    assert mlp_in is not None and mlp_out is not None
    _install_mlp_input(at, layer, ln1, mlp_in, p + "ln2.hook_in", layout)
    if at.want(p + "mlp.hook_in"):
        at.add(mlp_in, InputSite(state, (p + "mlp.hook_in",), 0), "pre_kwargs")
    _install_mlp(at, mlp, p + "mlp.", layout, top_k)
    at.output(mlp_out, p + "mlp.hook_out", p + "ln2_post.hook_in")
    at.norm(sub(layer, layout.ln2_post), p + "ln2_post", mode=None, pair=False, kind=kind)


def _install_mlp_input(
    at: _Installer,
    layer: nn.Module,
    ln1: nn.Module | None,
    mlp_in: nn.Module,
    name: str,
    layout: Layout,
) -> None:
    """``ln2``'s sites: the pre-MLP norm's, or ``ln2.hook_in`` where the family has none."""
    ln2 = sub(layer, layout.ln2)
    if ln2 is not None:
        # A parallel block's MLP norm reads the block input: an edit replaces its input only.
        mode = "norm" if at.family.parallel else "residual"
        kind = at.family.norm_kind
        at.norm(ln2, name.rsplit(".", 1)[0], mode=mode, pair=layout.residual_pair, kind=kind)
    elif at.want(name) and at.family.parallel:
        assert ln1 is not None, "a parallel block without ln2 shares ln1 with its MLP"
        shared = SharedNormInput(at.state, name, ln1, layout.layer_input)
        # After the residual sites' pre-hook on the layer, so it keeps the edited input.
        at.add(layer, shared.keep, "pre_kwargs")
        at.add(mlp_in, shared.mlp, "pre_kwargs")
    elif at.want(name):
        at.add(mlp_in, ResidualInput(at.state, name), "pre_kwargs")


def _install_attention(
    at: _Installer, attn: nn.Module, a: str, layout: Layout, facts: AttentionFacts, tp_size: int
) -> None:
    state = at.state
    heads, kv_heads = facts.heads, facts.kv_heads
    if layout.rotary is not None:
        names = (at.one(a + "hook_q"), at.one(a + "hook_k"))
        qkv = sub(attn, layout.qkv)
        if qkv is not None and any(names):
            site = QKVSplit(state, names, heads, kv_heads, facts.head_dim, layout.qkv_layout)
            at.add(qkv, site)
        inputs = (at.one(a + "hook_rot_q"), at.one(a + "hook_rot_k"), at.one(a + "hook_v"))
    else:
        inputs = (at.one(a + "hook_q"), at.one(a + "hook_k"), at.one(a + "hook_v"))
    flat = layout.qk_norm_layout == "flat"
    for norm, path, count in (
        ("q_norm", layout.q_norm, heads),
        ("k_norm", layout.k_norm, kv_heads),
    ):
        if path is not None:
            at.norm(sub(attn, path), a + norm, mode="norm", pair=False, kind=at.family.norm_kind,
                    heads=count, flat=flat)  # fmt: skip
    attention = sub(attn, layout.attention)
    if attention is not None and any(inputs):
        received = AttentionInput(state, inputs, heads, kv_heads)
        at.attention_input(attention, received)
    o_proj = sub(attn, layout.o_proj)
    z, result = at.one(a + "hook_z"), at.one(a + "hook_result")
    if o_proj is not None and (z or result):
        proj = OutputProjection(state, z, result, heads, tp_size)
        if z:
            at.add(o_proj, proj.pre, "pre")
        if result:
            at.add(o_proj, proj.post)


def _install_mlp(at: _Installer, mlp: nn.Module, m: str, layout: Layout, top_k: int | None) -> None:
    state = at.state
    pre, linear, post = (
        at.one(m + "hook_pre"),
        at.one(m + "hook_pre_linear"),
        at.one(m + "hook_post"),
    )
    gate_up = sub(mlp, layout.gate_up) if layout.gate_up else None
    if gate_up is not None and (pre or linear):
        at.add(gate_up, GateUpSplit(state, (pre, linear)))
    fc_in = sub(mlp, layout.fc_in) if layout.fc_in else None
    if fc_in is not None and pre:
        at.add(fc_in, OutputSite(state, (pre,)))
    down = sub(mlp, layout.down) if layout.down else None
    if down is not None and post:
        at.add(down, InputSite(state, (post,), 0), "pre_kwargs")
    router = sub(mlp, layout.router) if layout.router else None
    routing = at.want(
        m + "hook_router_logits", m + "hook_expert_weights", m + "hook_expert_indices"
    )
    if router is not None and routing:
        assert top_k is not None
        at.add(router, RouterSite(state, m[:-1], top_k, at.family.renormalize))
