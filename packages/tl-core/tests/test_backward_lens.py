"""Backward Lens on the native model: factors against plain autograd, refusals, projection.

Every reference here comes from outside ``backward_lens``: weight gradients from
``loss.backward()`` on the parameters, gradients at hooks from ``run_with_cache(incl_bwd=True)``
and the unembedding from the model's own parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import torch

from tl_core import HookPoint, TransformerBridge, UnsupportedFeatureError, UserError
from tl_core.analysis import BackwardLensResult, backward_lens

PROMPTS = ["The cat sat on the mat", "Dogs ran"]  # ragged: 23 and 9 tokens with BOS
#: Relative tolerance of a reconstructed gradient against autograd's, per dtype.
RTOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _native(**overrides: object) -> TransformerBridge:
    options: dict[str, object] = {"n_layers": 3, "seed": 3, **overrides}
    return TransformerBridge.boot_native("gpt2", **options)


@pytest.fixture(params=[torch.float32, torch.float64], ids=["fp32", "fp64"])
def model(request: pytest.FixtureRequest) -> TransformerBridge:
    """A 3-layer GPT-2-style native model in each dtype."""
    return _native(dtype=request.param)


@pytest.fixture
def forward_count() -> Iterator[Callable[[TransformerBridge], list[int]]]:
    """``count(model)``: a list that grows by one each time the model's first block runs."""
    attached: list[tuple[TransformerBridge, object]] = []

    def count(model: TransformerBridge) -> list[int]:
        calls: list[int] = []
        handles = model.add_hook("blocks.0.hook_in", lambda x, hook: calls.append(1))
        attached.append((model, handles))
        return calls

    yield count
    for model, _ in attached:
        model.reset_hooks(including_permanent=True)


def _true_grads(model: TransformerBridge, loss: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]


def _check_reconstruction(
    model: TransformerBridge, result: BackwardLensResult, rtol: float
) -> dict[str, float]:
    """Compare every factor sum with the parameter's own ``.grad``; returns the errors."""
    mlp = [block.mlp for block in model.driver.module.blocks]
    errors: dict[str, float] = {}
    for layer in range(model.cfg.n_layers):
        pairs = {
            "W_in": (result.weight_grad(layer, "in"), mlp[layer].W_in.grad),
            "W_out": (result.weight_grad(layer, "out"), mlp[layer].W_out.grad),
            "b_in": (result.bias_grad(layer, "in"), mlp[layer].b_in.grad),
            "b_out": (result.bias_grad(layer, "out"), mlp[layer].b_out.grad),
        }
        for what, (got, want) in pairs.items():
            assert want is not None, f"blocks.{layer}.mlp.{what} got no gradient from autograd"
            assert got.shape == want.shape, (
                f"blocks.{layer}.mlp.{what}: {got.shape} vs {want.shape}"
            )
            errors[f"blocks.{layer}.mlp.{what}"] = _rel_err(got, want.to(got.dtype))
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= rtol, (
        f"{worst}: relative error {errors[worst]:.3g} > {rtol:g} ({errors})"
    )
    return errors


def test_factors_sum_to_every_mlp_weight_gradient(model: TransformerBridge) -> None:
    result = backward_lens(model, PROMPTS)
    # The lens computes no parameter gradient of its own.
    assert all(p.grad is None for p in model.parameters())
    _true_grads(model, model.loss(PROMPTS))
    _check_reconstruction(model, result, RTOL[next(model.parameters()).dtype])
    torch.testing.assert_close(result.loss, model.loss(PROMPTS).detach())
    assert result.layers == (0, 1, 2)
    for layer in result.layers:
        assert result.sites[(layer, "in")].name == f"blocks.{layer}.mlp.W_in"
        assert result.sites[(layer, "out")].name == f"blocks.{layer}.mlp.W_out"
        # The native model stores [in, out]: model layout and TransformerLens layout agree.
        assert not result.sites[(layer, "in")].transposed
        torch.testing.assert_close(
            result.weight_grad(layer, "in", layout="tl"), result.weight_grad(layer, "in")
        )


def test_ragged_batch_keeps_padding_out() -> None:
    model = _native()
    result = backward_lens(model, PROMPTS, layers=[1])
    lengths = [len(model.to_str_tokens(p)) for p in PROMPTS]
    assert result.lengths == tuple(lengths)
    assert lengths[1] < lengths[0]
    assert result.mask.sum(dim=1).tolist() == lengths
    short = lengths[1]
    for name in ("x", "delta", "a", "g"):
        factor = getattr(result, name)[1]
        assert factor.shape[:2] == (2, lengths[0]), name
        assert bool((factor[1, short:] == 0).all()), f"{name} is not zero at padding"
        assert bool((factor[1, :short] != 0).any()), f"{name} is zero at real positions"
    # The short prompt alone gives the same factors at its real positions: padding changes nothing.
    alone = backward_lens(
        model,
        PROMPTS[1],
        layers=1,
        loss=lambda logits: _mean_nll(model, logits, PROMPTS[1]) * (short - 1) / (sum(lengths) - 2),
    )
    torch.testing.assert_close(alone.x[1][0], result.x[1][1, :short])
    torch.testing.assert_close(alone.g[1][0], result.g[1][1, :short])


def _mean_nll(model: TransformerBridge, logits: torch.Tensor, prompt: str) -> torch.Tensor:
    tokens = model.to_tokens(prompt)
    log_probs = logits[:, :-1].log_softmax(-1)
    return -log_probs.gather(-1, tokens[:, 1:, None]).mean()


def test_a_custom_loss_on_the_last_real_positions() -> None:
    model = _native(dtype=torch.float64)
    lengths = [len(model.to_str_tokens(p)) for p in PROMPTS]
    target = model.to_single_token("!")

    def logit_of_bang(logits: torch.Tensor) -> torch.Tensor:
        last = torch.tensor(lengths) - 1
        return logits[torch.arange(len(lengths)), last, target].sum()

    result = backward_lens(model, PROMPTS, loss=logit_of_bang)
    _true_grads(model, logit_of_bang(model(PROMPTS)))
    _check_reconstruction(model, result, RTOL[torch.float64])


def test_a_loss_reading_padding_is_refused() -> None:
    model = _native()
    with pytest.raises(UserError, match="padded positions"):
        backward_lens(model, PROMPTS, loss=lambda logits: logits[:, -1, 0].sum())


def test_a_square_mlp_is_recognised_by_what_it_computes() -> None:
    # d_mlp == d_model: shape alone cannot tell W_in from W_out or either orientation.
    model = _native(d_mlp=64, dtype=torch.float64)
    result = backward_lens(model, PROMPTS)
    _true_grads(model, model.loss(PROMPTS))
    _check_reconstruction(model, result, RTOL[torch.float64])
    assert [result.sites[(i, "out")].name for i in range(3)] == [
        f"blocks.{i}.mlp.W_out" for i in range(3)
    ]


def test_vocab_projection_matches_an_independent_unembedding() -> None:
    model = _native(tie_word_embeddings=False)
    native = model.driver.module
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norms away from their (1, 0) init, so folding them shows
        for norm in [native.ln_final, *(block.ln2 for block in native.blocks)]:
            norm.w.copy_(1 + 0.5 * torch.randn(norm.w.shape, generator=generator))
            norm.b.copy_(0.5 * torch.randn(norm.b.shape, generator=generator))
    result = backward_lens(model, PROMPTS)
    model.zero_grad(set_to_none=True)
    _, cache = model.run_with_cache(
        PROMPTS, names_filter=lambda n: n.endswith(("mlp.hook_in", "mlp.hook_out")), incl_bwd=True
    )
    W_U = native.unembed.W_U.detach()
    ln_w = native.ln_final.w.detach()
    mask = result.mask
    for layer in result.layers:
        g = cache.grads[f"blocks.{layer}.mlp.hook_out"]
        x = cache[f"blocks.{layer}.mlp.hook_in"]
        torch.testing.assert_close(result.g[layer][mask], g[mask])
        torch.testing.assert_close(result.vocab_projection(layer)[mask], (g @ W_U)[mask])
        torch.testing.assert_close(result.vocab_projection(layer, "x")[mask], (x @ W_U)[mask])
        shifted = (-g - (-g).mean(-1, keepdim=True)) * ln_w
        torch.testing.assert_close(
            result.vocab_projection(layer, fold_norm=True, negate=True)[mask], (shifted @ W_U)[mask]
        )
        # g is orthogonal to the all-ones vector (only LayerNorms read the residual stream),
        # so the centring of fold_norm shows on x only.
        centred = (x - x.mean(-1, keepdim=True)) * ln_w
        torch.testing.assert_close(
            result.vocab_projection(layer, "x", fold_norm=True)[mask], (centred @ W_U)[mask]
        )
        # The next-token loss never reaches the last token of a prompt: g is zero there.
        live = mask.clone()
        live[torch.arange(2), torch.tensor(result.lengths) - 1] = False
        assert torch.equal((g != 0).any(-1) & mask, live)
        values, indices = result.top_tokens(layer, k=5)
        want_values, want_indices = (g @ W_U).topk(5, dim=-1)
        assert torch.equal(indices[live], want_indices[live]), f"layer {layer}: top tokens differ"
        torch.testing.assert_close(values[live], want_values[live])
        assert bool((indices[~live] == -1).all()) and bool(values[~live].isnan().all())
        assert model.to_str_tokens(indices[0, 0])  # decodable ids


def test_gated_mlp_is_refused_before_any_pass(
    forward_count: Callable[[TransformerBridge], list[int]],
) -> None:
    model = TransformerBridge.boot_native("llama", n_layers=2)
    calls = forward_count(model)
    with pytest.raises(UnsupportedFeatureError, match=r"gated MLP.*Nothing was run"):
        backward_lens(model, "hello")
    assert calls == []


def test_mixture_of_experts_is_refused(
    monkeypatch: pytest.MonkeyPatch, forward_count: Callable[[TransformerBridge], list[int]]
) -> None:
    model = _native()
    native = model.driver.module
    monkeypatch.setattr(native, "info", replace(native.info, n_experts=8, experts_per_token=2))
    calls = forward_count(model)
    with pytest.raises(UnsupportedFeatureError, match="2 of 8 experts"):
        backward_lens(model, "hello")
    assert calls == []


def test_a_driver_without_gradients_is_refused(
    monkeypatch: pytest.MonkeyPatch, forward_count: Callable[[TransformerBridge], list[int]]
) -> None:
    model = _native()
    calls = forward_count(model)
    monkeypatch.setattr(model.driver, "supports", lambda feature: feature != "gradients")
    with pytest.raises(UnsupportedFeatureError, match="needs gradients"):
        backward_lens(model, "hello")
    assert calls == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"layers": 3}, "not a block"),
        ({"layers": -4}, "not a block"),
        ({"layers": True}, "not a block"),
        ({"layers": "0"}, "not a block"),
        ({"layers": [0, 1.5]}, "not a block"),
        ({"layers": []}, "layers is empty"),
        ({"loss": "nll"}, "callable"),
        ({"input": "", "prepend_bos": False}, "empty"),
        ({"input": torch.zeros(2, 3)}, "integer"),
        ({"input": [[1, 2], []]}, "empty"),
        ({"input": "a", "prepend_bos": False}, "at least two tokens"),
    ],
)
def test_bad_arguments_fail_before_the_forward(
    kwargs: dict[str, object], match: str, forward_count: Callable[[TransformerBridge], list[int]]
) -> None:
    model = _native()
    calls = forward_count(model)
    args: dict[str, object] = {"input": "hello", **kwargs}
    with pytest.raises(UserError, match=match):
        backward_lens(model, **args)  # type: ignore[arg-type]
    assert calls == []


def test_a_forward_hook_on_the_gradient_sites_is_refused(
    forward_count: Callable[[TransformerBridge], list[int]],
) -> None:
    model = _native()
    calls = forward_count(model)
    model.add_hook("blocks.1.mlp.hook_pre", lambda x, hook: x * 2, is_permanent=True)
    with pytest.raises(UserError, match=r"'blocks.1.mlp.hook_pre'.*forward hook"):
        backward_lens(model, "hello")
    assert calls == []
    # Only the selected blocks matter.
    assert backward_lens(model, "hello", layers=[0, 2]).layers == (0, 2)


def test_hooks_that_are_not_the_weights_input_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # A scale between mlp.hook_in and W_in, as a norm inside the MLP would be.
    model = _native()
    point: HookPoint = model.hook_dict["blocks.0.mlp.hook_in"]
    original = point.forward
    monkeypatch.setattr(point, "forward", lambda x: original(x) * 1.5 + 0.1 * x.roll(1, dims=-1))
    with pytest.raises(
        UnsupportedFeatureError, match=r"blocks.0.mlp.hook_in -> blocks.0.mlp.hook_pre"
    ):
        backward_lens(model, PROMPTS)


def test_frozen_parameters_and_a_loss_without_gradient_are_explained() -> None:
    model = _native()
    with pytest.raises(UserError, match="no gradient"):
        backward_lens(model, "hello", loss=lambda logits: logits.detach().sum())
    with pytest.raises(UserError, match="scalar"):
        backward_lens(model, "hello", loss=lambda logits: logits[0, 0])
    model.requires_grad_(False)
    with pytest.raises(UserError, match="requires_grad"):
        backward_lens(model, "hello")


def test_result_accessors_check_their_arguments() -> None:
    result = backward_lens(_native(), "hello", layers=-1)
    assert result.layers == (2,)
    for call in (
        lambda: result.weight_grad(0, "in"),
        lambda: result.weight_grad(2, "gate"),  # type: ignore[arg-type]
        lambda: result.weight_grad(2, "in", layout="hf"),  # type: ignore[arg-type]
        lambda: result.vocab_projection(2, "delta"),  # type: ignore[arg-type]
        lambda: result.top_tokens(2, k=0),
    ):
        with pytest.raises(UserError):
            call()


# -- losses that are not finite (issue 47) ---------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_loss_that_is_not_finite_is_refused_naming_it(bad: float) -> None:
    model = _native()

    def poisoned_loss(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, :2].sum() * 0 + bad

    with pytest.raises(UserError, match=rf"loss 'poisoned_loss' is {bad}, not a finite number"):
        backward_lens(model, PROMPTS, loss=poisoned_loss)
    assert all(p.grad is None for p in model.model.parameters())


def test_the_default_loss_of_a_model_with_nan_weights_is_refused() -> None:
    model = _native()
    with torch.no_grad():
        model.model.blocks[2].mlp.W_out[0, 0] = float("nan")
    with pytest.raises(
        UserError, match=r"the default next-token loss is nan.*logits are not finite"
    ):
        backward_lens(model, PROMPTS)


def test_a_loss_with_an_infinite_slope_is_refused_naming_the_site() -> None:
    model = _native()

    def root(logits: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(logits[:, :2].sum() * 0)  # 0, with slope inf at 0

    with pytest.raises(
        UserError, match=r"gradient of loss 'root' at 'blocks\.\d\.mlp\.hook_\w+' is not finite"
    ):
        backward_lens(model, PROMPTS, loss=root)


def test_a_loss_with_a_lengths_keyword_gets_each_prompts_length() -> None:
    model = _native(dtype=torch.float64)
    lengths = tuple(len(model.to_str_tokens(p)) for p in PROMPTS)
    seen: list[tuple[int, ...]] = []

    def last_logit(logits: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
        seen.append(lengths)
        last = torch.tensor(lengths) - 1
        return logits[torch.arange(len(lengths)), last, 5].sum()

    result = backward_lens(model, PROMPTS, loss=last_logit)
    assert seen == [lengths]
    _true_grads(model, last_logit(model(PROMPTS), lengths))
    _check_reconstruction(model, result, RTOL[torch.float64])
