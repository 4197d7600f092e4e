"""A spliced dictionary's sites: capture, feature edits, the error term, transcoders, several
dictionaries in one forward, and the errors raised before any forward pass.

The references are computed here from the dictionary's own tensors and plain hooks;
sae-lens itself is the reference in ``tests-peers/sae_lens``.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from tl_core import ConfigError, HookNameError, SpecError, TransformerBridge, UserError
from tl_core.sae import SparseDictionary, random_dictionary

SITES = ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_top_indices",
         "hook_sae_top_values", "hook_sae_recons", "hook_sae_error", "hook_sae_output")  # fmt: skip


def _dictionary(
    d_in: int, d_sae: int, d_out: int | None = None, seed: int = 0, **settings: Any
) -> SparseDictionary:
    return random_dictionary(d_in, d_sae, d_out=d_out, seed=seed, **settings)


@pytest.fixture(scope="module")
def llama() -> TransformerBridge:
    return TransformerBridge.boot_native("llama", n_layers=3, seed=2)


def _ids(bridge: TransformerBridge, batch: int = 2, length: int = 7) -> torch.Tensor:
    return torch.randint(
        0, bridge.cfg.d_vocab, (batch, length), generator=torch.Generator().manual_seed(5)
    )


def test_every_site_is_captured_and_holds_what_its_name_says(llama: TransformerBridge) -> None:
    d_model = llama.cfg.d_model
    d = _dictionary(
        d_model, 4 * d_model, architecture="jumprelu", normalize_activations="layer_norm"
    )
    ids = _ids(llama)
    spliced = llama.add_sae(d, hook_name="blocks.1.hook_resid_post", use_error_term=True, top_k=5)
    try:
        assert spliced.hook_name == "blocks.1.hook_out"
        # Aliases of the site reach its dictionary's sites too.
        assert llama.namespace.lookup(
            "blocks.1.hook_resid_post.hook_sae_acts_post"
        ) == spliced.site("hook_sae_acts_post")
        _, cache = llama.run_with_cache(
            ids, names_filter=lambda n: n.startswith("blocks.1.hook_out")
        )
    finally:
        spliced.remove()
    x = cache["blocks.1.hook_out"]
    got = {site: cache[f"blocks.1.hook_out.{site}"] for site in SITES}
    assert got["hook_sae_acts_post"].shape == (*ids.shape, 4 * d_model)
    assert (
        got["hook_sae_top_indices"].shape == (*ids.shape, 5)
        and got["hook_sae_top_indices"].dtype == torch.long
    )
    torch.testing.assert_close(got["hook_sae_input"], x)
    normed, _ = d.normalize(x)
    torch.testing.assert_close(got["hook_sae_acts_pre"], d.pre_activations(normed))
    torch.testing.assert_close(got["hook_sae_acts_post"], d.encode(x))
    values = d.encode(x).topk(5, dim=-1).values
    torch.testing.assert_close(got["hook_sae_top_values"], values)
    assert torch.equal(
        torch.gather(d.encode(x), -1, got["hook_sae_top_indices"]), got["hook_sae_top_values"]
    )
    torch.testing.assert_close(got["hook_sae_recons"], d.decode_linear(d.encode(x)))
    torch.testing.assert_close(got["hook_sae_error"], x - d.reconstruct(x))
    torch.testing.assert_close(got["hook_sae_output"], x, rtol=1e-5, atol=1e-5)
    assert llama.namespace.dictionaries == {}  # removed with its sites
    with pytest.raises(
        HookNameError, match=re.escape("no dictionary is attached at 'blocks.1.hook_out'")
    ):
        llama.namespace.lookup("blocks.1.hook_out.hook_sae_acts_post")


@pytest.mark.parametrize("use_error_term", [True, False])
def test_a_feature_edit_moves_the_site_by_the_decoders_image_of_the_edit(
    llama: TransformerBridge, use_error_term: bool
) -> None:
    d_model = llama.cfg.d_model
    d = _dictionary(d_model, 8 * d_model, seed=3)
    ids = _ids(llama, batch=3)
    spliced = llama.add_sae(d, hook_name="blocks.0.hook_out", use_error_term=use_error_term)
    # Ragged per-prompt edits: prompt 0 adds 3 to feature 5 at the last position, prompt 1
    # scales features 2 and 9 everywhere, prompt 2 is untouched.
    acts = spliced.site("hook_sae_acts_post")
    per_prompt: list[Any] = [
        {acts: {"op": "add", "value": 3.0, "features": 5, "pos": -1}},
        {acts: {"op": "scale", "factor": 0.0, "features": [2, 9]}},
        None,
    ]
    try:
        _, clean = llama.run_with_cache(
            ids, names_filter=[acts, "blocks.0.hook_out", "blocks.1.hook_in"]
        )
        _, edited = llama.run_with_cache(
            ids, names_filter=[acts, "blocks.1.hook_in"], intervene=per_prompt
        )
    finally:
        spliced.remove()
    before = (
        d.reconstruct(clean["blocks.0.hook_out"])
        if not use_error_term
        else clean["blocks.0.hook_out"]
    )
    torch.testing.assert_close(clean["blocks.1.hook_in"], before, rtol=1e-5, atol=1e-5)
    moved = edited["blocks.1.hook_in"] - clean["blocks.1.hook_in"]
    want = torch.zeros_like(moved)
    want[0, -1] = 3.0 * d.W_dec[5]
    kept = clean[acts][1, :, [2, 9]]
    want[1] = -(kept @ d.W_dec[[2, 9]])
    torch.testing.assert_close(moved, want, rtol=1e-5, atol=1e-5)
    assert kept.abs().sum() > 0  # the suppressed features were active


def test_a_transcoder_reads_one_site_and_writes_another(llama: TransformerBridge) -> None:
    d_model = llama.cfg.d_model
    t = _dictionary(d_model, 6 * d_model, seed=4, apply_b_dec_to_input=False, skip=True)
    assert t.is_transcoder
    ids = _ids(llama)
    read, write = "blocks.1.ln2.hook_normalized", "blocks.1.mlp.hook_out"
    seen: dict[str, torch.Tensor] = {}

    def remember(x: torch.Tensor, *, hook: Any) -> None:
        seen["in"] = x

    # The reference: plain hooks that read the input site and replace the output site.
    with llama.hooks([(read, remember), (write, lambda y, *, hook: t.reconstruct(seen["in"]))]):
        want = llama(ids)
    plain = llama(ids)
    spliced = llama.add_sae(t, hook_name=read, output_hook_name=write)
    try:
        got, cache = llama.run_with_cache(
            ids, names_filter=[spliced.site("hook_sae_output"), write]
        )
    finally:
        spliced.remove()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-3)
    # The output site's own hooks see the model's value; the rest of the model the transcoder's.
    torch.testing.assert_close(cache[spliced.site("hook_sae_output")], t.reconstruct(seen["in"]))
    with_error = llama.add_sae(t, hook_name=read, output_hook_name=write, use_error_term=True)
    try:
        torch.testing.assert_close(llama(ids), plain, rtol=1e-5, atol=1e-5)
    finally:
        with_error.remove()


def test_one_dictionary_per_layer_in_one_forward(llama: TransformerBridge) -> None:
    d_model = llama.cfg.d_model
    ids = _ids(llama)
    dictionaries = [_dictionary(d_model, 2 * d_model, seed=10 + i) for i in range(3)]

    def rebuild(x: torch.Tensor, *, hook: Any) -> torch.Tensor:
        return dictionaries[int(hook.name.split(".")[1])].reconstruct(x)

    with llama.hooks([(f"blocks.{i}.hook_out", rebuild) for i in range(3)]):
        want = llama(ids)
    splices = [
        llama.add_sae(d, hook_name=f"blocks.{i}.hook_out") for i, d in enumerate(dictionaries)
    ]
    try:
        got, cache = llama.run_with_cache(
            ids, names_filter=lambda n: n.endswith("hook_sae_acts_post")
        )
        assert sorted(cache.keys()) == [f"blocks.{i}.hook_out.hook_sae_acts_post" for i in range(3)]
    finally:
        for s in splices:
            s.remove()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_dictionary_on_flattened_heads_splices_at_hook_z(llama: TransformerBridge) -> None:
    cfg = llama.cfg
    width = cfg.n_heads * cfg.d_head
    d = _dictionary(width, 2 * width, seed=6, flatten_heads=True)
    ids = _ids(llama)

    def rebuild(z: torch.Tensor, *, hook: Any) -> torch.Tensor:
        return d.reconstruct(z.flatten(-2)).reshape(z.shape)

    with llama.hooks([("blocks.0.attn.hook_z", rebuild)]):
        want = llama(ids)
    spliced = llama.add_sae(d, hook_name="blocks.0.attn.hook_z")
    try:
        got, cache = llama.run_with_cache(ids, names_filter=[spliced.site("hook_sae_input")])
    finally:
        spliced.remove()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert cache[spliced.site("hook_sae_input")].shape == (*ids.shape, width)


def test_float32_dictionary_on_a_bfloat16_model() -> None:
    bridge = TransformerBridge.boot_native("llama", n_layers=2, seed=2, dtype=torch.bfloat16)
    d = _dictionary(bridge.cfg.d_model, 64, seed=7)
    ids = _ids(bridge)
    spliced = bridge.add_sae(d, hook_name="blocks.0.hook_out")
    try:
        logits, cache = bridge.run_with_cache(
            ids, names_filter=[spliced.site("hook_sae_acts_post"), "blocks.0.hook_out"]
        )
    finally:
        spliced.remove()
    assert cache[spliced.site("hook_sae_acts_post")].dtype == torch.float32
    assert cache["blocks.0.hook_out"].dtype == logits.dtype == torch.bfloat16
    torch.testing.assert_close(
        cache[spliced.site("hook_sae_acts_post")], d.encode(cache["blocks.0.hook_out"])
    )


def test_bad_input_is_refused_before_any_forward(llama: TransformerBridge) -> None:
    d_model = llama.cfg.d_model
    d = _dictionary(d_model, 16)
    ids = _ids(llama)
    with pytest.raises(ConfigError, match=r"reads width 8, but 'blocks.0.hook_out' has shape"):
        llama.add_sae(_dictionary(8, 16), hook_name="blocks.0.hook_out")
    with pytest.raises(ConfigError, match="names no output site"):
        llama.add_sae(
            _dictionary(d_model, 16, apply_b_dec_to_input=False, skip=True),
            hook_name="blocks.0.hook_out",
        )
    with pytest.raises(HookNameError, match=re.escape("blocks.9.mlp.hook_out")):
        llama.add_sae(_dictionary(d_model, 16, apply_b_dec_to_input=False, skip=True), hook_name="blocks.0.ln2.hook_normalized",
                      output_hook_name="blocks.9.mlp.hook_out")  # fmt: skip
    with pytest.raises(
        ConfigError, match=re.escape("forward pass reaches 'blocks.0.ln2.hook_normalized' first")
    ):
        llama.add_sae(_dictionary(d_model, 16, apply_b_dec_to_input=False, skip=True), hook_name="blocks.0.mlp.hook_out",
                      output_hook_name="blocks.0.ln2.hook_normalized")  # fmt: skip
    with pytest.raises(ConfigError, match=re.escape("top_k must be an int in 1..16")):
        llama.add_sae(d, hook_name="blocks.0.hook_out", top_k=17)
    with pytest.raises(HookNameError, match=re.escape("attach one first with bridge.add_sae")):
        llama(
            ids,
            intervene={"blocks.0.hook_out.hook_sae_acts_post": {"op": "suppress", "features": 1}},
        )
    with pytest.raises(HookNameError, match="'hook_sae_acts' is not a dictionary site"):
        llama.run_with_cache(ids, names_filter=["blocks.0.hook_out.hook_sae_acts"])
    spliced = llama.add_sae(d, hook_name="blocks.0.hook_out")
    try:
        with pytest.raises(
            SpecError, match=r"lists feature 16, out of range for this hook's 16 features"
        ):
            llama(
                ids,
                intervene={
                    spliced.site("hook_sae_acts_post"): {
                        "op": "add",
                        "value": 1.0,
                        "features": [3, 16],
                    }
                },
            )
        with pytest.raises(SpecError, match="cannot edit"):
            llama(ids, intervene={spliced.site("hook_sae_top_values"): {"op": "suppress"}})
        with pytest.raises(
            HookNameError,
            match=re.escape("a dictionary already reads or writes 'blocks.0.hook_out'"),
        ):
            llama.add_sae(d, hook_name="blocks.0.hook_out")
    finally:
        spliced.remove()


def test_features_select_neurons_on_any_site(llama: TransformerBridge) -> None:
    ids = _ids(llama)

    def ablate(x: torch.Tensor, *, hook: Any) -> torch.Tensor:
        x = x.clone()
        x[..., [4, 11]] = 0.0
        return x

    with llama.hooks([("blocks.1.mlp.hook_post", ablate)]):
        want = llama(ids)
    got = llama(ids, intervene={"blocks.1.mlp.hook_post": {"op": "suppress", "features": [4, 11]}})
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(SpecError, match="key 'features' does not apply to attention scores"):
        llama(ids, intervene={"blocks.0.attn.hook_pattern": {"op": "suppress", "features": 0}})


def test_evaluation_equals_the_quantities_computed_by_hand(llama: TransformerBridge) -> None:
    from tl_core.sae import evaluate_dictionary

    d_model = llama.cfg.d_model
    d = _dictionary(d_model, 4 * d_model, seed=8, architecture="jumprelu")
    hook = "blocks.1.hook_out"
    tokens = torch.randint(0, llama.cfg.d_vocab, (5, 9), generator=torch.Generator().manual_seed(1))

    def ce(logits: torch.Tensor) -> float:
        return float(
            torch.nn.functional.cross_entropy(
                logits[:, :-1].detach().flatten(0, 1).double(), tokens[:, 1:].flatten()
            )
        )

    with torch.no_grad():
        clean, cache = llama.run_with_cache(tokens, names_filter=[hook])
        x = cache[hook]
        with llama.hooks([(hook, lambda v, *, hook: d.reconstruct(v))]):
            spliced = llama(tokens)
        with llama.hooks([(hook, lambda v, *, hook: torch.zeros_like(v))]):
            zero = llama(tokens)
    # Every position scored: the special-token default has its own test (test_sae_evaluation).
    got = evaluate_dictionary(
        llama, d, tokens, hook_name=hook, batch_size=2, exclude_special_tokens=False
    )
    assert got.tokens == tokens.numel()
    assert got.ce_clean == pytest.approx(ce(clean), rel=1e-5)
    assert got.ce_splice == pytest.approx(ce(spliced), rel=1e-5)
    assert got.ce_zero == pytest.approx(ce(zero), rel=1e-5)
    assert got.ce_recovered == pytest.approx(
        (ce(zero) - ce(spliced)) / (ce(zero) - ce(clean)), rel=1e-4
    )
    p, q = (torch.log_softmax(t.double(), -1) for t in (clean, spliced))  # every position
    assert got.kl == pytest.approx(float((p.exp() * (p - q)).sum(-1).mean()), rel=1e-4)
    flat = x.flatten(0, 1).double()
    resid = (flat - d.reconstruct(x).flatten(0, 1).double()).pow(2).sum()
    assert got.explained_variance == pytest.approx(
        float(1 - resid / (flat - flat.mean(0)).pow(2).sum()), rel=1e-4
    )
    fired = d.encode(x) > 0
    assert got.l0 == pytest.approx(float(fired.sum(-1).double().mean()))
    assert torch.equal(got.feature_counts, fired.flatten(0, 1).sum(0))
    assert got.dead_features == int((fired.flatten(0, 1).sum(0) == 0).sum())
    assert "CE recovered" in str(got)
    assert not llama.namespace.dictionaries  # attached for the evaluation only
    with pytest.raises(UserError, match="at least 2 positions"):
        evaluate_dictionary(llama, d, tokens[:, :1], hook_name=hook)
