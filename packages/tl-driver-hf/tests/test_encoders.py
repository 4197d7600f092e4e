"""Masked LMs (encoders) on the hf driver, against plain transformers.

A ``BertForMaskedLM`` or ``RobertaForMaskedLM`` checkpoint boots as that class, whole, and is
described as a masked LM with one bidirectional stack. The references are transformers
alone: each block's input is what a forward pre-hook on the encoder layer receives, the
logits are ``AutoModelForMaskedLM``'s, an ``add`` spec equals the same add made by a plain
pre-hook, and a prompt in a ragged batch gets what it gets alone (its padding is masked).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    BertLMHeadModel,
    BertTokenizerFast,
    RobertaConfig,
    RobertaForCausalLM,
    RobertaForMaskedLM,
)

from tl_core import TransformerBridge, UnsupportedFeatureError, UserError
from tl_core.capture import CaptureConfig, CaptureStore, capture
from tl_core.sae import random_dictionary, splice
from tl_driver_hf import HFDriver

# The plain-hook references, loaded by path (tests are imported in importlib mode).
_hooks_spec = importlib.util.spec_from_file_location(
    "_hf_plain_hooks", Path(__file__).with_name("_plain_hooks.py")
)
assert _hooks_spec is not None and _hooks_spec.loader is not None
_plain_hooks = importlib.util.module_from_spec(_hooks_spec)
_hooks_spec.loader.exec_module(_plain_hooks)
layer_inputs = _plain_hooks.layer_inputs

_SIZES: dict[str, Any] = {
    "vocab_size": 200, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    "intermediate_size": 64, "max_position_embeddings": 40,
}  # fmt: skip
_PROMPTS = [[5, 17, 42, 9, 120, 33, 7], [11, 60, 4]]


def _write(model: nn.Module, folder: Path) -> Path:
    torch.manual_seed(0)
    for p in model.parameters():  # untrained norms and biases hide mistakes: move them
        p.data.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(**_SIZES))
    return _write(model, tmp_path_factory.mktemp("bert") / "bert")


@pytest.fixture(scope="module")
def roberta(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    # RoBERTa numbers positions from pad_token_id + 1, from the ids themselves.
    model = RobertaForMaskedLM(RobertaConfig(**{**_SIZES, "pad_token_id": 1}))
    return _write(model, tmp_path_factory.mktemp("roberta") / "roberta")


def _plain(folder: Path, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor], nn.Module]:
    model = AutoModelForMaskedLM.from_pretrained(folder, attn_implementation="eager").eval()
    layers = model.base_model.encoder.layer
    seen: list[torch.Tensor] = []
    with layer_inputs(layers, seen), torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    return logits, seen, model


def _with_layer_input(
    folder: Path, ids: list[int], layer: int, change: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """transformers' logits with encoder layer ``layer``'s input changed by a plain pre-hook."""
    _, _, model = _plain(folder, ids)

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return (change(args[0]), *args[1:]), kwargs

    target = model.base_model.encoder.layer[layer]
    handle = target.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits  # type: ignore[no-any-return]
    finally:
        handle.remove()


@pytest.mark.parametrize("which", ["bert", "roberta"])
def test_a_masked_lm_boots_as_itself_and_is_described_as_an_encoder(
    which: str, request: pytest.FixtureRequest
) -> None:
    folder = request.getfixturevalue(which)
    driver = HFDriver.boot(str(folder))
    built = {"bert": "BertForMaskedLM", "roberta": "RobertaForMaskedLM"}[which]
    assert type(driver.hf_model).__name__ == built
    architecture = driver.architecture
    assert architecture.kind == "masked_lm"
    assert [s.attention for s in architecture.stacks] == ["bidirectional"]
    assert architecture.embed_norm  # word + position + token-type rows, then a LayerNorm
    # Post-LN blocks: each residual sum normalised, the norms measured as LayerNorms.
    assert architecture.block == "post_residual_norm"
    assert architecture.norm.kind == "layernorm"
    assert driver.info.post_residual_norm
    assert driver.certification is not None and driver.certification.level == "full"
    # The embedding norm's output is the stream's start; its input (word + position +
    # token-type rows) is vouched for by the norm's own equation.
    cert = driver.certification
    assert {"embed_ln.hook_in", "embed_ln.hook_scale", "embed_ln.hook_out"} <= set(cert.served)
    assert not cert.failed
    assert architecture.facts()["model"] == "masked lm: blocks (bidirectional attention)"
    cert = driver.certification
    assert cert is not None
    direction = [c for c in cert.checks if "attends both ways" in c.equation]
    assert len(direction) == 1 and direction[0].passed
    assert not [c for c in cert.checks if "(the model is causal)" in c.equation]


@pytest.mark.parametrize("which", ["bert", "roberta"])
def test_each_prompt_of_a_ragged_batch_gets_what_transformers_gives_it_alone(
    which: str, request: pytest.FixtureRequest
) -> None:
    folder = request.getfixturevalue(which)
    bridge = TransformerBridge(HFDriver.boot(str(folder)))
    names = [f"blocks.{i}.hook_in" for i in range(2)] + ["blocks.1.hook_out"]
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(_PROMPTS, names_filter=names)
    for row, ids in enumerate(_PROMPTS):
        want_logits, layer_inputs, _ = _plain(folder, ids)
        n = len(ids)
        torch.testing.assert_close(logits[row, :n], want_logits[0], rtol=1e-5, atol=1e-5)
        for i, want in enumerate(layer_inputs):
            torch.testing.assert_close(
                cache[f"blocks.{i}.hook_in"][row, :n], want[0], rtol=1e-5, atol=1e-5
            )


def test_the_padding_mask_is_what_keeps_a_short_prompt_whole(bert: Path) -> None:
    """Fault injection: without the mask a short prompt reads its padding (an encoder reads
    every position), so the ragged check above can fail."""
    driver = HFDriver.boot(str(bert))
    short = _PROMPTS[1]
    padded = torch.tensor([short + [0] * 4])
    with torch.no_grad():
        unmasked = driver.run_model(padded)
        masked = driver.run_model(padded, attention_mask=torch.tensor([[1, 1, 1, 0, 0, 0, 0]]))
    want, _, _ = _plain(bert, short)
    torch.testing.assert_close(masked[0, :3], want[0], rtol=1e-5, atol=1e-5)
    assert (unmasked[0, :3] - want[0]).abs().max() > 1e-3


def test_an_add_at_a_block_equals_the_same_add_by_a_plain_pre_hook(bert: Path) -> None:
    bridge = TransformerBridge(HFDriver.boot(str(bert)))
    ids = _PROMPTS[0]
    vector = torch.randn(_SIZES["hidden_size"], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        edited = bridge(
            torch.tensor([ids]), intervene={"blocks.1.hook_in": {"op": "add", "value": vector}}
        )
    want = _with_layer_input(bert, ids, 1, lambda x: x + vector)
    torch.testing.assert_close(edited, want, rtol=1e-5, atol=1e-5)


def _plain_sites(folder: Path, ids: list[int], layer: int) -> dict[str, torch.Tensor]:
    """What transformers' own modules of encoder layer ``layer`` read and return, by the tl
    name of each (forward hooks on the modules, patterns from ``output_attentions``)."""
    _, _, model = _plain(folder, ids)
    block = model.base_model.encoder.layer[layer]
    seen: dict[str, torch.Tensor] = {}

    def output_of(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            seen[name] = (output[0] if isinstance(output, tuple) else output).detach()

        return hook

    def input_of(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            seen[name] = args[0].detach()

        return hook

    handles = [
        block.attention.output.dense.register_forward_hook(output_of("attn.hook_out")),
        block.attention.output.dense.register_forward_pre_hook(input_of("attn.hook_z")),
        block.attention.output.LayerNorm.register_forward_pre_hook(input_of("ln1.hook_in")),
        block.attention.register_forward_hook(output_of("ln1.hook_out")),
        block.intermediate.dense.register_forward_pre_hook(input_of("mlp.hook_in")),
        block.intermediate.dense.register_forward_hook(output_of("mlp.hook_pre")),
        block.output.dense.register_forward_pre_hook(input_of("mlp.hook_post")),
        block.output.dense.register_forward_hook(output_of("mlp.hook_out")),
        block.output.LayerNorm.register_forward_pre_hook(input_of("ln2.hook_in")),
        block.register_forward_hook(output_of("hook_out")),
    ]
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    seen["attn.hook_pattern"] = out.attentions[layer]
    seen["attn.hook_z"] = seen["attn.hook_z"].unflatten(-1, (_SIZES["num_attention_heads"], -1))
    return seen


@pytest.mark.parametrize("which", ["bert", "roberta"])
def test_every_site_inside_a_post_ln_block_is_what_transformers_modules_hold(
    which: str, request: pytest.FixtureRequest
) -> None:
    """BERT normalises each residual sum (``h = ln1(x + attn(x)); out = ln2(h + mlp(h))``):
    attention's output is its projection's, ln1 reads the sum and feeds the MLP, ln2's
    output is the block's."""
    folder = request.getfixturevalue(which)
    bridge = TransformerBridge(HFDriver.boot(str(folder)))
    ids = _PROMPTS[0]
    _, cache = bridge.run_with_cache(torch.tensor([ids]))
    for layer in range(_SIZES["num_hidden_layers"]):
        want = _plain_sites(folder, ids, layer)
        for site, value in want.items():
            torch.testing.assert_close(
                cache[f"blocks.{layer}.{site}"], value, rtol=1e-5, atol=1e-5, msg=site
            )
    # HookedEncoder's resid_mid is the sum ln1 normalises; resid_post the block's output.
    b = "blocks.1."
    torch.testing.assert_close(
        cache[b + "hook_resid_mid"], cache[b + "hook_in"] + cache[b + "attn.hook_out"]
    )
    torch.testing.assert_close(cache[b + "hook_resid_post"], cache["blocks.1.hook_out"])


@pytest.mark.parametrize("which", ["bert", "roberta"])
def test_the_mlm_head_transform_is_served_as_transformers_runs_it(
    which: str, request: pytest.FixtureRequest
) -> None:
    """dense, activation, LayerNorm, then the unembedding: mlm_head.* and ln_final.* hold what
    the head's modules read and return, and an edit at its input equals a plain pre-hook."""
    folder = request.getfixturevalue(which)
    bridge = TransformerBridge(HFDriver.boot(str(folder)))
    ids = torch.tensor([_PROMPTS[0]])
    _, _, model = _plain(folder, _PROMPTS[0])
    dense, norm = (
        (model.cls.predictions.transform.dense, model.cls.predictions.transform.LayerNorm)
        if which == "bert"
        else (model.lm_head.dense, model.lm_head.layer_norm)
    )
    seen: dict[str, torch.Tensor] = {}
    handles = [
        dense.register_forward_pre_hook(lambda m, a: seen.setdefault("mlm_head.hook_in", a[0])),
        dense.register_forward_hook(lambda m, a, o: seen.setdefault("mlm_head.hook_out", o)),
        norm.register_forward_pre_hook(lambda m, a: seen.setdefault("ln_final.hook_in", a[0])),
        norm.register_forward_hook(lambda m, a, o: seen.setdefault("ln_final.hook_out", o)),
    ]
    with torch.no_grad():
        model(input_ids=ids)
    for handle in handles:
        handle.remove()
    _, cache = bridge.run_with_cache(ids)
    for name, value in seen.items():
        torch.testing.assert_close(cache[name], value, rtol=1e-5, atol=1e-5, msg=name)
    torch.testing.assert_close(cache["mlm_head.hook_in"], cache["blocks.1.hook_out"])
    assert bridge.namespace.lookup("unembed.hook_in") == "ln_final.hook_out"
    vector = torch.randn(_SIZES["hidden_size"], generator=torch.Generator().manual_seed(7))
    handle = dense.register_forward_pre_hook(lambda m, a: (a[0] + vector,))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    handle.remove()
    with torch.no_grad():
        got = bridge(ids, intervene={"mlm_head.hook_in": {"op": "add", "value": vector}})
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_head_ablation_and_an_add_before_a_norm_equal_plain_torch_hooks(bert: Path) -> None:
    bridge = TransformerBridge(HFDriver.boot(str(bert)))
    ids = _PROMPTS[0]
    vector = torch.randn(_SIZES["hidden_size"], generator=torch.Generator().manual_seed(5))
    _, _, model = _plain(bert, ids)
    block = model.base_model.encoder.layer[0]
    d_head = _SIZES["hidden_size"] // _SIZES["num_attention_heads"]
    head_1 = list(range(d_head, 2 * d_head))  # head 1's slice of the flattened hook_z

    def ablate_head_1(module: nn.Module, args: tuple[Any, ...]) -> Any:
        z = args[0].clone()
        z[..., d_head : 2 * d_head] = 0.0
        return (z,)

    def add(module: nn.Module, args: tuple[Any, ...]) -> Any:
        return (args[0] + vector,)

    for spec, module, hook in (
        ({"blocks.0.attn.hook_z": {"op": "suppress", "features": head_1}}, block.attention.output.dense, ablate_head_1),
        ({"blocks.0.ln2.hook_in": {"op": "add", "value": vector}}, block.output.LayerNorm, add),
        ({"blocks.0.ln1.hook_in": {"op": "add", "value": vector}}, block.attention.output.LayerNorm, add),
    ):  # fmt: skip
        handle = module.register_forward_pre_hook(hook)
        try:
            with torch.no_grad():
                want = model(input_ids=torch.tensor([ids])).logits
        finally:
            handle.remove()
        with torch.no_grad():
            got = bridge(torch.tensor([ids]), intervene=spec)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=str(spec))
        assert (got - bridge(torch.tensor([ids]))).abs().max() > 1e-3  # the edit did something


def test_analyses_of_a_running_residual_sum_are_refused_on_post_ln_blocks(bert: Path) -> None:
    """BERT renormalises its stream after every sublayer: no block input is a sum of earlier
    outputs, so decomposing it (or normalising a stack with a cached scale) would be wrong."""
    bridge = TransformerBridge(HFDriver.boot(str(bert)))
    _, cache = bridge.run_with_cache(torch.tensor([_PROMPTS[0]]))
    with pytest.raises(UserError, match="normalises it after every sublayer"):
        cache.decompose_resid(layer=1)
    with pytest.raises(UserError, match="post-LN blocks"):
        cache.apply_ln_to_stack(cache.accumulated_resid(layer=1), layer=1)
    # Stacking the stream itself stays meaningful.
    assert cache.accumulated_resid(layer=1).shape[0] == 2


def test_generating_from_a_masked_lm_is_refused_with_the_reason(bert: Path) -> None:
    bridge = TransformerBridge(HFDriver.boot(str(bert)))
    with pytest.raises(UnsupportedFeatureError, match="is a masked LM: it predicts each"):
        bridge.generate(torch.tensor([_PROMPTS[0]]), max_new_tokens=3)


def test_a_bert_decoder_checkpoint_stays_a_causal_lm(tmp_path: Path) -> None:
    """``BertLMHeadModel`` with ``is_decoder=True`` is a causal LM: described and certified
    as one (its earlier logits ignore a change of the last token)."""
    torch.manual_seed(0)
    folder = _write(BertLMHeadModel(BertConfig(**_SIZES, is_decoder=True)), tmp_path / "dec")
    driver = HFDriver.boot(str(folder))
    assert type(driver.hf_model).__name__ == "BertLMHeadModel"
    assert driver.architecture.kind == "causal_lm"
    assert [s.attention for s in driver.architecture.stacks] == ["causal"]
    cert = driver.certification
    assert cert is not None
    assert [c.passed for c in cert.checks if "(the model is causal)" in c.equation] == [True]


_WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "capital", "of", "france", "is"]
_WORDS += ["paris", ".", "a", "cat", "sat"]


def test_a_prompt_is_encoded_as_the_encoders_own_tokenizer_encodes_it(tmp_path: Path) -> None:
    """``[CLS] text [SEP]``: the closing token an encoder was trained with is part of every
    prompt (``to_tokens`` used to stop after the text), and the mask token's logits are
    transformers' own."""
    folder = tmp_path / "bert"
    BertTokenizerFast(vocab={w: i for i, w in enumerate(_WORDS)}).save_pretrained(folder)
    torch.manual_seed(0)
    _write(BertForMaskedLM(BertConfig(**{**_SIZES, "vocab_size": len(_WORDS)})), folder)
    own = AutoTokenizer.from_pretrained(folder)
    bridge = TransformerBridge(HFDriver.boot(str(folder)))
    texts = ["the capital of france is [MASK] .", "a cat sat"]
    for text in texts:
        assert bridge.to_tokens(text)[0].tolist() == own(text)["input_ids"]
    assert bridge.to_str_tokens(texts[1]) == ["[CLS]", "a", "cat", "sat", "[SEP]"]
    assert bridge.to_tokens(texts[1], prepend_bos=False)[0].tolist() == own.encode(
        texts[1], add_special_tokens=False
    )
    ids = own(texts[0])["input_ids"]
    at = ids.index(own.mask_token_id)
    with torch.no_grad():
        logits = bridge(texts[0])
    want, _, _ = _plain(folder, ids)
    torch.testing.assert_close(logits[0, at], want[0, at], rtol=1e-5, atol=1e-5)


def test_a_causal_lms_prompts_are_not_closed(tmp_path: Path) -> None:
    folder = tmp_path / "dec"
    BertTokenizerFast(vocab={w: i for i, w in enumerate(_WORDS)}).save_pretrained(folder)
    torch.manual_seed(0)
    config = BertConfig(**{**_SIZES, "vocab_size": len(_WORDS)}, is_decoder=True)
    _write(BertLMHeadModel(config), folder)
    bridge = TransformerBridge(HFDriver.boot(str(folder)))
    assert bridge.to_str_tokens("a cat sat") == ["[CLS]", "a", "cat", "sat"]


def test_a_dictionary_spliced_into_an_encoder_equals_the_same_swap_by_a_plain_pre_hook(
    bert: Path,
) -> None:
    """Sparse dictionaries run on encoders as on causal LMs: the spliced forward equals
    transformers with the layer's input swapped for the reconstruction, and the features of
    each prompt of a ragged batch are the ones it gets alone."""
    bridge = TransformerBridge(HFDriver.boot(str(bert)))
    d = random_dictionary(_SIZES["hidden_size"], 4 * _SIZES["hidden_size"], seed=1, scale=0.5)
    ids = _PROMPTS[0]
    want = _with_layer_input(bert, ids, 1, d.reconstruct)
    spliced = splice(bridge, d, hook_name="blocks.1.hook_in")
    try:
        with torch.no_grad():
            torch.testing.assert_close(bridge(torch.tensor([ids])), want, rtol=1e-5, atol=1e-5)
            site = "blocks.1.hook_in.hook_sae_acts_post"
            _, batch = bridge.run_with_cache(_PROMPTS, names_filter=[site])
            _, alone = bridge.run_with_cache([_PROMPTS[1]], names_filter=[site])
    finally:
        spliced.remove()
    n = len(_PROMPTS[1])
    torch.testing.assert_close(batch[site][1, :n], alone[site][0], rtol=1e-5, atol=1e-5)


def _bert_with_tokenizer(folder: Path) -> Path:
    BertTokenizerFast(vocab={w: i for i, w in enumerate(_WORDS)}).save_pretrained(folder)
    torch.manual_seed(0)
    return _write(BertForMaskedLM(BertConfig(**{**_SIZES, "vocab_size": len(_WORDS)})), folder)


def test_a_capture_on_an_encoder_stores_what_transformers_computes_on_each_closed_context(
    tmp_path: Path,
) -> None:
    """Each context is [CLS] text [SEP], run with its padding masked: the stored rows equal
    a plain transformers run of that context alone."""
    folder = _bert_with_tokenizer(tmp_path / "bert")
    text = tmp_path / "docs.txt"
    text.write_text("the cat sat .\na cat sat of paris is the capital of france .\nparis\n")
    config = CaptureConfig(
        model=str(folder), driver="hf", hooks=("blocks.1.hook_in",), input=str(text),
        context_size=9, batch_size=3, shard_contexts=6, pack=False,
    )  # fmt: skip
    assert capture(config, tmp_path / "store", progress=False).complete
    store = CaptureStore(tmp_path / "store")
    tokens, contexts = store.read("tokens"), store.read("contexts")
    own = AutoTokenizer.from_pretrained(folder)
    seen = 0
    for i in range(int(contexts.max()) + 1):
        rows = (contexts == i).nonzero().flatten()
        ids = tokens[rows].tolist()
        assert ids[0] == own.cls_token_id and ids[-1] == own.sep_token_id
        _, layer_inputs, _ = _plain(folder, ids)
        got = store.read("blocks.1.hook_in", int(rows[0]), int(rows[-1]) + 1)
        torch.testing.assert_close(got, layer_inputs[1][0], rtol=1e-5, atol=1e-5)
        seen += 1
    assert seen >= 4  # the long document is cut into contexts, each closed
    refused = CaptureConfig(**{**config.__dict__, "drop_padding": False})
    with pytest.raises(UserError, match="attends both ways"):
        capture(refused, tmp_path / "padded", progress=False)


def test_segment_ids_reach_the_model_as_transformers_takes_them(bert: Path) -> None:
    """Sentence A/B: token_type_ids as a tensor or one list per prompt give transformers' own
    logits for the same segments (and other logits than segment 0 everywhere)."""
    bridge = TransformerBridge(HFDriver.boot(str(bert)))
    ids = _PROMPTS[0]
    types = [0, 0, 0, 0, 1, 1, 1]
    model = AutoModelForMaskedLM.from_pretrained(bert, attn_implementation="eager").eval()
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([types])).logits
        got = bridge(torch.tensor([ids]), token_type_ids=torch.tensor([types]))
        listed, cache = bridge.run_with_cache(
            _PROMPTS,
            token_type_ids=[types, [0, 1, 1]],
            names_filter=[
                "blocks.0.hook_in",
                "token_type_embed.hook_in",
                "token_type_embed.hook_out",
            ],
        )
        plain = bridge(torch.tensor([ids]))
        alone = model(
            input_ids=torch.tensor([_PROMPTS[1]]), token_type_ids=torch.tensor([[0, 1, 1]])
        )
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(listed[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(listed[1, :3], alone.logits[0], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        embedded = model.bert.embeddings(
            input_ids=torch.tensor([_PROMPTS[1]]), token_type_ids=torch.tensor([[0, 1, 1]])
        )
    torch.testing.assert_close(cache["blocks.0.hook_in"][1, :3], embedded[0], rtol=1e-6, atol=1e-6)
    # The segment sites hold the ids given and the rows the model adds for them.
    assert cache["token_type_embed.hook_in"][0].tolist() == types
    assert cache["token_type_embed.hook_in"][1, :3].tolist() == [0, 1, 1]
    rows = model.bert.embeddings.token_type_embeddings.weight
    torch.testing.assert_close(cache["token_type_embed.hook_out"][0], rows[types].detach())
    assert (plain - want).abs().max() > 1e-3  # the segments changed the forward


def test_segment_ids_that_do_not_fit_are_refused_before_the_forward(bert: Path) -> None:
    bridge = TransformerBridge(HFDriver.boot(str(bert)))
    ids = torch.tensor([_PROMPTS[0]])
    with pytest.raises(UserError, match=r"must lie in \[0, 2\)"):
        bridge(ids, token_type_ids=torch.full((1, 7), 2))
    with pytest.raises(UserError, match="has shape \\(1, 3\\)"):
        bridge(ids, token_type_ids=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(UserError, match="of prompt 1 has 2 ids; the prompt has 3 tokens"):
        bridge(_PROMPTS, token_type_ids=[[0] * 7, [0, 1]])
    with pytest.raises(UserError, match="must hold integers"):
        bridge(ids, token_type_ids=torch.zeros(1, 7))
    with pytest.raises(UserError, match="must be >= 0"):
        bridge(ids, token_type_ids=torch.full((1, 7), -1))


def test_segment_ids_on_a_model_without_them_are_refused(checkpoint: Any) -> None:
    bridge = TransformerBridge(HFDriver.boot(str(checkpoint("llama"))))
    with pytest.raises(UnsupportedFeatureError, match="takes no token_type_ids"):
        bridge(torch.tensor([[1, 2, 3]]), token_type_ids=torch.zeros(1, 3, dtype=torch.long))


def test_a_next_token_loss_on_a_masked_lm_is_refused(bert: Path) -> None:
    bridge = TransformerBridge(HFDriver.boot(str(bert)))
    ids = torch.tensor([_PROMPTS[0]])
    for call in (
        lambda: bridge.loss(ids),
        lambda: bridge(ids, return_type="both"),
        lambda: bridge.run_with_cache(ids, incl_bwd=True),
    ):
        with pytest.raises(UnsupportedFeatureError, match="is a masked LM: its logits"):
            call()


def test_a_roberta_decoder_numbers_positions_after_its_padding_id(tmp_path: Path) -> None:
    """RoBERTa's position table starts after its padding id (2 here), and its embedding reads
    position ids as given: tl numbers positions from there, in a prefill and in a ragged
    greedy generation (left-padded), as transformers numbers them from the ids alone."""
    torch.manual_seed(0)
    config = RobertaConfig(**{**_SIZES, "pad_token_id": 1}, is_decoder=True)
    folder = _write(RobertaForCausalLM(config), tmp_path / "roberta-decoder")
    driver = HFDriver.boot(str(folder))
    assert driver.adapter.position_ids_start == 2
    bridge = TransformerBridge(driver)
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        for ids in _PROMPTS:
            want = model(input_ids=torch.tensor([ids])).logits
            torch.testing.assert_close(bridge(torch.tensor([ids])), want, rtol=1e-5, atol=1e-5)
        generated = bridge.generate(_PROMPTS, max_new_tokens=3, return_type="tokens")
        for row, ids in enumerate(_PROMPTS):
            tokens = list(ids)
            for _ in range(3):
                logits = model(input_ids=torch.tensor([tokens])).logits
                tokens.append(int(logits[0, -1].argmax()))
            assert generated[row].tolist() == tokens[len(ids) :]
