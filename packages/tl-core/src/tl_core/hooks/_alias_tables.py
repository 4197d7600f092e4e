"""The alias tables: what each name of another tool means in the canonical vocabulary.

Read from the tools themselves: TransformerLens's ``HookedTransformer`` components and 4.x
``TransformerBridge`` generalized components (``hook_aliases``), nnterp's
``StandardizedTransformer`` accessors, and interp-engine's published point list and hook
mapping table. ``tl_core.hooks._resolution`` does the resolving; see its docstring for the statuses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from tl_core.hooks._model_info import ModelInfo

__all__ = ["FAMILY_TABLES", "MULTI_STREAM", "HookFamily", "HookStatus", "Rule", "Target"]

HookStatus = Literal[
    "canonical", "alias", "derived", "reconstructed_read_only", "structurally_absent"
]
HookFamily = Literal["canonical", "legacy", "tl_bridge", "nnterp", "interp_engine"]


@dataclass(frozen=True)
class Target:
    """Where a name leads: a canonical template (or none) and the honest status."""

    canonical: str | None  # a template: "{i}" is the block index, "{last}" the last block
    status: HookStatus
    note: str = ""


@dataclass(frozen=True)
class Rule:
    """One accepted name template: its family, default target and per-model targets."""

    family: HookFamily
    target: Target
    # With a ModelInfo, the first target whose condition holds replaces ``target``.
    by_model: tuple[tuple[Callable[[ModelInfo], bool], Target], ...] = ()


def _alias(canonical: str, note: str = "") -> Target:
    return Target(canonical, "alias", note)


def _derived(canonical: str | None, note: str) -> Target:
    return Target(canonical, "derived", note)


def _rebuilt(canonical: str | None, note: str) -> Target:
    return Target(canonical, "reconstructed_read_only", note)


def _absent(note: str) -> Target:
    return Target(None, "structurally_absent", note)


def _sandwich(info: ModelInfo) -> bool:
    return info.sandwich_norm


def _parallel(info: ModelInfo) -> bool:
    return info.parallel_attn_mlp


def _gated(info: ModelInfo) -> bool:
    return info.gated_mlp


def _ungated(info: ModelInfo) -> bool:
    return not info.gated_mlp


def _moe(info: ModelInfo) -> bool:
    return info.n_experts is not None


def _not_moe(info: ModelInfo) -> bool:
    return info.n_experts is None


_MOE_ONLY = "Mixture of experts only."
_NO_ROUTER = "This model's MLP is dense: it has no router."


def _no_shared_expert(info: ModelInfo) -> bool:
    return info.d_shared_expert is None


_SHARED_ONLY = "Mixtures of experts with a shared expert only (Qwen2-MoE)."
_NO_SHARED = "This model's MLP has no shared expert beside the routed ones."


def _rotary(info: ModelInfo) -> bool:
    return info.positional_embedding_type == "rotary"


def _not_rotary(info: ModelInfo) -> bool:
    # Only where the scheme is established: an unknown one may well be rotary.
    return info.positional_embedding_type in ("standard", "none")


def _reads_images(info: ModelInfo) -> bool:
    return info.reads_images


def _encoder_decoder(info: ModelInfo) -> bool:
    return info.encoder_layers is not None


def _no_norm(info: ModelInfo) -> bool:
    return info.normalization_type is None and info.n_layers > 0


_FLAT = "The other tool may flatten the head axes; tl serves the per-head layout."
_PRE_LN1_COPY = (
    "TransformerLens fires this on the block input repeated over heads "
    "([b, p, n_heads, d_model]), before ln1, so attention's input can be patched as a whole. "
    "tl keeps no such copy: capture blocks.{i}.hook_in and broadcast it, use "
    "blocks.{i}.attn.hook_in for the attention input after ln1, or turn on per-head inputs "
    "(model.set_use_split_qkv_input(True)) for attn.hook_q_input/hook_k_input/hook_v_input."
)


def _contribution(sublayer: str, norm: str, family: HookFamily, what: str) -> Rule:
    """A sublayer output whose meaning changes on sandwich-norm models."""
    return Rule(
        family,
        _alias(
            f"blocks.{{i}}.{sublayer}.hook_out",
            f"{what} On sandwich-norm models (Gemma 2/3, OLMo 2) it is the output of the "
            f"post-sublayer norm, blocks.{{i}}.{norm}.hook_out; pass info= to resolve per "
            f"model.",
        ),
        ((_sandwich, _alias(f"blocks.{{i}}.{norm}.hook_out", f"{what} After the norm.")),),
    )


def _legacy(canonical: str, note: str = "") -> Rule:
    return Rule("legacy", _alias(canonical, note))


def _post_residual_norm(info: ModelInfo) -> bool:
    return info.post_residual_norm


def _resid_mid(family: HookFamily) -> Rule:
    """The residual between attention and MLP, which parallel blocks do not have."""
    return Rule(
        family,
        _alias(
            "blocks.{i}.ln2.hook_in",
            "Absent in parallel attention/MLP blocks; on post-LN blocks (BERT) the sum "
            "before the norm after attention, blocks.{i}.ln1.hook_in.",
        ),
        (
            (
                _parallel,
                _absent(
                    "Attention and MLP read the same block input in this model (parallel "
                    "block), so no residual lies between them; the MLP norm's input is "
                    "blocks.{i}.ln2.hook_in."
                ),
            ),
            (
                _post_residual_norm,
                _alias(
                    "blocks.{i}.ln1.hook_in",
                    "Post-LN block (BERT): the block input plus attention's output, before "
                    "the norm after attention (whose output, ln1.hook_out, the MLP reads).",
                ),
            ),
        ),
    )


# ModelInfo has no gated-attention flag; the architectures that have the gate are named.
_GATED_ATTENTION = ("Qwen3Next", "Qwen3_5", "Qwen3.5")


def _ungated_attention(info: ModelInfo) -> bool:
    return not info.architecture.startswith(_GATED_ATTENTION)


def _embed_norm(info: ModelInfo) -> bool:
    return info.embed_norm


_LEGACY: dict[str, Rule] = {
    "hook_embed": Rule(
        "legacy",
        _alias(
            "embed.hook_out",
            "The embedding as it enters the residual stream: on models with an embedding "
            "norm (BLOOM) that norm's output, embed_ln.hook_out; pass info= to resolve per "
            "model.",
        ),
        ((_embed_norm, _alias("embed_ln.hook_out", "After the embedding norm.")),),
    ),
    "hook_pos_embed": _legacy(
        "pos_embed.hook_out",
        "Learned positions only; on rotary models TransformerBridge serves the rotary "
        "cos/sin table under this name, which is not an activation.",
    ),
    "hook_unembed": _legacy("unembed.hook_out"),
    "blocks.{i}.hook_resid_pre": _legacy("blocks.{i}.hook_in"),
    "blocks.{i}.hook_resid_mid": _resid_mid("legacy"),
    "blocks.{i}.hook_resid_post": _legacy("blocks.{i}.hook_out"),
    "blocks.{i}.hook_attn_out": _contribution(
        "attn", "ln1_post", "legacy", "What attention adds to the residual stream."
    ),
    "blocks.{i}.hook_mlp_out": _contribution(
        "mlp", "ln2_post", "legacy", "What the MLP adds to the residual stream."
    ),
    "blocks.{i}.hook_mlp_in": Rule(
        "legacy",
        _alias(
            "blocks.{i}.ln2.hook_in",
            "TransformerLens fires hook_mlp_in on the input of ln2 (the residual after "
            "attention; the block input in a parallel block), not on the MLP module's input "
            "after ln2, which is blocks.{i}.mlp.hook_in. On post-LN blocks (BERT) it is the "
            "MLP's input, as TransformerLens 4.3 serves it there.",
        ),
        (
            (
                _post_residual_norm,
                _alias("blocks.{i}.mlp.hook_in", "Post-LN block (BERT): the MLP's input."),
            ),
        ),
    ),
    "blocks.{i}.hook_attn_in": Rule("legacy", _derived("blocks.{i}.hook_in", _PRE_LN1_COPY)),
    **{
        f"blocks.{{i}}.hook_{x}_input": Rule(
            "legacy",
            _alias(
                f"blocks.{{i}}.attn.hook_{x}_input",
                "Per-head copies of the block input; opt-in, as in HookedTransformer "
                "(model.set_use_split_qkv_input(True)).",
            ),
        )
        for x in "qkv"
    },
}

_TL_BRIDGE: dict[str, Rule] = {
    "rotary_emb.hook_in": Rule(
        "tl_bridge",
        _alias(
            "embed.hook_out",
            "The rotary module is called on the embeddings only to learn their dtype and "
            "device; its table depends on the positions alone.",
        ),
        (
            (_not_rotary, _absent("This model has no rotary embedding module.")),
            (
                _reads_images,
                _alias(
                    "blocks.0.hook_in",
                    "The rotary module reads the embeddings after the image features replace "
                    "the image tokens' rows: the stream entering block 0. It reads them only "
                    "to learn their dtype and device; its table depends on the positions "
                    "alone.",
                ),
            ),
        ),
    ),
    **{
        f"rotary_emb.hook_{x}": Rule(
            "tl_bridge",
            _alias(
                f"blocks.0.attn.hook_{x}",
                "The model's rotary table, as block 0 uses it; models whose layers rotate "
                "with different tables (Gemma 3's local and global layers) serve each "
                f"block's as blocks.<i>.attn.hook_{x}.",
            ),
        )
        for x in ("cos", "sin")
    },
    "rotary_emb.hook_out": Rule(
        "tl_bridge",
        _derived(
            "blocks.0.attn.hook_cos",
            "The (cos, sin) pair of the rotary table; capture blocks.<i>.attn.hook_cos and "
            "hook_sin.",
        ),
    ),
    "blocks.{i}.attn.hook_hidden_states": Rule(
        "tl_bridge",
        _alias("blocks.{i}.attn.hook_out", "The attention module's output."),
    ),
    "unembed.hook_in": Rule(
        "tl_bridge",
        _alias("ln_final.hook_out"),
        (
            (
                _encoder_decoder,
                _rebuilt(
                    "ln_final.hook_out",
                    "An encoder-decoder's head may rescale the final norm's output before the "
                    "unembedding (T5 multiplies it by d_model ** -0.5 where its embeddings are "
                    "tied): read ln_final.hook_out and apply the model's scale.",
                ),
            ),
            (_no_norm, _alias("blocks.{last}.hook_out", "No final norm: the last block's output.")),
        ),
    ),
    **{
        f"blocks.{{i}}.attn.{p}.hook_in": Rule("tl_bridge", _alias("blocks.{i}.attn.hook_in"))
        for p in ("q", "k", "v", "qkv")
    },
    **{
        f"blocks.{{i}}.attn.{p}.hook_out": Rule(
            "tl_bridge", _alias(f"blocks.{{i}}.attn.hook_{p}", _FLAT)
        )
        for p in "qkv"
    },
    "blocks.{i}.attn.qkv.hook_out": Rule(
        "tl_bridge",
        _derived(
            None,
            "The fused QKV projection output: attn.hook_q, hook_k and hook_v flattened and "
            "concatenated on the last axis; capture those three.",
        ),
    ),
    "blocks.{i}.attn.o.hook_in": Rule("tl_bridge", _alias("blocks.{i}.attn.hook_z", _FLAT)),
    "blocks.{i}.attn.o.hook_out": Rule("tl_bridge", _alias("blocks.{i}.attn.hook_out")),
    "blocks.{i}.attn.hook_attn_in": Rule(
        "tl_bridge", _derived("blocks.{i}.hook_in", _PRE_LN1_COPY)
    ),
    **{
        f"blocks.{{i}}.attn.hook_{x}_normed": Rule(
            "tl_bridge", _alias(f"blocks.{{i}}.attn.{x}_norm.hook_out", "QK-norm models only.")
        )
        for x in "qk"
    },
    "blocks.{i}.mlp.in.hook_in": Rule("tl_bridge", _alias("blocks.{i}.mlp.hook_in")),
    "blocks.{i}.mlp.gate.hook_in": Rule(
        "tl_bridge",
        _alias("blocks.{i}.mlp.hook_in", "Gated MLPs, and the router of a mixture of experts."),
        (
            (_moe, _alias("blocks.{i}.mlp.hook_in", "The router reads the MoE block's input.")),
            (_ungated, _absent("This model's MLP has no gate projection.")),
        ),
    ),
    "blocks.{i}.mlp.in.hook_out": Rule(
        "tl_bridge",
        _alias(
            "blocks.{i}.mlp.hook_pre",
            "On gated MLPs the bridge's `in` is the linear (up) branch, "
            "blocks.{i}.mlp.hook_pre_linear; pass info= to resolve per model.",
        ),
        ((_gated, _alias("blocks.{i}.mlp.hook_pre_linear", "The linear (up) branch.")),),
    ),
    "blocks.{i}.mlp.gate.hook_out": Rule(
        "tl_bridge",
        _alias(
            "blocks.{i}.mlp.hook_pre",
            "Gated MLPs; on a mixture of experts the router's logits, "
            "blocks.{i}.mlp.hook_router_logits; pass info= to resolve per model.",
        ),
        (
            (_moe, _alias("blocks.{i}.mlp.hook_router_logits", "The router's logits.")),
            (_ungated, _absent("This model's MLP has no gate projection.")),
        ),
    ),
    **{
        f"blocks.{{i}}.mlp.gate.hook_expert_{x}": Rule(
            "tl_bridge", _alias(f"blocks.{{i}}.mlp.hook_expert_{x}", "Mixture of experts only.")
        )
        for x in ("weights", "indices")
    },
    # gpt-oss and Granite-MoE name the router `router` where Mixtral names it `gate`.
    "blocks.{i}.mlp.router.hook_in": Rule(
        "tl_bridge", _alias("blocks.{i}.mlp.hook_in", _MOE_ONLY), ((_not_moe, _absent(_NO_ROUTER)),)
    ),
    "blocks.{i}.mlp.router.hook_out": Rule(
        "tl_bridge",
        _alias("blocks.{i}.mlp.hook_router_logits", _MOE_ONLY),
        ((_not_moe, _absent(_NO_ROUTER)),),
    ),
    **{
        f"blocks.{{i}}.mlp.router.hook_expert_{x}": Rule(
            "tl_bridge",
            _alias(f"blocks.{{i}}.mlp.hook_expert_{x}", _MOE_ONLY),
            ((_not_moe, _absent(_NO_ROUTER)),),
        )
        for x in ("weights", "indices")
    },
    "blocks.{i}.mlp.hook_router_scores": Rule(
        "tl_bridge",
        _derived(
            "blocks.{i}.mlp.hook_expert_weights",
            "The chosen experts' weights in the router's order ([b, p, k]): gather "
            "blocks.{i}.mlp.hook_expert_weights at blocks.{i}.mlp.hook_expert_indices "
            "along the last axis.",
        ),
        ((_not_moe, _absent(_NO_ROUTER)),),
    ),
    # A shared expert (Qwen2-MoE) is a gated MLP of its own, and its gate a Linear.
    **{
        f"blocks.{{i}}.mlp.{name}": Rule(
            "tl_bridge",
            _alias(canonical, _SHARED_ONLY),
            ((_no_shared_expert, _absent(_NO_SHARED)),),
        )
        for name, canonical in {
            "shared_expert.hook_in": "blocks.{i}.mlp.hook_in",
            "shared_expert.gate.hook_in": "blocks.{i}.mlp.hook_in",
            "shared_expert.in.hook_in": "blocks.{i}.mlp.hook_in",
            "shared_expert_gate.hook_in": "blocks.{i}.mlp.hook_in",
            "experts.hook_in": "blocks.{i}.mlp.hook_in",
            "experts.hook_pre": "blocks.{i}.mlp.hook_in",
            "shared_expert.gate.hook_out": "blocks.{i}.mlp.shared_expert.hook_pre",
            "shared_expert.in.hook_out": "blocks.{i}.mlp.shared_expert.hook_pre_linear",
            "shared_expert.out.hook_in": "blocks.{i}.mlp.shared_expert.hook_post",
            "shared_expert.out.hook_out": "blocks.{i}.mlp.shared_expert.hook_out",
            "shared_expert_gate.hook_out": "blocks.{i}.mlp.shared_expert.hook_gate",
            "experts.hook_post": "blocks.{i}.mlp.experts.hook_out",
        }.items()
    },
    "blocks.{i}.mlp.out.hook_in": Rule("tl_bridge", _alias("blocks.{i}.mlp.hook_post")),
    "blocks.{i}.mlp.out.hook_out": Rule("tl_bridge", _alias("blocks.{i}.mlp.hook_out")),
}


def _nn(canonical: str, note: str = "") -> Rule:
    return Rule("nnterp", _alias(canonical, note))


_NNTERP: dict[str, Rule] = {
    "layers_input[{i}]": _nn("blocks.{i}.hook_in"),
    "layers_mid[{i}]": _resid_mid("nnterp"),
    "layers_output[{i}]": _nn("blocks.{i}.hook_out"),
    "attentions_input[{i}]": _nn("blocks.{i}.attn.hook_in"),
    "attentions_norm_output[{i}]": _nn("blocks.{i}.ln1.hook_out"),
    "attentions_premix[{i}]": _nn("blocks.{i}.attn.hook_z", _FLAT),
    "attentions_output[{i}]": _contribution(
        "attn", "ln1_post", "nnterp", "What attention adds to the residual stream."
    ),
    **{
        f"attention_{word}[{{i}}]": Rule(
            "nnterp",
            _alias(
                f"blocks.{{i}}.attn.hook_{x}",
                f"nnterp reads the {word} the attention kernel receives, after any rotary "
                f"embedding: on rotary models that is blocks.{{i}}.attn.hook_rot_{x}; pass "
                f"info= to resolve per model.",
            ),
            ((_rotary, _alias(f"blocks.{{i}}.attn.hook_rot_{x}", "After the rotary embedding.")),),
        )
        for word, x in (("queries", "q"), ("keys", "k"))
    },
    "attention_scores[{i}]": _nn("blocks.{i}.attn.hook_attn_scores"),
    "attention_probabilities[{i}]": _nn("blocks.{i}.attn.hook_pattern"),
    "attention_head_outputs[{i}]": _nn("blocks.{i}.attn.hook_z"),
    "mlps_input[{i}]": _nn("blocks.{i}.mlp.hook_in"),
    "mlps_norm_output[{i}]": _nn("blocks.{i}.ln2.hook_out"),
    "mlps_activation[{i}]": Rule(
        "nnterp",
        _derived(
            "blocks.{i}.mlp.hook_pre",
            "act_fn(blocks.{i}.mlp.hook_pre). On ungated MLPs that is blocks.{i}.mlp.hook_post; "
            "on gated ones tl has no hook there (hook_post also multiplies by hook_pre_linear). "
            "Pass info= to resolve per model.",
        ),
        ((_ungated, _alias("blocks.{i}.mlp.hook_post", "Ungated MLP: the activation.")),),
    ),
    "mlps_neurons[{i}]": _nn("blocks.{i}.mlp.hook_post"),
    "mlps_output[{i}]": _contribution(
        "mlp", "ln2_post", "nnterp", "What the MLP adds to the residual stream."
    ),
    "embeddings_input": _nn("embed.hook_in"),
    "embed_tokens.input": _nn("embed.hook_in"),
    "embeddings_output": _nn("embed.hook_out"),
    "token_embeddings": _nn("embed.hook_out"),
    "embed_tokens": _nn("embed.hook_out", "nnterp's embed_tokens is the module; its output."),
    "embed_tokens.output": _nn("embed.hook_out"),
    "ln_final.input": _nn("ln_final.hook_in"),
    "ln_final.output": _nn("ln_final.hook_out"),
    "ln_final_output": _nn("ln_final.hook_out"),
    "lm_head.input": Rule(
        "nnterp",
        _alias("ln_final.hook_out"),
        ((_no_norm, _alias("blocks.{last}.hook_out", "No final norm: the last block's output.")),),
    ),
    "lm_head.output": _nn("unembed.hook_out"),
    "lm_head_output": _nn("unembed.hook_out"),
    "logits": _nn(
        "unembed.hook_out",
        "nnterp's logits are what the model returns, after any final soft-capping (Gemma 2); "
        "unembed.hook_out is the unembedding's output before it.",
    ),
    "next_token_probs": Rule(
        "nnterp",
        _derived(
            "unembed.hook_out",
            "softmax(unembed.hook_out[:, -1]) over the vocabulary (nnterp assumes left padding).",
        ),
    ),
}


def _ie(canonical: str, note: str = "") -> Rule:
    return Rule("interp_engine", _alias(canonical, note))


MULTI_STREAM = (
    "Only hyper-connection (multi-stream residual) trunks such as DeepSeek-V4 have it; tl's "
    "vocabulary describes single-stream residual models."
)

_INTERP_ENGINE: dict[str, Rule] = {
    "embeddings": _ie("embed.hook_out"),
    "resid_pre.{i}": _ie("blocks.{i}.hook_in"),
    "attn_in.{i}": _ie("blocks.{i}.attn.hook_in"),
    **{
        f"{x}_norm_{end}.{{i}}": _ie(
            f"blocks.{{i}}.attn.{x}_norm.hook_{end}", "QK-norm models only. " + _FLAT
        )
        for x in "qk"
        for end in ("in", "out")
    },
    "value.{i}": _ie("blocks.{i}.attn.hook_v", _FLAT),
    "attn_scores.{i}": _ie("blocks.{i}.attn.hook_attn_scores"),
    "attn_probs.{i}": _ie("blocks.{i}.attn.hook_pattern"),
    "z.{i}": _ie("blocks.{i}.attn.hook_z", _FLAT),
    "attn_gate.{i}": Rule(
        "interp_engine",
        _rebuilt(
            "blocks.{i}.attn.hook_in",
            "Gated-attention models (Qwen3.5): the raw gate projection, which tl does not "
            "hook. Rebuild it from blocks.{i}.attn.hook_in and the gate projection weight.",
        ),
        (
            (
                _ungated_attention,
                _absent(
                    "This model's attention has no output gate; only gated-attention models "
                    "(Qwen3-Next, Qwen3.5) have the gate projection this point reads."
                ),
            ),
        ),
    ),
    "attn_out.{i}": _ie("blocks.{i}.attn.hook_out"),
    "attn_out_post.{i}": _contribution(
        "attn", "ln1_post", "interp_engine", "What attention adds to the residual stream."
    ),
    "resid_mid.{i}": _resid_mid("interp_engine"),
    "mlp_in.{i}": _ie("blocks.{i}.mlp.hook_in"),
    "mlp_pre.{i}": _ie("blocks.{i}.mlp.hook_pre"),
    "mlp_pre_linear.{i}": _ie("blocks.{i}.mlp.hook_pre_linear", "Gated MLPs only."),
    "mlp_act.{i}": _ie("blocks.{i}.mlp.hook_post"),
    **{
        f"{x}.{{i}}": _ie(f"blocks.{{i}}.mlp.hook_{x}", "Mixture of experts only.")
        for x in ("router_logits", "expert_weights", "expert_indices")
    },
    "mlp_out.{i}": _ie("blocks.{i}.mlp.hook_out"),
    "mlp_out_post.{i}": _contribution(
        "mlp", "ln2_post", "interp_engine", "What the MLP adds to the residual stream."
    ),
    "resid_post.{i}": _ie("blocks.{i}.hook_out"),
    "final_norm": _ie("ln_final.hook_out"),
    "lm_head": _ie("unembed.hook_out"),
    **{
        f"{x}.{{i}}": Rule("interp_engine", _absent(MULTI_STREAM))
        for x in (
            "resid_streams",
            "attn_stream_collapse",
            "mlp_stream_collapse",
            "attn_stream_write",
            "attn_stream_mix",
            "mlp_stream_write",
            "mlp_stream_mix",
        )
    },
}


#: The four alias families; no template may appear in two of them.
FAMILY_TABLES: tuple[dict[str, Rule], ...] = (_LEGACY, _TL_BRIDGE, _NNTERP, _INTERP_ENGINE)
