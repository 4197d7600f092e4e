"""Plotting helpers: real figures from real caches, opened again as images and checked non-blank."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tl_core import TransformerBridge, UserError

pytest.importorskip("matplotlib")
from matplotlib.image import imread

from tl_core.plots import (
    PLOTS_EXTRA,
    plot_head_scores,
    plot_layer_sweep,
    plot_logit_lens,
    plot_patching,
    plot_pattern,
)

PROMPTS = ["The cat sat on the mat", "Hi"]


@pytest.fixture(scope="module")
def model_and_cache() -> tuple[TransformerBridge, object]:
    model = TransformerBridge.boot_native("llama", n_layers=2, seed=3)
    with torch.no_grad():
        _, cache = model.run_with_cache(PROMPTS)
    return model, cache


def _saved(figure: object, path: Path) -> object:
    figure.savefig(path, dpi=60)  # type: ignore[attr-defined]
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 50, image.shape
    rgb = image[..., :3].reshape(-1, 3)
    assert rgb.std() > 0.05, "the image is blank"
    assert len({tuple(p) for p in (rgb * 255).round().tolist()[::7]}) > 20, (
        "too few colours for a heatmap"
    )
    return image


def test_cache_draws_a_pattern_trimmed_to_the_prompt(
    model_and_cache: tuple[TransformerBridge, object], tmp_path: Path
) -> None:
    model, cache = model_and_cache
    tokens = model.to_str_tokens(PROMPTS[1])
    figure = cache.plot_pattern(1, 2, prompt=1, tokens=tokens)  # type: ignore[attr-defined]
    axes = figure.axes[0]
    assert axes.get_title() == "blocks.1.attn head 2"
    shown = axes.images[0].get_array()
    want = cache["blocks.1.attn.hook_pattern"][1, 2, : len(tokens), : len(tokens)]  # type: ignore[index]
    assert shown.shape == (len(tokens), len(tokens))
    assert torch.allclose(torch.as_tensor(shown.data), want.float())
    assert [t.get_text() for t in axes.get_xticklabels()] == tokens
    _saved(figure, tmp_path / "pattern.png")


def test_cache_draws_the_logit_lens_of_a_token(
    model_and_cache: tuple[TransformerBridge, object], tmp_path: Path
) -> None:
    model, cache = model_and_cache
    token = model.tokenizer.encode("t")[0]
    figure = cache.plot_logit_lens(token, tokenizer=model.tokenizer)  # type: ignore[attr-defined]
    shown = torch.as_tensor(figure.axes[0].images[0].get_array().data)
    logits, labels = cache.prompt(0).remove_batch_dim().logit_lens(return_labels=True)  # type: ignore[attr-defined]
    assert shown.shape == (len(labels), len(model.to_tokens(PROMPTS[0])[0]))
    assert torch.allclose(shown, logits.softmax(-1)[..., token], atol=1e-6)
    assert [t.get_text() for t in figure.axes[0].get_yticklabels()] == labels
    assert figure.axes[1].get_ylabel() == "p('t')"
    _saved(figure, tmp_path / "lens.png")


def test_logit_lens_of_the_top_token_writes_each_cell(
    model_and_cache: tuple[TransformerBridge, object], tmp_path: Path
) -> None:
    model, cache = model_and_cache
    figure = cache.plot_logit_lens(prompt=1, tokenizer=model.tokenizer)  # type: ignore[attr-defined]
    texts = figure.axes[0].texts
    assert len(texts) == (model.cfg.n_layers + 1) * len(model.to_tokens(PROMPTS[1])[0])
    _saved(figure, tmp_path / "top.png")


def test_the_array_helpers_draw_what_they_are_given(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    heads = torch.rand(6, 4, generator=gen)
    figure = plot_head_scores(heads, title="induction")
    assert torch.allclose(torch.as_tensor(figure.axes[0].images[0].get_array().data), heads)
    _saved(figure, tmp_path / "heads.png")
    sweep = {"subject": torch.linspace(1, 0, 8), "last": torch.linspace(0, 1, 8)}
    figure = plot_layer_sweep(sweep)
    assert [line.get_label() for line in figure.axes[0].get_lines()[:2]] == ["subject", "last"]
    _saved(figure, tmp_path / "sweep.png")
    figure = plot_patching(
        torch.rand(8, 3, generator=gen) * 2 - 1, [f"L{i}" for i in range(8)], ["a", "b", "c"]
    )
    _saved(figure, tmp_path / "patch.png")
    figure = plot_logit_lens(torch.rand(5, 3, generator=gen), cell_text=[["x"] * 3] * 5)
    _saved(figure, tmp_path / "lens.png")
    figure = plot_pattern(torch.softmax(torch.rand(4, 4, generator=gen), -1), list("abcd"))
    _saved(figure, tmp_path / "pattern.png")


def test_an_axes_of_your_own_is_drawn_into() -> None:
    from matplotlib.figure import Figure

    mine = Figure()
    left, right = mine.subplots(1, 2)
    assert plot_head_scores(torch.rand(3, 3), ax=right) is mine
    assert right.images and not left.images


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: plot_head_scores(torch.rand(3)),
            "scores must have 2 dimensions, got shape \\(3,\\)",
        ),
        (lambda: plot_pattern(torch.rand(3, 3), ["a"]), "tokens has 1 labels for 3 entries"),
        (lambda: plot_patching(torch.rand(0, 3)), "scores is empty"),
        (lambda: plot_layer_sweep({}), "curves is empty"),
        (
            lambda: plot_logit_lens(torch.rand(2, 2), cell_text=[["a"]]),
            "cell_text must be 2 rows of 2 strings",
        ),
    ],
)
def test_bad_input_names_what_is_wrong(call: object, match: str) -> None:
    with pytest.raises(UserError, match=match):
        call()  # type: ignore[operator]


def test_bad_cache_arguments(model_and_cache: tuple[TransformerBridge, object]) -> None:
    _, cache = model_and_cache
    with pytest.raises(UserError, match=r"head must be an int in 0\.\.3, got 4"):
        cache.plot_pattern(0, 4)  # type: ignore[attr-defined]
    with pytest.raises(UserError, match=r"token must be a token id in 0\.\.258"):
        cache.plot_logit_lens(10_000)  # type: ignore[attr-defined]
    with pytest.raises(UserError, match="out of range"):
        cache.plot_pattern(0, 0, prompt=5)  # type: ignore[attr-defined]


def test_without_matplotlib_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import now raises ImportError
    with pytest.raises(
        UserError,
        match=re.escape(f"plotting needs matplotlib, which is not installed; {PLOTS_EXTRA}"),
    ):
        plot_head_scores(torch.rand(2, 2))
