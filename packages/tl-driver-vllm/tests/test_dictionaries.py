"""Sparse dictionaries inside vLLM: the same splice on the vllm driver equals the hf driver.

Each case attaches one dictionary (ReLU, JumpReLU and TopK autoencoders, a skip
transcoder) to both drivers and compares logits and the dictionary's sites over a ragged
batch whose longest prompt is prefilled in chunks (32-token steps), with per-prompt feature
edits, one prompt unedited (TP=2: ``test_dictionaries_tp.py``). The engine is the driver's
default, compiled: a run with a dictionary attached takes its eager forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from _tlv_support import ENGINE_OPTIONS, ENGINE_SIZES  # noqa: E402

from tl_core import RemoteBridge, TransformerBridge  # noqa: E402
from tl_core.sae import SparseDictionary, random_dictionary  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LENGTHS = [9, 70, 3, 17]
TOL = {"rtol": 1e-4, "atol": 1e-4}


def _dictionary(d_in: int, d_sae: int, seed: int, **settings: Any) -> SparseDictionary:
    return random_dictionary(d_in, d_sae, seed=seed, scale=0.2, **settings)


@pytest.fixture(scope="module")
def pair(checkpoint: Any) -> Iterator[tuple[RemoteBridge, TransformerBridge]]:
    folder = checkpoint("llama")
    vllm = RemoteBridge.boot_vllm(folder, dtype="float32", **ENGINE_SIZES)
    assert vllm.driver.compiled
    hf = TransformerBridge.boot_transformers(str(folder), dtype=torch.float32)
    yield vllm, hf
    vllm.close()


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(9)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


CASES = {
    "relu": ({}, "blocks.1.hook_out", None),
    "jumprelu": (
        {"architecture": "jumprelu", "normalize_activations": "layer_norm"},
        "blocks.0.attn.hook_out",
        None,
    ),
    "topk": (
        {"architecture": "topk", "k": 12, "rescale_acts_by_decoder_norm": True},
        "blocks.1.hook_in",
        None,
    ),
    "skip_transcoder": (
        {"apply_b_dec_to_input": False, "skip": True},
        "blocks.1.ln2.hook_out",
        "blocks.1.mlp.hook_out",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("use_error_term", [False, True])
def test_a_spliced_dictionary_equals_the_hf_driver(
    pair: tuple[RemoteBridge, TransformerBridge], case: str, use_error_term: bool
) -> None:
    vllm, hf = pair
    settings, hook, output = CASES[case]
    d = _dictionary(hf.cfg.d_model, 4 * hf.cfg.d_model, seed=len(case), **settings)
    prompts = _prompts(hf.cfg.d_vocab)
    acts = f"{hook}.hook_sae_acts_post"
    per_prompt: list[Any] = [
        {acts: {"op": "add", "value": 4.0, "features": [3, 40], "pos": -1}},
        {acts: {"op": "scale", "factor": 0.0, "features": list(range(0, 512, 7))}},
        None,
        {acts: {"op": "set", "value": 1.5, "features": 11, "pos": [0, 5]}},
    ]
    names = [
        acts,
        f"{hook}.hook_sae_top_indices",
        f"{hook}.hook_sae_top_values",
        f"{hook}.hook_sae_output",
        "ln_final.hook_in",
    ]
    results = []
    for bridge in (hf, vllm):
        spliced = bridge.add_sae(
            d, hook_name=hook, output_hook_name=output, use_error_term=use_error_term, top_k=8
        )
        try:
            plain_logits = bridge.forward(prompts) if use_error_term else None
            logits, cache = bridge.run_with_cache(prompts, names_filter=names, intervene=per_prompt)
        finally:
            spliced.remove()
        results.append((plain_logits, logits, cache))
        assert not bridge.namespace.dictionaries
    (hf_plain, hf_logits, hf_cache), (vllm_plain, vllm_logits, vllm_cache) = results
    for b, n in enumerate(LENGTHS):
        torch.testing.assert_close(vllm_logits[b, :n], hf_logits[b, :n], **TOL)
        for name in names:
            if name.endswith("top_indices"):
                assert torch.equal(vllm_cache[name][b, :n], hf_cache[name][b, :n]), name
            else:
                torch.testing.assert_close(vllm_cache[name][b, :n], hf_cache[name][b, :n], **TOL)
    if use_error_term:
        # Unedited, the splice leaves the model unchanged: prompt 2 has no edit.
        assert vllm_plain is not None and hf_plain is not None
        torch.testing.assert_close(vllm_logits[2, : LENGTHS[2]], vllm_plain[2, : LENGTHS[2]], **TOL)
        torch.testing.assert_close(hf_logits[2, : LENGTHS[2]], hf_plain[2, : LENGTHS[2]], **TOL)


def test_a_single_prompt_equals_the_hf_driver(pair: tuple[RemoteBridge, TransformerBridge]) -> None:
    vllm, hf = pair
    d = _dictionary(hf.cfg.d_model, 4 * hf.cfg.d_model, seed=3, architecture="jumprelu")
    prompt = _prompts(hf.cfg.d_vocab)[1]  # 70 tokens: prefilled in three chunks
    acts = "blocks.1.hook_in.hook_sae_acts_post"
    steer = {acts: {"op": "add", "value": 2.0, "features": [5, 6]}}
    results = []
    for bridge in (hf, vllm):
        spliced = bridge.add_sae(d, hook_name="blocks.1.hook_in")
        try:
            results.append(bridge.run_with_cache([prompt], names_filter=[acts], intervene=steer))
        finally:
            spliced.remove()
    (hf_logits, hf_cache), (vllm_logits, vllm_cache) = results
    torch.testing.assert_close(vllm_logits, hf_logits, **TOL)
    torch.testing.assert_close(vllm_cache[acts], hf_cache[acts], **TOL)


def test_steered_generation_through_a_feature(pair: tuple[RemoteBridge, TransformerBridge]) -> None:
    vllm, hf = pair
    d = _dictionary(hf.cfg.d_model, 4 * hf.cfg.d_model, seed=2)
    prompts = _prompts(hf.cfg.d_vocab)[:2]
    steer = {"blocks.0.hook_out.hook_sae_acts_post": {"op": "add", "value": 30.0, "features": 17}}
    tokens = []
    for bridge in (hf, vllm):
        spliced = bridge.add_sae(d, hook_name="blocks.0.hook_out", use_error_term=True)
        try:
            out = bridge.driver.forward(
                prompts, intervene=steer, max_new_tokens=6, return_logits=False, stop_at_eos=False
            )
            plain = bridge.driver.forward(
                prompts, max_new_tokens=6, return_logits=False, stop_at_eos=False
            )
        finally:
            spliced.remove()
        tokens.append((out.new_tokens, plain.new_tokens))
    assert torch.equal(tokens[0][0], tokens[1][0])
    assert torch.equal(tokens[0][1], tokens[1][1])
    assert not torch.equal(tokens[1][0], tokens[1][1])  # the feature steered the text


def test_the_evaluation_runs_through_the_engine_and_equals_the_hf_driver(
    pair: tuple[RemoteBridge, TransformerBridge],
) -> None:
    from tl_core.sae import evaluate_dictionary

    vllm, hf = pair
    d = _dictionary(hf.cfg.d_model, 4 * hf.cfg.d_model, seed=4, architecture="topk", k=16)
    tokens = torch.randint(3, hf.cfg.d_vocab, (6, 24), generator=torch.Generator().manual_seed(2))
    got, want = (
        evaluate_dictionary(b, d, tokens, hook_name="blocks.0.hook_out", batch_size=4)
        for b in (vllm, hf)
    )
    for field in (
        "ce_clean",
        "ce_splice",
        "ce_zero",
        "ce_recovered",
        "kl",
        "explained_variance",
        "l0",
    ):
        assert getattr(got, field) == pytest.approx(getattr(want, field), rel=1e-4, abs=1e-5), field
    assert torch.equal(got.feature_counts, want.feature_counts)


def test_removing_a_splice_after_the_engine_closed_is_quiet(checkpoint: Any) -> None:
    bridge = RemoteBridge.boot_vllm(checkpoint("llama"), dtype="float32", **ENGINE_OPTIONS)
    try:
        d = _dictionary(bridge.cfg.d_model, 2 * bridge.cfg.d_model, seed=5)
        spliced = bridge.add_sae(d, hook_name="blocks.0.hook_out")
        assert "blocks.0.hook_out.hook_sae_acts_post" in bridge.hook_dict
    finally:
        bridge.close()
    spliced.remove()  # as a `finally:` after a failed run does
    assert "blocks.0.hook_out.hook_sae_acts_post" not in bridge.hook_dict


def test_the_engine_gemm_handles_of_a_dropped_dictionary_wait_for_a_safe_point() -> None:
    # vLLM's oneDNN handle frees itself by reading a tensor: freed by garbage collection
    # while torch.compile traces a later engine with fake tensors, it raised inside that
    # boot (seen as an unraisable exception failing an unrelated test). Handles of dropped
    # dictionaries are kept until the next attach or detach instead.
    import gc

    from tl_driver_vllm import _dictionaries

    gc.collect()  # earlier tests' engines and their dictionaries
    _dictionaries.release_retired_handles()
    encoder, decoder = _dictionaries.engine_linears(_dictionary(8, 16, seed=3))
    if encoder is None:
        pytest.skip("this vLLM build has no oneDNN GEMM")
    cycle: list[Any] = [encoder, decoder]
    cycle.append(cycle)  # freed only by the garbage collector, as an engine's objects are
    del encoder, decoder, cycle
    gc.collect()
    retired = list(_dictionaries._RETIRED)
    assert len(retired) == 2 and all(h.handler_tensor is not None for h in retired)
    del retired
    _dictionaries.release_retired_handles()
    assert _dictionaries._RETIRED == []
