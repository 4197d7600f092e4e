"""tl's sparse dictionaries compute what sae-lens's own ``SAE.forward`` computes, and a
splice on the hf driver equals a plain torch hook running sae-lens's SAE on the same module."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

sae_lens = pytest.importorskip("sae_lens")

from tl_core import TransformerBridge  # noqa: E402
from tl_core.sae import from_sae_lens, load_dictionary, splice  # noqa: E402
from tl_driver_hf.testing import write_tiny_checkpoint  # noqa: E402

D_IN = 128


def _sae(kind: str, normalization: str = "none", apply_b_dec: bool = True, **extra: Any) -> Any:
    classes = {
        "standard": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig),
        "jumprelu": (sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig),
        "topk": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig),
    }
    cls, cfg_cls = classes[kind]
    sae = cls(
        cfg_cls(
            d_in=D_IN,
            d_sae=4 * D_IN,
            normalize_activations=normalization,
            apply_b_dec_to_input=apply_b_dec,
            **extra,
        )
    )
    return _randomised(sae, seed=7, scale=0.2)


def _randomised(module: Any, *, seed: int, scale: float) -> Any:
    """``module`` with every parameter drawn from N(0, scale^2) (sae-lens initialises some to 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * scale)
    return module


def _reconstructions_equal_sae_lens(module: Any, x: torch.Tensor) -> list[Any]:
    """tl's dictionary of ``module``, from the object and from its saved folder, each
    reconstructing ``x`` as sae-lens's own forward does (1e-5); returns both."""
    with torch.no_grad():
        want = module(x)
    folder = Path(tempfile.mkdtemp())
    module.save_model(folder)
    dictionaries = [from_sae_lens(module), load_dictionary(folder)]
    for dictionary in dictionaries:
        torch.testing.assert_close(dictionary.reconstruct(x), want, rtol=1e-5, atol=1e-5)
    return dictionaries


CASES = [
    (kind, norm, apply_b_dec, extra)
    for kind, extra in (
        ("standard", {}),
        ("jumprelu", {}),
        ("topk", {"k": 8}),
        ("topk", {"k": 8, "rescale_acts_by_decoder_norm": True}),
    )
    for norm in ("none", "constant_norm_rescale", "layer_norm")
    for apply_b_dec in (True, False)
]


@pytest.mark.parametrize(("kind", "norm", "apply_b_dec", "extra"), CASES)
def test_reconstruction_equals_sae_lens_forward(
    kind: str, norm: str, apply_b_dec: bool, extra: dict[str, Any]
) -> None:
    x = torch.randn(3, 7, D_IN, generator=torch.Generator().manual_seed(1))
    _reconstructions_equal_sae_lens(_sae(kind, norm, apply_b_dec, **extra), x)


@pytest.fixture(scope="module")
def bridge(tmp_path_factory: pytest.TempPathFactory) -> TransformerBridge:
    folder = write_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    bridge = TransformerBridge.boot_transformers(str(folder))
    assert bridge.cfg.d_model == D_IN
    return bridge


def _ids() -> torch.Tensor:
    return torch.randint(4, 500, (2, 9), generator=torch.Generator().manual_seed(3))


def _logits_with_block_1_input_through(bridge: TransformerBridge, sae: Any) -> torch.Tensor:
    """The HF model's logits with sae-lens's ``sae`` replacing block 1's input, by a plain
    torch pre-hook on the HF layer (no tl involved)."""
    layer = bridge.driver.hf_model.model.layers[1]

    def replace_input(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        hidden = args[0] if args else kwargs["hidden_states"]
        with torch.no_grad():
            out = sae(hidden)
        return ((out, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": out})

    handle = layer.register_forward_pre_hook(replace_input, with_kwargs=True)
    try:
        with torch.no_grad():
            return bridge.driver.hf_model(input_ids=_ids(), use_cache=False).logits  # type: ignore[no-any-return]
    finally:
        handle.remove()


@pytest.mark.parametrize("kind", ["standard", "jumprelu", "topk"])
def test_a_splice_equals_a_plain_hook_running_sae_lens(
    bridge: TransformerBridge, kind: str
) -> None:
    sae = _sae(kind, **({"k": 8} if kind == "topk" else {}))
    want = _logits_with_block_1_input_through(bridge, sae)
    spliced = splice(bridge, from_sae_lens(sae), hook_name="blocks.1.hook_in")
    try:
        got = bridge.forward(_ids())
    finally:
        spliced.remove()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, bridge.forward(_ids()), atol=1e-3)  # the splice changed the run


def test_with_the_error_term_an_unedited_splice_changes_nothing(bridge: TransformerBridge) -> None:
    plain = bridge.forward(_ids())
    spliced = splice(
        bridge, from_sae_lens(_sae("standard")), hook_name="blocks.1.hook_in", use_error_term=True
    )
    try:
        torch.testing.assert_close(bridge.forward(_ids()), plain, rtol=1e-5, atol=1e-5)
    finally:
        spliced.remove()


def test_a_dictionary_of_another_width_is_refused_before_any_forward(
    bridge: TransformerBridge,
) -> None:
    from tl_core import ConfigError

    narrow = sae_lens.StandardSAE(sae_lens.StandardSAEConfig(d_in=32, d_sae=64))
    with pytest.raises(
        ConfigError, match=r"reads width 32, but 'blocks.1.hook_in' has shape \(128,\)"
    ):
        splice(bridge, from_sae_lens(narrow), hook_name="blocks.1.hook_in")


def _transcoder(kind: str) -> Any:
    from sae_lens.saes import transcoder as t

    classes = {
        "transcoder": (t.Transcoder, t.TranscoderConfig),
        "skip_transcoder": (t.SkipTranscoder, t.SkipTranscoderConfig),
        "jumprelu_transcoder": (t.JumpReLUTranscoder, t.JumpReLUTranscoderConfig),
        "jumprelu_skip_transcoder": (t.JumpReLUSkipTranscoder, t.JumpReLUSkipTranscoderConfig),
    }
    cls, cfg_cls = classes[kind]
    # Square, as an MLP's input and output are: a W_skip read in the wrong orientation fails.
    return _randomised(
        cls(cfg_cls(d_in=D_IN, d_sae=4 * D_IN, d_out=D_IN, apply_b_dec_to_input=False)),
        seed=11,
        scale=0.1,
    )


TRANSCODERS = ["transcoder", "skip_transcoder", "jumprelu_transcoder", "jumprelu_skip_transcoder"]


@pytest.mark.parametrize("kind", TRANSCODERS)
def test_transcoders_compute_what_sae_lens_computes(kind: str) -> None:
    x = torch.randn(2, 5, D_IN, generator=torch.Generator().manual_seed(2))
    for dictionary in _reconstructions_equal_sae_lens(_transcoder(kind), x):
        assert dictionary.is_transcoder


@pytest.mark.parametrize("kind", ["transcoder", "jumprelu_skip_transcoder"])
def test_a_transcoder_splice_equals_plain_hooks_running_sae_lens(
    bridge: TransformerBridge, kind: str
) -> None:
    tc = _transcoder(kind)
    layer = bridge.driver.hf_model.model.layers[1]
    seen: dict[str, torch.Tensor] = {}

    def read(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen["in"] = args[0] if args else kwargs["hidden_states"]

    def write(module: Any, args: tuple[Any, ...], output: Any) -> Any:
        with torch.no_grad():
            return tc(seen["in"])

    handles = [
        layer.mlp.register_forward_pre_hook(read, with_kwargs=True),
        layer.mlp.register_forward_hook(write),
    ]
    try:
        with torch.no_grad():
            want = bridge.driver.hf_model(input_ids=_ids(), use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
    spliced = bridge.add_sae(
        from_sae_lens(tc),
        hook_name="blocks.1.mlp.hook_in",
        output_hook_name="blocks.1.mlp.hook_out",
    )
    try:
        got = bridge.forward(_ids())
    finally:
        spliced.remove()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_feature_edit_equals_a_hook_on_sae_lens_own_feature_site(
    bridge: TransformerBridge,
) -> None:
    """sae-lens with its error term on and a hook adding 2.5 to feature 7 on its own
    ``hook_sae_acts_post``, spliced by a plain torch hook, against tl's spec."""
    sae = _sae("jumprelu")
    sae.use_error_term = True
    sae.hook_sae_acts_post.add_hook(
        lambda acts, hook: acts + 2.5 * (torch.arange(acts.shape[-1]) == 7)
    )
    try:
        want = _logits_with_block_1_input_through(bridge, sae)
    finally:
        sae.hook_sae_acts_post.remove_hooks()
    spliced = bridge.add_sae(from_sae_lens(sae), hook_name="blocks.1.hook_in", use_error_term=True)
    try:
        got = bridge.forward(
            _ids(),
            intervene={
                spliced.site("hook_sae_acts_post"): {"op": "add", "value": 2.5, "features": 7}
            },
        )
    finally:
        spliced.remove()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, bridge.forward(_ids()), atol=1e-3)


TEXT = (
    "The lighthouse keeper climbed the narrow stairs every evening to light the lamp. Ships "
    "passing the rocky coast relied on its beam to find the harbour through fog and storms. "
    "In the morning he wrote the weather in a small notebook and made tea for the visitors."
)


@pytest.fixture(scope="module")
def smollm2() -> TransformerBridge:
    from tl_core.models import smollm2_gguf

    return TransformerBridge.boot_transformers(smollm2_gguf())


def test_ce_recovered_on_smollm2_equals_sae_lens_by_hand(smollm2: TransformerBridge) -> None:
    """tl's evaluation against the same quantity computed by hand: the HF model run plain,
    with sae-lens's SAE replacing the block output in a plain torch hook, and with zeros."""
    from tl_core.sae import evaluate_dictionary

    torch.manual_seed(0)
    sae = sae_lens.StandardSAE(
        sae_lens.StandardSAEConfig(d_in=smollm2.cfg.d_model, d_sae=16 * smollm2.cfg.d_model)
    )
    ids = smollm2.to_tokens(TEXT)[0]
    tokens = ids[: (ids.numel() // 16) * 16].reshape(-1, 16)
    layer = smollm2.driver.hf_model.model.layers[3]

    def ce(replace: Any) -> float:
        def hook(module: Any, args: Any, output: Any) -> Any:
            hidden = output[0] if isinstance(output, tuple) else output
            new = replace(hidden)
            return (new, *output[1:]) if isinstance(output, tuple) else new

        handle = layer.register_forward_hook(hook) if replace is not None else None
        try:
            with torch.no_grad():
                logits = smollm2.driver.hf_model(input_ids=tokens, use_cache=False).logits
        finally:
            if handle is not None:
                handle.remove()
        return float(
            torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1).double(), tokens[:, 1:].flatten()
            )
        )

    clean, spliced, zero = ce(None), ce(lambda h: sae(h)), ce(torch.zeros_like)
    want = (zero - spliced) / (zero - clean)
    # Every position scored, as the by-hand losses score them (the special-token default is
    # checked against sae-lens's own evaluation in test_evaluation_as_sae_lens_evals_score_it).
    got = evaluate_dictionary(
        smollm2, from_sae_lens(sae), tokens, hook_name="blocks.3.hook_out", batch_size=4,
        exclude_special_tokens=False,
    )  # fmt: skip
    assert (got.ce_clean, got.ce_splice, got.ce_zero) == pytest.approx(
        (clean, spliced, zero), rel=1e-4
    )
    assert got.ce_recovered == pytest.approx(want, abs=1e-3)
    assert 0 < got.l0 < sae.cfg.d_sae
