"""Reference values from the plain ``transformers`` model (eager attention, one prompt at a time).

Written before the ``hf`` tl driver existed; ``test_parity.test_matches_the_hf_driver``
now also compares with that driver directly (the two references agree to ~2e-6), so this
module can be retired in favour of ``TransformerBridge.boot_transformers(folder)``. Each served hook is read (and
edited, with the specs compiled by tl-core) at the matching ``transformers`` module, with
the same conventions as the vllm driver: edits run before captures at a hook; the residual
between attention and MLP is edited in place so the residual path sees the edit; Gemma's
``embed.hook_out`` is the embedding module's output, its sqrt(d_model) scale included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from tl_core import InterventionSpec
from tl_core.architecture import model_info_from_config
from tl_core.driver_api import (
    HookNamespace,
    build_plan,
    canonical_hook_names,
    compile_specs,
)

_SITES = {
    "gemma2": (
        "pre_feedforward_layernorm",
        "post_attention_layernorm",
        "post_feedforward_layernorm",
    ),
    "gemma3_text": (
        "pre_feedforward_layernorm",
        "post_attention_layernorm",
        "post_feedforward_layernorm",
    ),
}


class Reference:
    """One tiny checkpoint loaded in ``transformers``.

    Args:
        folder: The checkpoint folder.
        dtype: The dtype to run in.
    """

    def __init__(self, folder: Any, dtype: torch.dtype = torch.float32) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(
            str(folder), attn_implementation="eager", dtype=dtype
        ).eval()
        config = self.model.config
        self.kind = config.model_type
        self.gpt2 = self.kind == "gpt2"
        self.base = self.model.transformer if self.gpt2 else self.model.model
        self.layers = self.base.h if self.gpt2 else self.base.layers
        self.norm = self.base.ln_f if self.gpt2 else self.base.norm
        self.d_model = config.hidden_size
        # LayerNorm families (GPT-2, StableLM) name their epsilon differently.
        self.layer_norm = self.gpt2 or self.kind == "stablelm"
        eps = getattr(config, "layer_norm_epsilon", None) if self.gpt2 else None
        self.eps = eps or getattr(config, "rms_norm_eps", None) or config.layer_norm_eps
        # Names resolve against this model's own structure, written out here.
        info = model_info_from_config(
            config,
            normalization_type="LN" if self.gpt2 else "RMS",
            positional_embedding_type="standard" if self.gpt2 else "rotary",
            gated_mlp=not self.gpt2,
            sandwich_norm=self.kind in _SITES,
        )
        self.namespace = HookNamespace.build(info, canonical_hook_names(info), driver="reference")

    # -- specs ---------------------------------------------------------------------------

    def resolve(
        self, intervene: Mapping[str, Any] | None, length: int
    ) -> dict[str, tuple[InterventionSpec, ...]]:
        """Canonical hooks and absolute positions for one prompt's ``intervene`` mapping."""
        if not intervene:
            return {}
        plan = build_plan(
            intervene, lengths=[length], namespace=self.namespace, allow_callables=False
        )
        return dict(plan.per_prompt[0])

    # -- running -----------------------------------------------------------------------

    @torch.no_grad()
    def run(
        self, ids: Sequence[int], capture: Sequence[str], intervene: Mapping[str, Any] | None = None
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Captures ``[len, ...]`` of one prompt and its logits ``[len, vocab]``."""
        specs = self.resolve(intervene, len(ids))
        store: dict[str, torch.Tensor] = {}
        handles = self._attach(specs, set(capture), store, len(ids))
        try:
            out = self.model(torch.tensor([list(ids)]))
        finally:
            for handle in handles:
                handle.remove()
        return {k: v[0] for k, v in store.items()}, out.logits[0]

    @torch.no_grad()
    def generate(
        self, ids: Sequence[int], n: int, intervene: Mapping[str, Any] | None = None
    ) -> list[int]:
        """Greedy tokens with the specs active at every step (full recomputation)."""
        specs = self.resolve(intervene, len(ids))
        tokens = list(ids)
        for _ in range(n):
            handles = self._attach(specs, set(), {}, len(ids))
            try:
                logits = self.model(torch.tensor([tokens])).logits[0, -1]
            finally:
                for handle in handles:
                    handle.remove()
            tokens.append(int(logits.argmax()))
        return tokens[len(ids) :]

    # -- hooks -------------------------------------------------------------------------

    def _attach(
        self,
        specs: Mapping[str, tuple[InterventionSpec, ...]],
        capture: set[str],
        store: dict[str, torch.Tensor],
        prompt_len: int,
    ) -> list[Any]:
        def visit(name: str, x: torch.Tensor) -> torch.Tensor:
            if specs.get(name):
                edit = compile_specs(
                    specs[name],
                    feature_shape=(x.shape[-1],),
                    seq_len=x.shape[1],
                    dtype=x.dtype,
                    device=x.device,
                )
                x = edit.apply(x)
            if name in capture:
                store[name] = x[:, :prompt_len].clone()
            return x

        handles = []

        def out_hook(module: torch.nn.Module, *names: str) -> None:
            def hook(mod: Any, args: Any, output: Any) -> Any:
                value = output[0] if isinstance(output, tuple) else output
                new = value
                for name in names:
                    new = visit(name, new)
                return (new, *output[1:]) if isinstance(output, tuple) else new

            handles.append(module.register_forward_hook(hook))

        def pre_hook(module: torch.nn.Module, name: str, derived: bool = False) -> None:
            def hook(mod: Any, args: Any, kwargs: Any) -> Any:
                x = args[0] if args else kwargs["hidden_states"]
                new = visit(name, x)
                if derived:
                    self._derived(new, capture, store, prompt_len)
                if args:
                    return (new, *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": new}

            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

        def in_place(module: torch.nn.Module, name: str) -> None:
            def hook(mod: Any, args: Any) -> None:
                new = visit(name, args[0])
                if new is not args[0]:
                    args[0].copy_(new)

            handles.append(module.register_forward_pre_hook(hook))

        embed = self.base.wte if self.gpt2 else self.base.embed_tokens
        if "embed.hook_in" in capture:

            def ids_in(mod: Any, args: Any) -> None:
                store["embed.hook_in"] = args[0][:, :prompt_len].clone()

            handles.append(embed.register_forward_pre_hook(ids_in))
        if "pos_embed.hook_in" in capture:
            store["pos_embed.hook_in"] = torch.arange(prompt_len)[None]
        out_hook(embed, "embed.hook_out")
        if self.gpt2:
            out_hook(self.base.wpe, "pos_embed.hook_out")
        for i, layer in enumerate(self.layers):
            p = f"blocks.{i}."
            pre_hook(layer, p + "hook_in")
            attn = layer.attn if self.gpt2 else layer.self_attn
            out_hook(attn, p + "attn.hook_out", p + "ln1_post.hook_in")
            ln2_name, ln1_post, ln2_post = _SITES.get(
                self.kind, ("post_attention_layernorm", None, None)
            )
            in_place(layer.ln_2 if self.gpt2 else getattr(layer, ln2_name), p + "ln2.hook_in")
            out_hook(layer.mlp, p + "mlp.hook_out", p + "ln2_post.hook_in")
            if ln1_post:
                out_hook(getattr(layer, ln1_post), p + "ln1_post.hook_out")
                out_hook(getattr(layer, ln2_post), p + "ln2_post.hook_out")
            out_hook(layer, p + "hook_out")
        pre_hook(self.norm, "ln_final.hook_in", derived=True)
        out_hook(self.norm, "ln_final.hook_out")
        out_hook(self.model.lm_head, "unembed.hook_out")
        return handles

    def _derived(
        self, x: torch.Tensor, capture: set[str], store: dict[str, torch.Tensor], n: int
    ) -> None:
        x = x[:, :n].float()
        if self.layer_norm:
            centred = x - x.mean(-1, keepdim=True)
            scale = (centred.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
        else:
            centred = x
            scale = (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
        if "ln_final.hook_scale" in capture:
            store["ln_final.hook_scale"] = scale
        if "ln_final.hook_normalized" in capture:
            store["ln_final.hook_normalized"] = centred / scale
