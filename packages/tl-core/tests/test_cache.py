"""Tests for ``ActivationCache`` and its residual-stream analysis methods.

Caches are built from random tensors that satisfy the residual identities of a sequential
transformer, so every helper can be checked against a computation written out here.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Literal

import pytest
import torch
import torch.nn.functional as F

from tl_core._errors import HookNameError, UserError
from tl_core.cache._cache import ActivationCache, tl_style_name
from tl_core.cache._readout import ModelReadout
from tl_core.hooks._model_info import ModelInfo
from tl_core.hooks._namespace import HookNamespace

EPS = 1e-5
N_LAYERS = 3
D_MODEL = 8
N_HEADS = 2
D_VOCAB = 11

Norm = Literal["LN", "RMS"] | None


def norm_scale(x: torch.Tensor, norm: Norm) -> torch.Tensor:
    if norm == "LN":
        x = x - x.mean(-1, keepdim=True)
    return (x.pow(2).mean(-1, keepdim=True) + EPS).sqrt()


def make_tensors(
    norm: Norm = "LN",
    *,
    batch: int = 2,
    pos: int = 5,
    learned_pos: bool = True,
    embed_scale: float = 1.0,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    out: dict[str, torch.Tensor] = {"embed.hook_out": rand(batch, pos, D_MODEL)}
    if learned_pos:
        out["pos_embed.hook_out"] = rand(batch, pos, D_MODEL)
        resid = out["embed.hook_out"] + out["pos_embed.hook_out"]
    else:
        resid = out["embed.hook_out"] * embed_scale
    for i in range(N_LAYERS):
        out[f"blocks.{i}.hook_in"] = resid
        result = rand(batch, pos, N_HEADS, D_MODEL)
        out[f"blocks.{i}.attn.hook_result"] = result
        out[f"blocks.{i}.attn.hook_pattern"] = rand(batch, N_HEADS, pos, pos).softmax(-1)
        attn_out = result.sum(2) + 0.1 * rand(D_MODEL)
        out[f"blocks.{i}.attn.hook_out"] = attn_out
        mid = resid + attn_out
        out[f"blocks.{i}.ln2.hook_in"] = mid
        out[f"blocks.{i}.mlp.hook_post"] = rand(batch, pos, 4 * D_MODEL)
        mlp_out = rand(batch, pos, D_MODEL)
        out[f"blocks.{i}.mlp.hook_out"] = mlp_out
        resid = mid + mlp_out
        out[f"blocks.{i}.hook_out"] = resid
        if norm is not None:
            out[f"blocks.{i}.ln1.hook_scale"] = norm_scale(out[f"blocks.{i}.hook_in"], norm)
            out[f"blocks.{i}.ln2.hook_scale"] = norm_scale(mid, norm)
    if norm is not None:
        out["ln_final.hook_scale"] = norm_scale(resid, norm)
    return out


def make_info(norm: Norm = "LN", *, learned_pos: bool = True) -> ModelInfo:
    return ModelInfo(
        n_layers=N_LAYERS,
        d_model=D_MODEL,
        n_heads=N_HEADS,
        d_head=D_MODEL // N_HEADS,
        d_mlp=4 * D_MODEL,
        d_vocab=D_VOCAB,
        n_ctx=16,
        normalization_type=norm,
        positional_embedding_type="standard" if learned_pos else "rotary",
    )


def make_readout(norm: Norm = "LN", seed: int = 1) -> ModelReadout:
    g = torch.Generator().manual_seed(seed)
    return ModelReadout(
        W_U=torch.randn(D_MODEL, D_VOCAB, generator=g),
        b_U=torch.randn(D_VOCAB, generator=g),
        ln_final_weight=None if norm is None else 1 + 0.3 * torch.randn(D_MODEL, generator=g),
        ln_final_bias=torch.randn(D_MODEL, generator=g) if norm == "LN" else None,
        normalization_type=norm,
        eps=EPS,
    )


def make_cache(
    norm: Norm = "LN",
    *,
    learned_pos: bool = True,
    embed_scale: float = 1.0,
    batch: int = 2,
    lengths: Sequence[int] | None = None,
    with_info: bool = True,
    with_readout: bool = True,
) -> ActivationCache:
    tensors = make_tensors(norm, batch=batch, learned_pos=learned_pos, embed_scale=embed_scale)
    return ActivationCache(
        tensors,
        info=make_info(norm, learned_pos=learned_pos) if with_info else None,
        readout=make_readout(norm) if with_readout else None,
        lengths=lengths,
    )


def final_norm_by_hand(x: torch.Tensor, readout: ModelReadout) -> torch.Tensor:
    """The final norm with weight and bias, written out independently of the module."""
    if readout.normalization_type == "LN":
        return F.layer_norm(
            x, (D_MODEL,), readout.ln_final_weight, readout.ln_final_bias, eps=readout.eps
        )
    if readout.normalization_type == "RMS":
        assert readout.ln_final_weight is not None
        return (
            x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + readout.eps) * readout.ln_final_weight
        )
    return x


def logits_by_hand(x: torch.Tensor, readout: ModelReadout) -> torch.Tensor:
    logits = final_norm_by_hand(x, readout) @ readout.W_U
    return logits if readout.b_U is None else logits + readout.b_U


# -- mapping behaviour -----------------------------------------------------------------------


def test_aliases_and_tuples_find_the_canonical_tensor() -> None:
    cache = make_cache()
    assert cache["blocks.1.hook_resid_post"] is cache["blocks.1.hook_out"]
    assert cache["hook_embed"] is cache["embed.hook_out"]
    assert cache[("resid_post", 1)] is cache["blocks.1.hook_out"]
    assert cache[("resid_post", -1)] is cache["blocks.2.hook_out"]
    assert cache[("resid_mid", 0)] is cache["blocks.0.ln2.hook_in"]
    assert cache[("pattern", 0)] is cache["blocks.0.attn.hook_pattern"]
    assert cache[("scale", 2, "ln1")] is cache["blocks.2.ln1.hook_scale"]
    assert cache[("scale",)] is cache["ln_final.hook_scale"]
    assert cache[("embed",)] is cache["embed.hook_out"]
    assert "blocks.0.hook_resid_pre" in cache
    assert ("mlp_out", 2) in cache  # type: ignore[comparison-overlap]


def test_tl_style_names() -> None:
    assert tl_style_name("resid_pre", 4) == "blocks.4.hook_in"
    assert tl_style_name("attn", 1) == "blocks.1.attn.hook_pattern"
    assert tl_style_name("q", 2, "a") == "blocks.2.attn.hook_q"
    assert tl_style_name("post", 0) == "blocks.0.mlp.hook_post"
    assert tl_style_name("normalized", 3, "ln2") == "blocks.3.ln2.hook_normalized"
    assert tl_style_name("hook_out", 2) == "blocks.2.hook_out"
    assert tl_style_name("attn.hook_pattern", 0) == "blocks.0.attn.hook_pattern"
    assert tl_style_name("hook_resid_post", 1) == "blocks.1.hook_resid_post"
    assert tl_style_name("mlp_in", 1) == "blocks.1.hook_mlp_in"
    with pytest.raises(HookNameError, match="which norm"):
        tl_style_name("scale", 2)


def test_keys_are_stored_canonical() -> None:
    tensors = make_tensors()
    legacy = {("hook_embed" if k == "embed.hook_out" else k): v for k, v in tensors.items()}
    legacy["blocks.2.hook_resid_post"] = legacy.pop("blocks.2.hook_out")
    cache = ActivationCache(legacy, info=make_info())
    assert set(cache) == set(tensors)
    assert len(cache) == len(tensors)
    assert list(cache.keys()) == list(cache)
    assert all(value is cache[key] for key, value in cache.items())
    assert len(list(cache.values())) == len(tensors)


def test_two_keys_for_one_hook_are_refused() -> None:
    tensors = make_tensors()
    tensors["blocks.0.hook_resid_pre"] = tensors["blocks.0.hook_in"]
    with pytest.raises(UserError, match=re.escape("blocks.0.hook_resid_pre")) as info:
        ActivationCache(tensors)
    assert "'blocks.0.hook_in'" in str(info.value)


def test_missing_hook_lists_cached_names_nearest_first() -> None:
    tensors = make_tensors()
    del tensors["blocks.1.mlp.hook_out"]
    cache = ActivationCache(tensors, info=make_info())
    with pytest.raises(HookNameError) as info:
        cache["blocks.1.hook_mlp_out"]
    message = str(info.value)
    assert "'blocks.1.hook_mlp_out'" in message
    assert "'blocks.1.mlp.hook_out'" in message  # the canonical name it resolved to
    assert f"holds {len(tensors)} tensors" in message
    shown = re.findall(r"'([^']+)'", message.split("nearest first:")[1])
    assert set(shown[:3]) == {
        "blocks.0.mlp.hook_out",
        "blocks.2.mlp.hook_out",
        "blocks.1.mlp.hook_post",
    }
    assert "embed.hook_out" not in shown  # far names fall past the cut
    assert f"and {len(tensors) - len(shown)} more" in message
    assert "blocks.1.hook_mlp_out" not in cache
    assert cache.get("blocks.1.hook_mlp_out") is None
    sentinel = torch.zeros(1)
    assert cache.get("blocks.1.hook_mlp_out", sentinel) is sentinel
    assert cache.get("blocks.0.hook_mlp_out") is tensors["blocks.0.mlp.hook_out"]


def test_unknown_name_reports_resolver_message() -> None:
    cache = make_cache()
    with pytest.raises(HookNameError, match=re.escape("unknown hook name 'bogus.hook'")) as info:
        cache["bogus.hook"]
    assert "The cache holds" in str(info.value)
    assert "bogus.hook" not in cache
    assert 3 not in cache  # type: ignore[comparison-overlap]


def test_repr_summarises() -> None:
    cache = make_cache(lengths=(5, 3))
    text = repr(cache)
    assert f"{len(cache)} tensors" in text
    assert "batch 2" in text
    assert "(5, 3)" in text
    assert "'embed.hook_out'" in text
    assert "more" in text  # long caches are cut


def test_lengths_must_fit_the_batch() -> None:
    with pytest.raises(UserError, match="3 entries"):
        make_cache(lengths=(5, 3, 2))
    with pytest.raises(UserError, match="positive"):
        make_cache(lengths=(5, 0))
    assert make_cache(lengths=[5, 3]).lengths == (5, 3)


def test_n_layers_inferred_without_info() -> None:
    assert make_cache(with_info=False).n_layers == N_LAYERS
    with pytest.raises(UserError, match="info="):
        _ = ActivationCache({"embed.hook_out": torch.zeros(1, 2, 3)}).n_layers


# -- new caches ------------------------------------------------------------------------------


def test_to_cpu_detach_return_new_caches() -> None:
    cache = make_cache()
    wide = cache.to(torch.float64)
    assert wide is not cache
    assert list(wide) == list(cache)
    assert all(t.dtype == torch.float64 for t in wide.values())
    assert all(t.dtype == torch.float32 for t in cache.values())
    assert torch.equal(wide["blocks.0.hook_in"], cache["blocks.0.hook_in"].double())
    assert wide.info is cache.info and wide.readout is cache.readout
    on_cpu = cache.cpu()
    assert on_cpu is not cache and list(on_cpu) == list(cache)
    assert all(t.device.type == "cpu" for t in on_cpu.values())
    both = cache.to("cpu", torch.float16)
    assert all(t.dtype == torch.float16 for t in both.values())
    with pytest.raises(UserError, match="two dtypes"):
        cache.to(torch.float16, torch.float32)
    tracked = ActivationCache({"embed.hook_out": torch.ones(1, 2, 3, requires_grad=True) * 2})
    assert not tracked.detach()["embed.hook_out"].requires_grad
    assert tracked["embed.hook_out"].requires_grad


def test_remove_batch_dim() -> None:
    with pytest.raises(UserError, match="batch size 1"):
        make_cache(batch=2).remove_batch_dim()
    cache = make_cache(batch=1)
    single = cache.remove_batch_dim()
    assert not single.has_batch_dim
    assert single["blocks.0.hook_in"].shape == (5, D_MODEL)
    assert single["blocks.0.attn.hook_pattern"].shape == (N_HEADS, 5, 5)
    assert torch.equal(single["blocks.1.hook_out"], cache["blocks.1.hook_out"][0])
    assert single.remove_batch_dim() is single


def test_prompt_trims_to_length() -> None:
    cache = make_cache(lengths=(5, 3))
    one = cache.prompt(1)
    assert one.lengths == (3,)
    assert one["blocks.0.hook_in"].shape == (1, 3, D_MODEL)
    assert one["blocks.0.attn.hook_result"].shape == (1, 3, N_HEADS, D_MODEL)
    assert one["blocks.0.attn.hook_pattern"].shape == (1, N_HEADS, 3, 3)
    assert one["ln_final.hook_scale"].shape == (1, 3, 1)
    assert torch.equal(one["blocks.2.hook_out"], cache["blocks.2.hook_out"][1:2, :3])
    pattern = cache["blocks.1.attn.hook_pattern"][1:2, :, :3, :3]
    assert torch.equal(one["blocks.1.attn.hook_pattern"], pattern)
    assert cache.prompt(-2)["embed.hook_out"].shape == (1, 5, D_MODEL)
    untrimmed = make_cache().prompt(1)
    assert untrimmed.lengths is None and untrimmed["embed.hook_out"].shape == (1, 5, D_MODEL)
    with pytest.raises(UserError, match="out of range"):
        cache.prompt(2)


def test_grads_follow_derived_caches() -> None:
    cache = make_cache(lengths=(5, 3))
    cache.grads = make_cache(lengths=(5, 3))
    one = cache.prompt(1)
    assert one.grads is not None
    assert one.grads["blocks.0.hook_in"].shape == (1, 3, D_MODEL)
    assert cache.to(torch.float64).grads is not None


# -- residual analysis -----------------------------------------------------------------------


def test_accumulated_resid_order_and_labels() -> None:
    cache = make_cache()
    stack, labels = cache.accumulated_resid(return_labels=True)
    assert labels == ["0_pre", "1_pre", "2_pre", "final_post"]
    expected = [cache[f"blocks.{i}.hook_in"] for i in range(N_LAYERS)] + [
        cache["blocks.2.hook_out"]
    ]
    assert torch.equal(stack, torch.stack(expected))

    stack, labels = cache.accumulated_resid(1, incl_mid=True, return_labels=True)
    assert labels == ["0_pre", "0_mid", "1_pre"]
    expected = [cache["blocks.0.hook_in"], cache["blocks.0.ln2.hook_in"], cache["blocks.1.hook_in"]]
    assert torch.equal(stack, torch.stack(expected))

    _, labels = cache.accumulated_resid(-1, incl_mid=True, return_labels=True)
    assert labels == ["0_pre", "0_mid", "1_pre", "1_mid", "2_pre", "2_mid", "final_post"]
    _, labels = cache.accumulated_resid(1, mlp_input=True, return_labels=True)
    assert labels == ["0_pre", "1_pre", "1_mid"]

    last = cache.accumulated_resid(pos_slice=-1)
    assert last.shape == (N_LAYERS + 1, 2, D_MODEL)
    assert torch.equal(last[1], cache["blocks.1.hook_in"][:, -1])
    picked = cache.accumulated_resid(pos_slice=[0, 3])
    assert torch.equal(picked[2], cache["blocks.2.hook_in"][:, [0, 3]])
    with pytest.raises(UserError, match="out of range"):
        cache.accumulated_resid(pos_slice=7)
    with pytest.raises(UserError, match="layer=4"):
        cache.accumulated_resid(4)


def test_accumulated_resid_apply_ln_uses_that_layers_norm() -> None:
    cache = make_cache()
    stack = cache.accumulated_resid(1, apply_ln=True)
    # The last entry is the input of block 1, normalised by block 1's ln1.
    assert torch.allclose(
        stack[-1], F.layer_norm(cache["blocks.1.hook_in"], (D_MODEL,), eps=EPS), atol=1e-5
    )
    scale = cache["blocks.1.ln1.hook_scale"]
    first = cache["blocks.0.hook_in"]
    assert torch.allclose(stack[0], (first - first.mean(-1, keepdim=True)) / scale, atol=1e-6)


@pytest.mark.parametrize("layer", [None, 0, 2])
def test_decompose_resid_sums_to_the_residual(layer: int | None) -> None:
    cache = make_cache()
    stack, labels = cache.decompose_resid(layer, return_labels=True)
    target = cache["blocks.2.hook_out"] if layer is None else cache[f"blocks.{layer}.hook_in"]
    assert torch.allclose(stack.sum(0), target, atol=1e-5)
    n = N_LAYERS if layer is None else layer
    expected_labels = ["embed", "pos_embed"]
    for i in range(n):
        expected_labels += [f"{i}_attn_out", f"{i}_mlp_out"]
    assert labels == expected_labels
    if n:
        assert torch.equal(
            stack[labels.index(f"{n - 1}_mlp_out")], cache[f"blocks.{n - 1}.mlp.hook_out"]
        )


def test_decompose_resid_modes_and_mlp_input() -> None:
    cache = make_cache()
    stack = cache.decompose_resid(1, mlp_input=True)
    assert torch.allclose(stack.sum(0), cache["blocks.1.ln2.hook_in"], atol=1e-5)
    _, labels = cache.decompose_resid(mode="attn", incl_embeds=False, return_labels=True)
    assert labels == ["0_attn_out", "1_attn_out", "2_attn_out"]
    _, labels = cache.decompose_resid(2, mode="mlp", return_labels=True)
    assert labels == ["embed", "pos_embed", "0_mlp_out", "1_mlp_out"]
    with pytest.raises(UserError, match="no components"):
        cache.decompose_resid(0, incl_embeds=False)
    with pytest.raises(UserError, match="mode"):
        cache.decompose_resid(mode="heads")  # type: ignore[call-overload]


def test_decompose_resid_without_learned_positions_uses_scaled_embedding() -> None:
    cache = make_cache(learned_pos=False, embed_scale=3.0)
    stack, labels = cache.decompose_resid(return_labels=True)
    assert labels[0] == "embed" and "pos_embed" not in labels
    assert torch.equal(stack[0], cache["blocks.0.hook_in"])
    assert torch.allclose(stack.sum(0), cache["blocks.2.hook_out"], atol=1e-5)


def test_decompose_resid_missing_hook_names_it() -> None:
    tensors = make_tensors()
    del tensors["blocks.1.attn.hook_out"]
    cache = ActivationCache(tensors, info=make_info())
    with pytest.raises(
        HookNameError, match=re.escape("decompose_resid needs 'blocks.1.attn.hook_out'")
    ):
        cache.decompose_resid()


@pytest.mark.parametrize("norm", ["LN", "RMS"])
def test_apply_ln_to_stack_matches_manual_normalisation(norm: Norm) -> None:
    cache = make_cache(norm)
    stack = cache.decompose_resid()
    normalized = cache.apply_ln_to_stack(stack)
    scale = cache["ln_final.hook_scale"]
    manual = (stack - stack.mean(-1, keepdim=True)) / scale if norm == "LN" else stack / scale
    assert torch.allclose(normalized, manual, atol=1e-6)
    # Holding the scale fixed keeps the map linear: the parts sum to the normalised whole.
    final = cache["blocks.2.hook_out"]
    if norm == "LN":
        whole = F.layer_norm(final, (D_MODEL,), eps=EPS)
    else:
        whole = final * torch.rsqrt(final.pow(2).mean(-1, keepdim=True) + EPS)
    assert torch.allclose(normalized.sum(0), whole, atol=1e-5)
    recomputed = cache.apply_ln_to_stack(stack, recompute_ln=True)
    assert torch.allclose(recomputed, normalized, atol=1e-5)


def test_apply_ln_to_stack_block_norms_and_pos_slice() -> None:
    cache = make_cache("RMS")
    stack = cache.decompose_resid(1, mlp_input=True, pos_slice=2)
    normalized = cache.apply_ln_to_stack(stack, 1, mlp_input=True, pos_slice=2)
    assert torch.allclose(normalized, stack / cache["blocks.1.ln2.hook_scale"][:, 2], atol=1e-6)
    pre = cache.decompose_resid(2, pos_slice=slice(1, 4))
    normalized = cache.apply_ln_to_stack(pre, 2, pos_slice=slice(1, 4))
    assert torch.allclose(normalized, pre / cache["blocks.2.ln1.hook_scale"][:, 1:4], atol=1e-6)
    with pytest.raises(UserError, match="pos_slice"):
        cache.apply_ln_to_stack(pre, 2)


def test_apply_ln_to_stack_without_norm_is_identity() -> None:
    cache = make_cache(None)
    stack = cache.decompose_resid()
    assert torch.equal(cache.apply_ln_to_stack(stack), stack)


def test_apply_ln_to_stack_errors() -> None:
    tensors = make_tensors()
    del tensors["ln_final.hook_scale"]
    cache = ActivationCache(tensors, info=make_info(), readout=make_readout())
    stack = cache.decompose_resid()
    with pytest.raises(UserError, match=re.escape("'ln_final.hook_scale'")):
        cache.apply_ln_to_stack(stack)
    bare = make_cache(with_info=False, with_readout=False)
    with pytest.raises(UserError, match="info=ModelInfo"):
        bare.apply_ln_to_stack(bare.decompose_resid())


@pytest.mark.parametrize("norm", ["LN", "RMS"])
def test_logit_attrs_sum_to_logit_difference(norm: Norm) -> None:
    cache = make_cache(norm)
    readout = cache.readout
    assert readout is not None
    stack = cache.decompose_resid(pos_slice=-1)
    tokens = torch.tensor([3, 7])
    wrong = torch.tensor([5, 0])
    attrs = cache.logit_attrs(stack, tokens, wrong, pos_slice=-1)
    assert attrs.shape == (stack.shape[0], 2)

    logits = logits_by_hand(cache["blocks.2.hook_out"][:, -1], readout)
    rows = torch.arange(2)
    expected = logits[rows, tokens] - logits[rows, wrong]
    assert readout.b_U is not None
    offset = readout.b_U[tokens] - readout.b_U[wrong]
    if readout.ln_final_bias is not None:
        offset = offset + readout.ln_final_bias @ (readout.W_U[:, tokens] - readout.W_U[:, wrong])
    assert torch.allclose(attrs.sum(0) + offset, expected, atol=1e-4)


def test_logit_attrs_single_token_all_positions_and_errors() -> None:
    cache = make_cache()
    readout = cache.readout
    assert readout is not None and readout.b_U is not None and readout.ln_final_bias is not None
    stack = cache.decompose_resid()
    attrs = cache.logit_attrs(stack, 4)
    assert attrs.shape == (stack.shape[0], 2, 5)
    logits = logits_by_hand(cache["blocks.2.hook_out"], readout)
    offset = readout.b_U[4] + readout.ln_final_bias @ readout.W_U[:, 4]
    assert torch.allclose(attrs.sum(0) + offset, logits[..., 4], atol=1e-4)
    with pytest.raises(UserError, match="vocabulary"):
        cache.logit_attrs(stack, D_VOCAB)
    with pytest.raises(UserError, match="do not fit"):
        cache.logit_attrs(stack, torch.tensor([1, 2]))
    with pytest.raises(UserError, match="readout="):
        make_cache(with_readout=False).logit_attrs(stack, 4)


def test_logit_attrs_without_batch_dim() -> None:
    cache = make_cache(batch=1).remove_batch_dim()
    readout = cache.readout
    assert readout is not None and readout.b_U is not None and readout.ln_final_bias is not None
    stack = cache.decompose_resid(pos_slice=-1)
    assert stack.shape == (2 + 2 * N_LAYERS, D_MODEL)
    attrs = cache.logit_attrs(stack, 2, 9, pos_slice=-1)
    logits = logits_by_hand(cache["blocks.2.hook_out"][-1], readout)
    offset = readout.b_U[2] - readout.b_U[9]
    offset = offset + readout.ln_final_bias @ (readout.W_U[:, 2] - readout.W_U[:, 9])
    assert torch.allclose(attrs.sum(0) + offset, logits[2] - logits[9], atol=1e-4)


def test_logit_lens_final_entry_is_the_model_logits() -> None:
    cache = make_cache()
    readout = cache.readout
    assert readout is not None
    lens, labels = cache.logit_lens(return_labels=True)
    assert labels[-1] == "final_post"
    assert lens.shape == (N_LAYERS + 1, 2, 5, D_VOCAB)
    assert torch.allclose(lens[-1], logits_by_hand(cache["blocks.2.hook_out"], readout), atol=1e-4)
    assert torch.allclose(lens[1], logits_by_hand(cache["blocks.1.hook_in"], readout), atol=1e-4)


def test_stack_head_results() -> None:
    cache = make_cache()
    stack, labels = cache.stack_head_results(return_labels=True)
    assert labels == [f"L{layer}H{head}" for layer in range(N_LAYERS) for head in range(N_HEADS)]
    assert stack.shape == (N_LAYERS * N_HEADS, 2, 5, D_MODEL)
    assert torch.equal(stack[labels.index("L1H1")], cache["blocks.1.attn.hook_result"][:, :, 1])
    last = cache.stack_head_results(2, pos_slice=-1, apply_ln=True)
    scale = cache["blocks.2.ln1.hook_scale"][:, -1]
    raw = cache["blocks.0.attn.hook_result"][:, -1, 0]
    assert torch.allclose(last[0], (raw - raw.mean(-1, keepdim=True)) / scale, atol=1e-6)

    tensors = make_tensors()
    del tensors["blocks.1.attn.hook_result"]
    partial = ActivationCache(tensors, info=make_info())
    with pytest.raises(UserError, match=r"blocks\.1\.attn\.hook_result") as info:
        partial.stack_head_results()
    assert "capture" in str(info.value)
    assert partial.stack_head_results(1).shape == (N_HEADS, 2, 5, D_MODEL)


def test_stack_activation() -> None:
    cache = make_cache()
    expected = torch.stack([cache[f"blocks.{i}.hook_out"] for i in range(N_LAYERS)])
    assert torch.equal(cache.stack_activation("hook_out"), expected)
    assert torch.equal(cache.stack_activation("resid_post"), expected)
    assert torch.equal(cache.stack_activation("hook_resid_post"), expected)
    patterns = cache.stack_activation("attn.hook_pattern", 2)
    assert torch.equal(patterns, torch.stack([cache[("pattern", i)] for i in range(2)]))
    scales = cache.stack_activation("scale", sublayer_type="ln1")
    assert scales.shape == (N_LAYERS, 2, 5, 1)
    with pytest.raises(UserError, match="layer"):
        cache.stack_activation("hook_out", 0)


def test_names_resolve_against_the_model_the_cache_came_from() -> None:
    tensors = make_tensors()
    g = torch.Generator().manual_seed(7)
    post = {
        f"blocks.{i}.ln1_post.hook_out": torch.randn(2, 5, D_MODEL, generator=g)
        for i in range(N_LAYERS)
    }
    sandwich = dataclasses.replace(make_info(), sandwich_norm=True, architecture="gemma2-style")
    cache = ActivationCache({**tensors, **post}, info=sandwich)
    # On a sandwich-norm model TransformerLens's hook_attn_out is the post-norm output ...
    assert cache["blocks.0.hook_attn_out"] is post["blocks.0.ln1_post.hook_out"]
    # ... and on a plain one the attention output itself.
    plain = ActivationCache(tensors, info=make_info())
    assert plain["blocks.0.hook_attn_out"] is tensors["blocks.0.attn.hook_out"]
    # A namespace decides the same way, and its info becomes the cache's.
    namespace = HookNamespace.build(sandwich, {**tensors, **post}, driver="test")
    through = ActivationCache({**tensors, **post}, namespace=namespace)
    assert through.info == sandwich and through.namespace is namespace
    assert through["blocks.1.hook_attn_out"] is post["blocks.1.ln1_post.hook_out"]


def test_default_resolver_accepts_canonical_names() -> None:
    cache = ActivationCache(make_tensors(), info=make_info())
    assert "blocks.0.hook_in" in cache
    assert cache["blocks.2.hook_out"].shape == (2, 5, D_MODEL)


def test_sandwich_norm_components_are_the_post_norm_outputs() -> None:
    tensors = make_tensors()
    g = torch.Generator().manual_seed(5)
    for i in range(N_LAYERS):
        for sub, post in (("attn", "ln1_post"), ("mlp", "ln2_post")):
            # What the residual received is the post-norm output; the sublayer output differs.
            tensors[f"blocks.{i}.{post}.hook_out"] = tensors[f"blocks.{i}.{sub}.hook_out"]
            tensors[f"blocks.{i}.{sub}.hook_out"] = torch.randn(2, 5, D_MODEL, generator=g)
    info = dataclasses.replace(make_info(), sandwich_norm=True)
    cache = ActivationCache(tensors, info=info)
    stack, labels = cache.decompose_resid(return_labels=True)
    assert labels[2:4] == ["0_attn_out", "0_mlp_out"]
    assert torch.equal(stack[2], cache["blocks.0.ln1_post.hook_out"])
    assert torch.allclose(stack.sum(0), cache["blocks.2.hook_out"], atol=1e-5)


def test_parallel_blocks_have_no_mid_residual() -> None:
    g = torch.Generator().manual_seed(7)
    embed, pos_embed = torch.randn(2, 2, 5, D_MODEL, generator=g)
    tensors = {"embed.hook_out": embed, "pos_embed.hook_out": pos_embed}
    resid = embed + pos_embed
    for i in range(N_LAYERS):
        tensors[f"blocks.{i}.hook_in"] = resid
        tensors[f"blocks.{i}.ln1.hook_scale"] = norm_scale(resid, "LN")
        attn_out, mlp_out = torch.randn(2, 2, 5, D_MODEL, generator=g)
        tensors[f"blocks.{i}.attn.hook_out"] = attn_out
        tensors[f"blocks.{i}.mlp.hook_out"] = mlp_out
        resid = resid + attn_out + mlp_out
        tensors[f"blocks.{i}.hook_out"] = resid
    info = dataclasses.replace(make_info(), parallel_attn_mlp=True)
    cache = ActivationCache(tensors, info=info)
    stack, labels = cache.decompose_resid(1, mlp_input=True, return_labels=True)
    assert labels == ["embed", "pos_embed", "0_attn_out", "0_mlp_out"]
    assert torch.allclose(stack.sum(0), cache["blocks.1.hook_in"], atol=1e-5)
    _, labels = cache.accumulated_resid(2, incl_mid=True, return_labels=True)
    assert labels == ["0_pre", "1_pre", "2_pre"]
    # Both norms of a parallel block read its input, so the MLP norm's scale is ln1's.
    normalized = cache.apply_ln_to_stack(stack, 1, mlp_input=True)
    manual = (stack - stack.mean(-1, keepdim=True)) / cache["blocks.1.ln1.hook_scale"]
    assert torch.allclose(normalized, manual, atol=1e-6)


def test_a_readout_function_is_called_only_when_analysis_needs_it() -> None:
    calls: list[int] = []
    readout = ModelReadout(
        W_U=torch.randn(4, 7),
        b_U=None,
        ln_final_weight=None,
        ln_final_bias=None,
        normalization_type=None,
    )

    def fetch() -> ModelReadout:
        calls.append(1)
        return readout

    cache = ActivationCache({"blocks.0.hook_out": torch.zeros(1, 2, 4)}, readout=fetch)
    assert calls == []
    assert cache.readout is readout and cache.readout is readout
    assert calls == [1]
