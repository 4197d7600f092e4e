"""``evaluate_dictionary`` against sae-lens's own evaluation functions, run on the same
bridge: sae-lens's ``get_recons_loss`` splices its SAE with its own torch hooks (through the
bridge's HookedTransformer-style ``run_with_hooks``), and ``get_sparsity_and_variance_metrics``
reads the site with ``run_with_cache``. The corpus holds BOS, EOS and pad tokens, so the
default (special tokens left out) and ``exclude_special_tokens=False`` both matter."""

from __future__ import annotations

from typing import Any

import pytest
import torch

sae_lens = pytest.importorskip("sae_lens")

from sae_lens.evals import (  # noqa: E402
    get_downstream_reconstruction_metrics,
    get_sparsity_and_variance_metrics,
)
from sae_lens.training.activation_scaler import ActivationScaler  # noqa: E402
from sae_lens.util import get_special_token_ids  # noqa: E402

from tl_core import TransformerBridge  # noqa: E402
from tl_core.sae import evaluate_dictionary, from_sae_lens  # noqa: E402
from tl_driver_hf.testing import write_tiny_checkpoint  # noqa: E402

HOOK = "blocks.1.hook_resid_post"


class _Batches:
    """The one method of sae-lens's ActivationsStore its evaluation functions call here."""

    def __init__(self, tokens: torch.Tensor, batch_size: int) -> None:
        self._batches = list(tokens.split(batch_size))
        self._next = 0

    def get_batch_tokens(self, n: int) -> torch.Tensor:
        batch = self._batches[self._next % len(self._batches)]
        self._next += 1
        assert batch.shape[0] == n
        return batch


@pytest.fixture(scope="module")
def bridge(tmp_path_factory: pytest.TempPathFactory) -> TransformerBridge:
    folder = write_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    return TransformerBridge.boot_transformers(str(folder))


def _sae(d_in: int) -> Any:
    sae = sae_lens.JumpReLUSAE(sae_lens.JumpReLUSAEConfig(d_in=d_in, d_sae=4 * d_in))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in sae.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
        sae.threshold.abs_()
    sae.cfg.metadata.hook_name = HOOK
    return sae


def _corpus(bridge: TransformerBridge) -> tuple[torch.Tensor, list[int]]:
    special = sorted(get_special_token_ids(bridge.tokenizer))
    assert len(special) >= 2  # BOS/EOS (and pad) on the tiny checkpoint's tokenizer
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(len(special) + 10, 400, (6, 12), generator=gen)
    tokens[:, 0] = special[0]  # BOS-like first positions, and specials inside the rows
    tokens[1, 5] = special[-1]
    tokens[3, 7:] = special[-1]
    tokens[4, 2] = special[0]
    return tokens, special


def _sae_lens_scores(
    bridge: TransformerBridge, sae: Any, tokens: torch.Tensor, ignore: list[int] | None
) -> dict[str, Any]:
    scaler = ActivationScaler()
    batch = 2
    n = tokens.shape[0] // batch
    recons = get_downstream_reconstruction_metrics(
        sae, bridge, _Batches(tokens, batch), scaler, compute_kl=True, compute_ce_loss=True,
        n_batches=n, eval_batch_size_prompts=batch, ignore_tokens=ignore,
        model_kwargs={"prepend_bos": False},
    )  # fmt: skip
    sparsity, features = get_sparsity_and_variance_metrics(
        sae, bridge, _Batches(tokens, batch), scaler, n_batches=n, compute_l2_norms=False,
        compute_sparsity_metrics=True, compute_variance_metrics=True,
        compute_featurewise_density_statistics=True, eval_batch_size_prompts=batch,
        model_kwargs={}, ignore_tokens=ignore,
    )  # fmt: skip
    return {**recons, **sparsity, "density": features["feature_density"]}


@pytest.mark.parametrize("exclude", [True, False])
def test_scores_equal_sae_lens_evals(bridge: TransformerBridge, exclude: bool) -> None:
    sae = _sae(bridge.cfg.d_model)
    tokens, special = _corpus(bridge)
    with torch.no_grad():
        want = _sae_lens_scores(bridge, sae, tokens, special if exclude else None)
    # The default leaves special tokens out, as sae-lens's run_evals does by default.
    options = {} if exclude else {"exclude_special_tokens": False}
    got = evaluate_dictionary(bridge, from_sae_lens(sae), tokens, batch_size=2, **options)
    assert got.ce_clean == pytest.approx(want["ce_loss_without_sae"], rel=1e-4)
    assert got.ce_splice == pytest.approx(want["ce_loss_with_sae"], rel=1e-4)
    assert got.ce_zero == pytest.approx(want["ce_loss_with_ablation"], rel=1e-4)
    assert got.ce_recovered == pytest.approx(want["ce_loss_score"], rel=1e-3, abs=1e-4)
    assert got.kl == pytest.approx(want["kl_div_with_sae"], rel=1e-3, abs=1e-6)
    assert got.l0 == pytest.approx(want["l0"], rel=1e-5)
    assert got.explained_variance == pytest.approx(want["explained_variance"], rel=1e-4)
    dead = sum(1 for density in want["density"] if density == 0)
    assert got.dead_features == dead
    left_out = int(torch.isin(tokens, torch.tensor(special)).sum())
    assert got.special_tokens == (left_out if exclude else 0) and left_out > 0
