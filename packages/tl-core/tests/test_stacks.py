"""Encoder-decoder names: one stack prefix per stack, resolved with that stack's facts."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, strategies as st

from tl_core._errors import DriverContractError, HookNameError
from tl_core.hooks._model_info import ModelInfo
from tl_core.hooks._namespace import HookNamespace
from tl_core.hooks._order import forward_order
from tl_core.hooks._resolution import resolve_hook_name
from tl_core.hooks._vocabulary import canonical_hook_names, split_canonical, stack_of

T5 = ModelInfo(
    n_layers=2,
    d_model=16,
    n_heads=2,
    d_head=8,
    d_mlp=32,
    d_vocab=50,
    n_ctx=32,
    normalization_type="RMS",
    positional_embedding_type="none",
    encoder_layers=3,
    cross_attention=True,
    architecture="T5ForConditionalGeneration",
)
GPT2 = dataclasses.replace(T5, encoder_layers=None, cross_attention=False, architecture="gpt2")


def test_stacks_split_the_model_into_its_encoder_and_decoder_views() -> None:
    (enc_name, encoder), (dec_name, decoder) = T5.stacks
    assert (enc_name, dec_name) == ("encoder_blocks", "decoder_blocks")
    assert (encoder.n_layers, encoder.cross_attention) == (3, False)
    assert (decoder.n_layers, decoder.cross_attention) == (2, True)
    assert GPT2.stacks == (("blocks", GPT2),)
    with pytest.raises(KeyError):
        GPT2.stack("encoder_blocks")


def test_canonical_names_of_an_encoder_decoder_carry_their_stack() -> None:
    names = canonical_hook_names(T5)
    assert not any(n.startswith("blocks.") for n in names)
    encoder = [n for n in names if n.startswith("encoder_blocks.")]
    decoder = [n for n in names if n.startswith("decoder_blocks.")]
    assert {split_canonical(n)[1] for n in encoder} == {0, 1, 2}  # type: ignore[index]
    assert {split_canonical(n)[1] for n in decoder} == {0, 1}  # type: ignore[index]
    # Cross-attention and the third norm are the decoder's only.
    assert not any(".cross_attn." in n or ".ln3." in n for n in encoder)
    per_block = {n.split(".", 2)[2] for n in decoder} - {n.split(".", 2)[2] for n in encoder}
    assert per_block == {
        f"cross_attn.hook_{s}" for s in ("in", "q", "k", "v", "pattern", "z", "out")
    } | {f"ln3.hook_{s}" for s in ("in", "scale", "normalized", "out")}
    assert {stack_of(n) for n in encoder} == {"encoder_blocks"}
    assert stack_of("embed.hook_out") is None


def test_forward_order_runs_the_encoder_before_the_decoder() -> None:
    names = canonical_hook_names(T5)
    shuffled = names[:]
    random.Random(0).shuffle(shuffled)
    assert forward_order(shuffled) == names
    assert names.index("encoder_blocks.2.hook_out") < names.index("decoder_blocks.0.hook_in")


@pytest.mark.parametrize(
    ("name", "canonical", "status"),
    [
        ("decoder_blocks.1.cross_attn.hook_z", "decoder_blocks.1.cross_attn.hook_z", "canonical"),
        # TransformerLens 4.3 calls a decoder block's self-attention self_attn.
        ("decoder_blocks.1.self_attn.hook_out", "decoder_blocks.1.attn.hook_out", "alias"),
        ("decoder_blocks.0.self_attn.q.hook_out", "decoder_blocks.0.attn.hook_q", "alias"),
        # HookedTransformer's resid_mid on a decoder block: after self-attention, as
        # TransformerLens's HookedEncoderDecoder has it.
        ("decoder_blocks.1.hook_resid_mid", "decoder_blocks.1.ln2.hook_in", "alias"),
        ("encoder_blocks.2.hook_resid_post", "encoder_blocks.2.hook_out", "alias"),
        ("encoder_blocks.0.cross_attn.hook_q", "encoder_blocks.0.cross_attn.hook_q",
         "structurally_absent"),
        # TransformerLens 4.3's module-level and block-level names of cross-attention.
        ("decoder_blocks.1.cross_attn.q.hook_out", "decoder_blocks.1.cross_attn.hook_q", "alias"),
        ("decoder_blocks.1.cross_attn.o.hook_in", "decoder_blocks.1.cross_attn.hook_z", "alias"),
        ("decoder_blocks.0.hook_cross_attn_out", "decoder_blocks.0.cross_attn.hook_out", "alias"),
        ("decoder_blocks.0.hook_resid_mid2", "decoder_blocks.0.ln3.hook_in", "alias"),
        # Their keys and values read the encoder's output, which no site holds yet.
        ("decoder_blocks.0.cross_attn.k.hook_in", None, "structurally_absent"),
        ("decoder_ln_final.hook_out", "ln_final.hook_out", "alias"),
        ("encoder_ln_final.hook_in", "encoder_blocks.2.hook_out", "alias"),
        # T5 rescales the final norm's output before its head: not an alias of it.
        ("unembed.hook_in", "ln_final.hook_out", "reconstructed_read_only"),
    ],
)  # fmt: skip
def test_stack_names_resolve_with_their_stack(
    name: str, canonical: str | None, status: str
) -> None:
    resolution = resolve_hook_name(name, info=T5)
    assert (resolution.canonical, resolution.status) == (canonical, status)


def test_resid_mid_of_a_post_ln_encoder_decoder_is_the_first_norm_s_input_as_on_bert() -> None:
    """One rule for post-LN blocks: HookedEncoder's resid_mid, the sum ln1 normalises
    (TransformerLens 4.3 serves ln2's input under that name on BERT and BART alike)."""
    bart = dataclasses.replace(T5, post_residual_norm=True, normalization_type="LN")
    for stack in ("encoder_blocks", "decoder_blocks"):
        resolution = resolve_hook_name(f"{stack}.0.hook_resid_mid", info=bart)
        assert resolution.canonical == f"{stack}.0.ln1.hook_in"


def test_a_bare_block_name_on_an_encoder_decoder_says_which_stacks_exist() -> None:
    for name in ("blocks.0.hook_out", "resid_post.0", "blocks.1.hook_resid_pre"):
        with pytest.raises(HookNameError, match=r"encoder_blocks\.\{i\} \(3 blocks\)"):
            resolve_hook_name(name, info=T5)
    with pytest.raises(HookNameError, match="names block 3"):
        resolve_hook_name("encoder_blocks.3.hook_out", info=T5)
    assert resolve_hook_name("decoder_blocks.1.hook_out", info=T5).status == "canonical"


def test_stack_names_on_a_one_stack_model_are_absent_not_unknown() -> None:
    resolution = resolve_hook_name("encoder_blocks.0.hook_out", info=GPT2)
    assert resolution.status == "structurally_absent"
    assert "blocks.{i}" in resolution.note


def test_namespace_checks_each_stack_s_block_count() -> None:
    served = canonical_hook_names(T5)
    namespace = HookNamespace.build(T5, served)
    assert "decoder_blocks.1.cross_attn.hook_k" in namespace.served
    assert "encoder_blocks.0.cross_attn.hook_k" in namespace.reasons
    for wrong in ("decoder_blocks.2.hook_out", "blocks.0.hook_out"):
        with pytest.raises(DriverContractError):
            HookNamespace.build(T5, [*served, wrong])


@given(
    st.sampled_from(["encoder_blocks", "decoder_blocks"]),
    st.integers(0, 5),
    st.sampled_from(
        ["hook_in", "attn.hook_z", "mlp.hook_post", "cross_attn.hook_v", "ln3.hook_in"]
    ),
)
def test_every_stack_name_resolves_or_is_refused_by_its_stack(
    stack: str, layer: int, site: str
) -> None:
    name = f"{stack}.{layer}.{site}"
    view = T5.stack(stack)
    if layer >= view.n_layers:
        with pytest.raises(HookNameError):
            resolve_hook_name(name, info=T5)
        return
    resolution = resolve_hook_name(name, info=T5)
    present = stack == "decoder_blocks" or not site.startswith(("cross_attn", "ln3"))
    assert resolution.status == ("canonical" if present else "structurally_absent")
    assert (name in canonical_hook_names(T5)) == present
