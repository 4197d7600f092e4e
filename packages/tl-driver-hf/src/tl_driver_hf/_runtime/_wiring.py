"""Torch hooks that fire the canonical HookPoints on a transformers model.

Only hooks whose HookPoint has something attached are wired, and only for one forward:
``Wiring.install`` returns the torch handles and the driver removes them afterwards, so
between runs the transformers model carries nothing of ours and an unhooked forward runs
at the model's own speed. Every hook passes the value through its HookPoint and, when a
hook returned a different tensor, hands that one downstream so edits propagate. An in-place
edit reaches the model by itself where the hook saw the model's own tensor; where it saw a
value the driver recomputed (a norm's scale and normalized value), the tensor's version
counter reveals the edit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from tl_core import HookPoint
from tl_driver_hf._architecture._modules import LayerModules, ModelModules
from tl_driver_hf._runtime._arena import CaptureArena
from tl_driver_hf._runtime._attention import AttentionSite
from tl_driver_hf._runtime._flat import FLAT_SUFFIXES, FlatPoint, flat_points
from tl_driver_hf._runtime._split_inputs import install_split_inputs
from tl_driver_hf._runtime._torch_hooks import (
    ForwardBookkeeping,
    HeadView,
    _heads_hook,
    _ids_hook,
    _input_hook,
    _input_of,
    _norm_hook,
    _output_hook,
    _per_head_split_hook,
    _rotary_hook,
    _router_hook,
    _shape_hook,
    _shared_norm_mlp_hook,
    _split_hook,
    _stash_input_hook,
    _viewed_input_hook,
    _weight,
    _with_input,
)
from tl_driver_hf._weights._shapes import head_weights
from tl_driver_hf.adapters import ArchitectureAdapter

__all__ = ["ForwardBookkeeping", "Wiring"]


class Wiring:
    """Installs, for one forward, the torch hooks that active HookPoints need."""

    def __init__(
        self,
        modules: ModelModules,
        points: Mapping[str, HookPoint],
        adapter: ArchitectureAdapter,
        *,
        n_heads: int,
        n_kv_heads: int,
        d_head: int,
        parallel: bool,
        arena: CaptureArena | None = None,
    ) -> None:
        self.modules = modules
        self.arena = arena
        self.points = points
        self.adapter = adapter
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.d_head = d_head
        self.parallel = parallel
        #: Whether each head reads its own copy of the block input (see ``_split_inputs``).
        self.split_qkv_input = False

    def _point(self, name: str) -> HookPoint | None:
        return self.points.get(name)

    def _active(self, *names: str) -> bool:
        for name in names:
            point = self.points.get(name)
            if point is not None and point.has_hooks:
                return True
        return False

    def attention_sites(self) -> dict[nn.Module, AttentionSite]:
        """Each attention module's site for ``hooked_attention``."""
        sites: dict[nn.Module, AttentionSite] = {}
        qk = (
            ("hook_rot_q", "hook_rot_k")
            if self.adapter.description.rotary
            else ("hook_q", "hook_k")
        )
        # Pre-scaled queries (OPT) fire hook_q/hook_k at the projections instead.
        at_attention = self.adapter.description.rotary or not self.adapter.query_prescaled
        for i, layer in enumerate(self.modules.layers):
            p = f"blocks.{i}.attn."
            sites[layer.attn_core] = AttentionSite(
                q=self._point(p + qk[0]) if at_attention else None,
                k=self._point(p + qk[1]) if at_attention else None,
                # A site certification did not serve gets a point nothing attaches to.
                v=self._point(p + "hook_v") or HookPoint(p + "hook_v"),
                scores=self._point(p + "hook_attn_scores") or HookPoint(p + "hook_attn_scores"),
                pattern=self._point(p + "hook_pattern") or HookPoint(p + "hook_pattern"),
                z=self._point(p + "hook_z") or HookPoint(p + "hook_z"),
                softmax_fp32=self.adapter.softmax_fp32,
                arena=self.arena,
            )
        return sites

    def install(self, state: ForwardBookkeeping) -> list[RemovableHandle]:
        """Register the needed torch hooks, in forward order; returns their handles."""
        handles: list[RemovableHandle] = []
        m = self.modules
        if self._active("embed.hook_in"):
            hook = _ids_hook(self.points["embed.hook_in"], "input_ids")
            handles.append(m.embed.register_forward_pre_hook(hook, with_kwargs=True))
        if self._active("embed.hook_out"):
            # The module's own output: Gemma's scaled lookup, as it enters the residual.
            handles.append(
                m.embed.register_forward_hook(_output_hook(self.points["embed.hook_out"]))
            )
        self._install_norm("embed_ln", m.embed_norm, handles)
        if m.pos_embed is not None and self._active("pos_embed.hook_in"):
            # OPT passes position_ids by keyword (and adds its offset inside the module).
            hook = _ids_hook(self.points["pos_embed.hook_in"], "position_ids")
            handles.append(m.pos_embed.register_forward_pre_hook(hook, with_kwargs=True))
        if m.pos_embed is not None and self._active("pos_embed.hook_out"):
            handles.append(
                m.pos_embed.register_forward_hook(_output_hook(self.points["pos_embed.hook_out"]))
            )
        if m.token_type_embed is not None and self._active("token_type_embed.hook_in"):
            hook = _ids_hook(self.points["token_type_embed.hook_in"], "input_ids")
            handles.append(m.token_type_embed.register_forward_pre_hook(hook, with_kwargs=True))
        if m.token_type_embed is not None and self._active("token_type_embed.hook_out"):
            point = self.points["token_type_embed.hook_out"]
            handles.append(m.token_type_embed.register_forward_hook(_output_hook(point)))
        for i, layer in enumerate(m.layers):
            self._install_layer(i, layer, state, handles)
        if m.head_dense is not None and self._active("mlm_head.hook_in"):
            point = self.points["mlm_head.hook_in"]
            handles.append(
                m.head_dense.register_forward_pre_hook(_input_hook(point), with_kwargs=True)
            )
        if m.head_dense is not None and self._active("mlm_head.hook_out"):
            point = self.points["mlm_head.hook_out"]
            handles.append(m.head_dense.register_forward_hook(_output_hook(point)))
        self._install_norm("ln_final", m.final_norm, handles)
        if self._active("unembed.hook_out"):
            handles.append(
                m.lm_head.register_forward_hook(_output_hook(self.points["unembed.hook_out"]))
            )
        return handles

    def _install_norm(
        self,
        prefix: str,
        module: nn.Module | None,
        handles: list[RemovableHandle],
        *,
        with_input: bool = True,
        view: HeadView | None = None,
    ) -> None:
        if module is None:
            return
        if with_input and self._active(f"{prefix}.hook_in"):
            point = self.points[f"{prefix}.hook_in"]
            pre = _input_hook(point) if view is None else _viewed_input_hook(point, view)
            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        names = [f"{prefix}.hook_scale", f"{prefix}.hook_normalized", f"{prefix}.hook_out"]
        if self._active(*names):
            scale, normed, out = (self._point(n) for n in names)
            hook = _norm_hook(
                self.adapter.description.norm, scale, normed, out, view=view, arena=self.arena
            )
            handles.append(module.register_forward_hook(hook))

    def _install_layer(
        self, i: int, layer: LayerModules, state: ForwardBookkeeping, handles: list[RemovableHandle]
    ) -> None:
        b = f"blocks.{i}."
        if self._active(b + "hook_in"):
            handles.append(
                layer.layer.register_forward_pre_hook(
                    _input_hook(self.points[b + "hook_in"]), with_kwargs=True
                )
            )
        self._install_norm(b + "ln1", layer.ln1, handles)
        if self._active(b + "attn.hook_in"):
            handles.append(
                layer.attn.register_forward_pre_hook(
                    _input_hook(self.points[b + "attn.hook_in"]), with_kwargs=True
                )
            )
        if layer.mixer is not None and self._active(b + "mixer.hook_in"):
            handles.append(
                layer.mixer.register_forward_pre_hook(
                    _input_hook(self.points[b + "mixer.hook_in"]), with_kwargs=True
                )
            )
        if layer.mixer is not None and self._active(b + "mixer.hook_out"):
            handles.append(
                layer.mixer.register_forward_hook(_output_hook(self.points[b + "mixer.hook_out"]))
            )
        for suffix, latent in (
            ("attn.hook_q_latent", layer.q_latent),
            ("attn.hook_kv_latent", layer.kv_latent),
        ):
            if latent is not None and self._active(b + suffix):
                handles.append(latent.register_forward_hook(_output_hook(self.points[b + suffix])))
        if self.split_qkv_input:
            # Before hook_q/hook_k's own hooks on the projections, so they see the split values.
            inputs = {k: self._point(f"{b}attn.hook_{k}_input") for k in "qkv"}
            install_split_inputs(
                layer, inputs, self.adapter, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                d_head=self.d_head, handles=handles,
            )  # fmt: skip
        self._install_qk(b, layer, handles)
        self._install_qk_norms(b, layer, handles)
        if self.adapter.description.rotary and self._active(
            b + "attn.hook_cos", b + "attn.hook_sin"
        ):
            hook = _rotary_hook(self._point(b + "attn.hook_cos"), self._point(b + "attn.hook_sin"))
            handles.append(layer.attn.register_forward_pre_hook(hook, with_kwargs=True))
        if self._active(b + "attn.hook_result"):
            handles.append(
                layer.o.register_forward_hook(
                    self._result_hook(layer, self.points[b + "attn.hook_result"])
                )
            )
        if self._active(b + "attn.hook_out"):
            # BLOOM's attention module returns output + residual: read its projection instead.
            attn_out = layer.o if self.adapter.sublayers_add_residual else layer.attn
            handles.append(
                attn_out.register_forward_hook(_output_hook(self.points[b + "attn.hook_out"]))
            )
        self._install_norm(b + "ln1_post", layer.ln1_post, handles)
        points = self.points
        if self.adapter.flat_mlp and self._active(*(b + suffix for suffix in FLAT_SUFFIXES)):
            # OPT flattens batch and position here; its hooks see them restored.
            handles.append(
                layer.layer.register_forward_pre_hook(_shape_hook(i, state), with_kwargs=True)
            )
            self.points = flat_points(points, i, state.shapes)
        resid_mid = b + "ln2.hook_in"
        if self.adapter.description.norm_after_residual:
            # A post-LN block (BERT) normalises the sum itself: nothing else reads it.
            self._install_norm(b + "ln2", layer.ln2, handles)
        else:
            self._install_resid_mid(i, layer, state, handles)
            self._install_norm(b + "ln2", layer.ln2, handles, with_input=False)
        if self._active(b + "mlp.hook_in"):
            # An inline MLP (OPT) is no module: mlp.hook_in/hook_out sit on its projections.
            mlp_in = (
                layer.mlp_in if self.adapter.mlp_inline and layer.mlp_in is not None else layer.mlp
            )
            handles.append(
                mlp_in.register_forward_pre_hook(
                    _input_hook(self.points[b + "mlp.hook_in"]), with_kwargs=True
                )
            )
        self._install_mlp(b + "mlp.", layer, handles)
        routed = self._install_router(i, b + "mlp.", layer, state, handles)
        if self._install_shared_expert(i, b + "mlp.", layer, state, handles) or routed:
            # The router and the shared expert see flattened positions: one record of the
            # batch and position shape serves both.
            handles.append(
                layer.mlp.register_forward_pre_hook(_shape_hook(i, state), with_kwargs=True)
            )
        if self._active(b + "mlp.hook_out"):
            own_out = self.adapter.sublayers_add_residual or self.adapter.mlp_inline
            mlp_out = layer.down if own_out and layer.down is not None else layer.mlp
            point = self.points[b + "mlp.hook_out"]
            handles.append(
                mlp_out.register_forward_hook(
                    _output_hook(point, copy=self.adapter.mlp_out_inplace)
                )
            )
        self._install_norm(b + "ln2_post", layer.ln2_post, handles)
        self.points = points
        # The block's end adds an edit of resid_mid to the residual the layer holds.
        adds_resid_mid = not self.parallel and not self.adapter.description.norm_after_residual
        if self._active(b + "hook_out") or (self._active(resid_mid) and adds_resid_mid):
            handles.append(layer.layer.register_forward_hook(self._block_out_hook(i, state)))

    def _install_resid_mid(
        self, i: int, layer: LayerModules, state: ForwardBookkeeping, handles: list[RemovableHandle]
    ) -> None:
        """``ln2.hook_in`` of a block whose residual stream runs beside its sublayers."""
        resid_mid = f"blocks.{i}.ln2.hook_in"
        if self._active(resid_mid) and self.parallel and layer.ln2 is None:
            # One norm feeds both sublayers (GPT-J, Falcon-7B): the MLP gets its own copy of
            # that norm over ln2.hook_in, so an edit there reaches the MLP only.
            assert layer.ln1 is not None
            handles.append(
                layer.layer.register_forward_pre_hook(_stash_input_hook(i, state), with_kwargs=True)
            )
            hook = _shared_norm_mlp_hook(i, layer.ln1, self.points[resid_mid], state)
            handles.append(layer.mlp.register_forward_pre_hook(hook, with_kwargs=True))
        elif self._active(resid_mid) and self.parallel:
            # A parallel block's MLP norm reads the block input: an edit reaches the MLP only.
            assert layer.ln2 is not None
            handles.append(
                layer.ln2.register_forward_pre_hook(
                    _input_hook(self.points[resid_mid]), with_kwargs=True
                )
            )
        elif self._active(resid_mid):
            target = layer.ln2 if layer.ln2 is not None else layer.mlp
            handles.append(
                target.register_forward_pre_hook(self._resid_mid_hook(i, state), with_kwargs=True)
            )

    def _install_qk(self, b: str, layer: LayerModules, handles: list[RemovableHandle]) -> None:
        if not self.adapter.description.rotary and not self.adapter.query_prescaled:
            return  # hook_q / hook_k fire inside attention
        q, k = self._point(b + "attn.hook_q"), self._point(b + "attn.hook_k")
        if layer.qkv is not None and self.adapter.qkv_layout == "heads":
            if self._active(b + "attn.hook_q", b + "attn.hook_k"):
                hook = _per_head_split_hook((q, k, None), self.n_heads, self.d_head)
                handles.append(layer.qkv.register_forward_hook(hook))
            return
        if layer.qkv is not None:
            if self._active(b + "attn.hook_q", b + "attn.hook_k"):
                h, kv, dh = self.n_heads, self.n_kv_heads, self.d_head
                hook = _split_hook((q, k, None), (h * dh, kv * dh, kv * dh), (h, kv, kv), dh)
                handles.append(layer.qkv.register_forward_hook(hook))
            return
        if q is not None and q.has_hooks and layer.q is not None:
            handles.append(layer.q.register_forward_hook(_heads_hook(q, self.n_heads, self.d_head)))
        if k is not None and k.has_hooks and layer.k is not None:
            handles.append(
                layer.k.register_forward_hook(_heads_hook(k, self.n_kv_heads, self.d_head))
            )

    def _install_qk_norms(
        self, b: str, layer: LayerModules, handles: list[RemovableHandle]
    ) -> None:
        for name, module, heads in (
            ("q_norm", layer.q_norm, self.n_heads),
            ("k_norm", layer.k_norm, self.n_kv_heads),
        ):
            view = HeadView(self.adapter.qk_norm_layout, heads)
            self._install_norm(f"{b}attn.{name}", module, handles, view=view)

    def _install_shared_expert(
        self,
        i: int,
        p: str,
        layer: LayerModules,
        state: ForwardBookkeeping,
        handles: list[RemovableHandle],
    ) -> bool:
        """The routed experts' output and the shared expert's sites (Qwen2-MoE), which run
        on flattened positions: the hooks see ``[batch, pos, ...]``. Whether any is hooked
        (the caller then records the layer's shape)."""
        sites: dict[
            str, tuple[nn.Module | None, bool]
        ] = {  # suffix -> (module, fires on its input)
            "experts.hook_out": (layer.experts, False),
            "shared_expert.hook_pre": (layer.shared_gate, False),
            "shared_expert.hook_pre_linear": (layer.shared_up, False),
            "shared_expert.hook_post": (layer.shared_down, True),
            "shared_expert.hook_out": (layer.shared_expert, False),
            "shared_expert.hook_gate": (layer.shared_expert_gate, False),
        }
        active = [
            s for s, (module, _) in sites.items() if module is not None and self._active(p + s)
        ]
        for suffix in active:
            module, on_input = sites[suffix]
            assert module is not None
            point = FlatPoint(self.points[p + suffix], state.shapes, i)
            if on_input:
                handles.append(
                    module.register_forward_pre_hook(_input_hook(point), with_kwargs=True)
                )
            else:
                # The MoE block adds the shared expert into the routed output in place.
                hook = _output_hook(point, copy=suffix == "experts.hook_out")
                handles.append(module.register_forward_hook(hook))
        return bool(active)

    def _install_router(
        self,
        i: int,
        p: str,
        layer: LayerModules,
        state: ForwardBookkeeping,
        handles: list[RemovableHandle],
    ) -> bool:
        """The routing sites; whether they are hooked (the caller then records the layer's
        shape)."""
        names = [p + "hook_router_logits", p + "hook_expert_weights", p + "hook_expert_indices"]
        if layer.router is None or not self._active(*names):
            return False
        logits, weights, indices = (self._point(n) for n in names)
        hook = _router_hook(logits, weights, indices, i, state)
        handles.append(layer.router.register_forward_hook(hook))
        return True

    def _install_mlp(self, p: str, layer: LayerModules, handles: list[RemovableHandle]) -> None:
        pre, lin, post = (self._point(p + n) for n in ("hook_pre", "hook_pre_linear", "hook_post"))
        if layer.gate_up is not None:
            if self._active(p + "hook_pre", p + "hook_pre_linear"):
                size = int(_weight(layer.gate_up).shape[0]) // 2
                handles.append(
                    layer.gate_up.register_forward_hook(
                        _split_hook((pre, lin), (size, size), None, 0)
                    )
                )
        else:
            first = layer.gate if layer.gate is not None else layer.mlp_in
            if first is not None and pre is not None and pre.has_hooks:
                handles.append(first.register_forward_hook(_output_hook(pre)))
            if layer.up is not None and lin is not None and lin.has_hooks:
                handles.append(layer.up.register_forward_hook(_output_hook(lin)))
        if layer.down is not None and post is not None and post.has_hooks:
            handles.append(
                layer.down.register_forward_pre_hook(_input_hook(post), with_kwargs=True)
            )

    def _result_hook(self, layer: LayerModules, point: HookPoint) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> Any:
            w_o, b_o = head_weights(module, self.adapter.linear, self.n_heads, self.d_head)
            z = torch.unflatten(args[0], -1, (self.n_heads, self.d_head))
            result = torch.einsum("bphe,hed->bphd", z, w_o.to(z.dtype))
            seen = point(result)
            if seen is result and not point.has_backward_hooks:
                return None  # read only: keep the projection's own (matmul) output
            out = seen.sum(dim=2)
            return out if b_o is None else out + b_o

        return hook

    def _resid_mid_hook(self, i: int, state: ForwardBookkeeping) -> Callable[..., Any]:
        point = self.points[f"blocks.{i}.ln2.hook_in"]

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            x = _input_of(args, kwargs)
            out = point(x)
            if out is x:
                return None
            # The layer already holds x as its residual; the block-end hook adds the edit.
            state.resid_mid_delta[i] = out - x
            return _with_input(args, kwargs, out)

        return hook

    def _block_out_hook(self, i: int, state: ForwardBookkeeping) -> Callable[..., Any]:
        point = self.points.get(f"blocks.{i}.hook_out")

        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            x = output[0] if isinstance(output, tuple) else output
            new = x
            delta = state.resid_mid_delta.pop(i, None)
            if delta is not None:
                new = new + delta.reshape(new.shape)
            if point is not None and point.has_hooks:
                new = point(new)
            if new is x:
                return None
            return (new, *output[1:]) if isinstance(output, tuple) else new

        return hook
