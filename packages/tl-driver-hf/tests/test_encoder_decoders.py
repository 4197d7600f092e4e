"""Encoder-decoders (T5, BART and descendants) on the hf driver, against plain transformers.

The references are transformers alone: forward pre-hooks record what each of its blocks
receives, ``output_attentions`` gives its attention probabilities, its own ``generate``
and label loss, and plain torch hooks make the same edits tl's specs make.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModelForSeq2SeqLM

from tl_core import HookNameError, SpecError, TransformerBridge, UnsupportedFeatureError, UserError
from tl_core.analysis import attribution_patch, logit_diff_metric
from tl_core.analysis._attribution import default_node_sites
from tl_driver_hf import HFDriver
from tl_driver_hf._seq2seq._certify import certify_seq2seq
from tl_driver_hf._seq2seq._driver import Seq2SeqDriver
from tl_driver_hf._seq2seq._layout import Site
from tl_driver_hf.testing import write_seq2seq_checkpoint

# The plain-hook references, loaded by path (tests are imported in importlib mode).
_hooks_spec = importlib.util.spec_from_file_location(
    "_hf_plain_hooks", Path(__file__).with_name("_plain_hooks.py")
)
assert _hooks_spec is not None and _hooks_spec.loader is not None
_plain_hooks = importlib.util.module_from_spec(_hooks_spec)
_hooks_spec.loader.exec_module(_plain_hooks)
layer_inputs = _plain_hooks.layer_inputs

#: model type -> config overrides: T5 (pre-LN RMS, relative bias), T5 v1.1 (gated MLP),
#: BART and Marian (post-LN, learned positions), mBART (pre-LN with a final norm), and
#: two with mixtures of experts in some blocks' MLPs: Switch Transformers (T5's form) and
#: NLLB-MoE (BART's form, with its MLP in an ``ffn`` module).
TYPES: dict[str, dict[str, Any]] = {
    "t5": {},
    "t5-gated": {"feed_forward_proj": "gated-gelu"},
    "bart": {},
    "marian": {},
    "mbart": {},
    "switch_transformers": {"num_experts": 4, "num_sparse_encoder_layers": 1,
                            "num_sparse_decoder_layers": 1},
    "nllb-moe": {"num_experts": 4, "encoder_sparse_step": 2, "decoder_sparse_step": 2},
}  # fmt: skip
PROMPTS = ["the cat sat", "a b"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("seq2seq")
    return {
        name: write_seq2seq_checkpoint(
            name.removesuffix("-gated"), root / name, overrides=overrides
        )
        for name, overrides in TYPES.items()
    }


@pytest.fixture(scope="module")
def bridges(folders: dict[str, Path]) -> dict[str, TransformerBridge]:
    return {name: TransformerBridge.boot_transformers(str(f)) for name, f in folders.items()}


def _plain_inputs(bridge: TransformerBridge, decoder: str) -> dict[str, torch.Tensor]:
    rows = [bridge.to_tokens(p)[0] for p in PROMPTS]
    ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    start = bridge.driver.decoder_start_ids
    dec = torch.tensor([[*start, *bridge.tokenizer.encode(decoder)]] * len(rows))
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec}


def _layers(model: nn.Module, getter: str) -> list[nn.Module]:
    stack = getattr(model, getter)()
    return list(getattr(stack, "block", None) or stack.layers)


@pytest.mark.parametrize("name", sorted(TYPES))
def test_boots_whole_with_every_weight_and_every_site_certified(
    name: str, folders: dict[str, Path], bridges: dict[str, TransformerBridge]
) -> None:
    driver = bridges[name].driver
    assert isinstance(driver, Seq2SeqDriver)
    certification = driver.certification
    assert certification is not None and not certification.failed
    assert certification.level == "full"
    assert driver.certify() is certification  # tl certify: every check ran at boot
    plain = AutoModelForSeq2SeqLM.from_pretrained(folders[name])
    ours = driver.hf_model.state_dict()
    for key, value in plain.state_dict().items():
        assert torch.equal(ours[key], value), key
    names = list(bridges[name].hook_dict)
    assert not any(n.startswith("blocks.") for n in names)
    assert {"encoder_blocks.2.hook_out", "decoder_blocks.1.cross_attn.hook_z"} <= set(names)
    assert "encoder_blocks.0.cross_attn.hook_z" not in names
    assert driver.info.post_residual_norm == (name in ("bart", "marian"))


@pytest.mark.parametrize("name", sorted(TYPES))
def test_block_inputs_patterns_and_logits_equal_plain_transformers(
    name: str, bridges: dict[str, TransformerBridge]
) -> None:
    bridge = bridges[name]
    model = bridge.driver.hf_model
    inputs = _plain_inputs(bridge, "hi there")
    encoder_in: list[torch.Tensor] = []
    decoder_in: list[torch.Tensor] = []
    with torch.no_grad():
        with layer_inputs(_layers(model, "get_encoder"), encoder_in):
            with layer_inputs(_layers(model, "get_decoder"), decoder_in):
                plain = model(**inputs, output_attentions=True)
        logits, cache = bridge.run_with_cache(PROMPTS, decoder_input="hi there")
    torch.testing.assert_close(logits, plain.logits, rtol=1e-4, atol=1e-5)
    for i, want in enumerate(encoder_in):
        # Padded positions differ only where the mask hides them: compare real ones.
        got = cache[f"encoder_blocks.{i}.hook_in"]
        mask = inputs["attention_mask"].bool()
        torch.testing.assert_close(got[mask], want[mask], rtol=1e-4, atol=1e-5)
    for i, want in enumerate(decoder_in):
        torch.testing.assert_close(cache[f"decoder_blocks.{i}.hook_in"], want, rtol=1e-4, atol=1e-5)
    for i, want in enumerate(plain.cross_attentions):
        torch.testing.assert_close(cache[f"decoder_blocks.{i}.cross_attn.hook_pattern"], want)
    for i, want in enumerate(plain.encoder_attentions):
        torch.testing.assert_close(cache[f"encoder_blocks.{i}.attn.hook_pattern"], want)


@pytest.mark.parametrize("name", sorted(TYPES))
@pytest.mark.parametrize("stack", ["encoder", "decoder"])
def test_an_add_at_block_1_equals_a_plain_pre_hook(
    name: str, stack: str, bridges: dict[str, TransformerBridge]
) -> None:
    bridge = bridges[name]
    model = bridge.driver.hf_model
    inputs = _plain_inputs(bridge, "hi")
    vector = torch.randn(bridge.cfg.d_model, generator=torch.Generator().manual_seed(3))
    layer = _layers(model, f"get_{stack}")[1]

    def add(m: nn.Module, a: tuple[Any, ...], k: dict[str, Any]) -> Any:
        if a:
            return (a[0] + vector, *a[1:]), k
        return a, {**k, "hidden_states": k["hidden_states"] + vector}

    handle = layer.register_forward_pre_hook(add, with_kwargs=True)
    try:
        with torch.no_grad():
            want = model(**inputs).logits
    finally:
        handle.remove()
    spec = {f"{stack}_blocks.1.hook_in": {"op": "add", "value": vector}}
    got = bridge.forward(PROMPTS, decoder_input="hi", intervene=spec)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (got - bridge.forward(PROMPTS, decoder_input="hi")).abs().max() > 1e-3


def test_a_decoder_position_edit_follows_the_decoder_s_positions(
    bridges: dict[str, TransformerBridge],
) -> None:
    bridge = bridges["t5"]
    model = bridge.driver.hf_model
    inputs = _plain_inputs(bridge, "hi")  # decoder: start + 2 tokens = 3 positions
    site = bridge.driver.stacks[1].sites[0]["cross_attn.hook_out"].module

    def zero_position_1(m: nn.Module, a: tuple[Any, ...], out: Any) -> Any:
        edited = out[0].clone()
        edited[:, 1] = 0
        return (edited, *out[1:])

    handle = site.register_forward_hook(zero_position_1)
    try:
        with torch.no_grad():
            want = model(**inputs).logits
    finally:
        handle.remove()
    spec = {"decoder_blocks.0.cross_attn.hook_out": {"op": "suppress", "pos": 1}}
    got = bridge.forward(PROMPTS, decoder_input="hi", intervene=spec)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # Position 3 exists in the prompts (the encoder's), not in the 3-token decoder input.
    prompts = ["the cat sat", "a b c"]
    edit = {"op": "suppress", "pos": 3}
    bridge.forward(prompts, decoder_input="hi", intervene={"encoder_blocks.0.hook_out": edit})
    with pytest.raises(SpecError, match="position 3, out of range for a prompt of length 3"):
        bridge.forward(prompts, decoder_input="hi", intervene={"decoder_blocks.0.hook_out": edit})


@pytest.mark.parametrize("name", ["t5", "bart", "mbart"])
def test_generation_equals_transformers_greedy_decoding(
    name: str, bridges: dict[str, TransformerBridge]
) -> None:
    bridge = bridges[name]
    model = bridge.driver.hf_model
    ids = bridge.to_tokens(PROMPTS[0])
    with torch.no_grad():
        # Plain greedy decoding: no forced EOS at the length limit (BART's default).
        want = model.generate(
            input_ids=ids, max_new_tokens=6, do_sample=False, forced_eos_token_id=None
        )
    got = bridge.generate(ids, max_new_tokens=6, stop_at_eos=True)
    assert isinstance(got, torch.Tensor)
    n = min(got.shape[1], want.shape[1] - 1)
    assert got[0, :n].tolist() == want[0, 1 : n + 1].tolist()


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_the_loss_is_the_decoder_s_and_equals_the_label_loss(
    name: str, bridges: dict[str, TransformerBridge]
) -> None:
    bridge = bridges[name]
    model = bridge.driver.hf_model
    ids = bridge.to_tokens(PROMPTS[0])
    labels = torch.tensor([bridge.tokenizer.encode("hi there")])
    start = list(bridge.driver.decoder_start_ids)
    with torch.no_grad():
        want = model(
            input_ids=ids,
            decoder_input_ids=torch.tensor([start + labels[0, :-1].tolist()]),
            labels=labels,
        ).loss
    got = bridge.forward(ids, "loss", decoder_input=[start + labels[0].tolist()])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_gradients_flow_through_cross_attention_as_finite_differences_say(
    folders: dict[str, Path],
) -> None:
    bridge = TransformerBridge.boot_transformers(str(folders["t5"]), dtype=torch.float64)
    name = "decoder_blocks.0.cross_attn.hook_out"
    _, cache = bridge.run_with_cache(
        PROMPTS[0], decoder_input="hi there", names_filter=[name], incl_bwd=True, return_type="loss"
    )
    grad = cache.grads[name]
    direction = torch.randn(
        grad.shape, generator=torch.Generator().manual_seed(4), dtype=grad.dtype
    )
    targets = torch.tensor(bridge.tokenizer.encode("hi there"))
    eps = 1e-3  # T5 takes its norms' variance in float32: smaller steps drown in rounding

    def loss(sign: float) -> float:
        # The label loss in float64 (the bridge's loss is taken in float32).
        rows = (sign * eps * direction[0]).tolist()
        spec = {name: {"op": "add", "value": rows, "pos": list(range(len(rows)))}}
        with torch.no_grad():
            logits = bridge.forward(PROMPTS[0], decoder_input="hi there", intervene=spec)
        log_probs = torch.log_softmax(logits[0, :-1], dim=-1)
        return float(-log_probs[torch.arange(len(targets)), targets].mean())

    numeric = (loss(1.0) - loss(-1.0)) / (2 * eps)
    assert float((grad * direction).sum()) == pytest.approx(numeric, rel=1e-4)
    assert abs(numeric) > 1e-4


def test_a_site_read_from_the_wrong_module_is_not_served(folders: dict[str, Path]) -> None:
    """Fault injection: certification must catch a site wired to the wrong tensor."""
    driver = HFDriver.boot(str(folders["t5"]))
    assert isinstance(driver, Seq2SeqDriver)
    wrong = "encoder_blocks.1.attn.hook_out"
    norm = driver.stacks[0].sites[1]["ln1.hook_out"].module
    driver._sites[wrong] = Site(norm, "out")  # attention's output read at its norm
    certification = certify_seq2seq(driver, name="faulty")
    assert any(wrong in c.hooks for c in certification.failed)
    assert wrong not in driver.hook_points
    assert certification.statuses[wrong].status == "uncertified"


def test_bad_inputs_are_refused_with_what_to_do(
    bridges: dict[str, TransformerBridge], checkpoint: Callable[[str], Path]
) -> None:
    bridge = bridges["bart"]
    with pytest.raises(HookNameError, match=r"encoder_blocks\.\{i\} \(3 blocks\)"):
        bridge.run_with_cache(PROMPTS, names_filter=["blocks.0.hook_out"])
    with pytest.raises(UnsupportedFeatureError, match="different lengths"):
        bridge.generate(PROMPTS, max_new_tokens=2, decoder_input=[[2], [2, 5]])
    with pytest.raises(UserError, match="decoder_input holds 3 sequences for 2 prompts"):
        bridge.forward(PROMPTS, decoder_input=[[2], [2], [2]])
    with pytest.raises(UserError, match="start_at_layer"):
        bridge.forward(PROMPTS, stop_at_layer=1)
    causal = TransformerBridge.boot_transformers(str(checkpoint("llama")))
    with pytest.raises(UserError, match="decoder_input feeds an encoder-decoder"):
        causal.forward("hello", decoder_input="hi")


#: Attribution nodes in each stack, cross-attention's heads and its keys (which lie over
#: the encoder's positions although they sit in a decoder block).
AP_SITES = [
    "encoder_blocks.1.hook_in",
    "encoder_blocks.0.attn.hook_z",
    "decoder_blocks.1.hook_in",
    "decoder_blocks.1.cross_attn.hook_z",
    "decoder_blocks.0.cross_attn.hook_k",
    "decoder_blocks.1.mlp.hook_out",
]


@pytest.mark.parametrize("site", AP_SITES)
def test_attribution_patching_through_cross_attention_equals_finite_differences(
    site: str, folders: dict[str, Path]
) -> None:
    # The gated-GELU MLP of T5 v1.1: ReLU's kinks would make finite differences jump.
    bridge = TransformerBridge.boot_transformers(str(folders["t5-gated"]), dtype=torch.float64)
    clean = [bridge.to_tokens(p)[0].tolist() for p in PROMPTS]
    corrupt = [[(t * 7 + 3) % 200 + 4 for t in row] for row in clean]
    # Ragged on both sides: the metric must read each decoder row at its own last token.
    decoder = ["hi there", "yo"]
    metric = logit_diff_metric(5, 9)
    result = attribution_patch(bridge, clean, corrupt, metric, sites=[site], decoder_input=decoder)

    def values(prompts: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            _, cache = bridge.run_with_cache(prompts, names_filter=[site], decoder_input=decoder)
        return cache[site]

    a_clean, a_corrupt = values(clean), values(corrupt)
    lengths = [len(bridge.tokenizer.encode(d)) + 1 for d in decoder]

    def central(step: float) -> torch.Tensor:
        def shifted(sign: float) -> torch.Tensor:
            value = a_corrupt + sign * step * (a_clean - a_corrupt)
            with torch.no_grad():
                logits = bridge.run_with_hooks(
                    corrupt, fwd_hooks=[(site, lambda x, hook: value)], decoder_input=decoder
                )
            return metric(logits, lengths=lengths)

        return (shifted(1.0) - shifted(-1.0)) / (2 * step)

    # T5 takes its norms' variance in float32, so steps small enough to hide the softmax's
    # curvature drown in rounding: Richardson's extrapolation of two steps cancels the
    # curvature instead.
    directional = (4 * central(1e-3) - central(2e-3)) / 3
    got = result.nodes_per_pair[site].flatten(1).sum(1)
    torch.testing.assert_close(got, directional, rtol=1e-3, atol=1e-5)
    assert directional.abs().max() > 1e-5


def test_attribution_defaults_cover_both_stacks_and_edges_are_refused(
    bridges: dict[str, TransformerBridge],
) -> None:
    bridge = bridges["bart"]
    sites = default_node_sites(bridge)
    assert {s.split(".")[0] for s in sites} == {"encoder_blocks", "decoder_blocks"}
    assert "decoder_blocks.1.cross_attn.hook_z" in sites
    assert "encoder_blocks.0.cross_attn.hook_z" not in sites
    ids = bridge.to_tokens(PROMPTS[0])
    result = attribution_patch(bridge, ids, ids.flip(1), logit_diff_metric(5, 9))
    assert set(result.nodes) == set(sites)
    with pytest.raises(UnsupportedFeatureError, match="two joined by cross-attention"):
        attribution_patch(bridge, ids, ids, logit_diff_metric(5, 9), granularity="edge")


def test_capture_stores_the_encoder_s_sites_and_refuses_the_decoder_s(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    """A store holds one row per corpus token: the encoder's, and cross-attention's keys
    (over the encoder's positions); decoder positions are refused before anything is
    written. Each row equals run_with_cache of its context alone."""
    from tl_core.capture import CaptureConfig, CaptureStore, capture

    text = tmp_path / "docs.txt"
    text.write_text("the cat sat on the mat\nhello world\n")
    hooks = ("encoder_blocks.1.hook_out", "decoder_blocks.0.cross_attn.hook_k")
    config = CaptureConfig(
        model=str(folders["t5"]), driver="hf", hooks=hooks, input=str(text), context_size=8,
        batch_size=2, pack=False,
    )  # fmt: skip
    assert capture(config, tmp_path / "store", progress=False).complete
    store = CaptureStore(tmp_path / "store")
    bridge = TransformerBridge.boot_transformers(str(folders["t5"]))
    tokens, contexts = store.read("tokens"), store.read("contexts")
    for i in range(int(contexts.max()) + 1):
        rows = (contexts == i).nonzero().flatten()
        ids = tokens[rows].tolist()
        _, cache = bridge.run_with_cache([ids], names_filter=list(hooks), prepend_bos=False)
        for hook in hooks:
            got = store.read(hook, int(rows[0]), int(rows[-1]) + 1)
            torch.testing.assert_close(got, cache[hook][0], atol=2e-5, rtol=1e-5)
    decoder = dataclasses.replace(config, hooks=("decoder_blocks.1.hook_out",))
    with pytest.raises(UserError, match=r"lie over the decoder's positions.*nothing was written"):
        capture(decoder, tmp_path / "refused", progress=False)
    assert not (tmp_path / "refused").exists()
