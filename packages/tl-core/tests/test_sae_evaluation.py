"""``evaluate_dictionary`` leaves special tokens out by default, as sae-lens 6.54's
``run_evals`` does (``exclude_special_tokens=True``): at BOS, EOS and pad positions the
spliced run keeps the model's value, and no metric counts those positions.

The reference is computed here by hand with plain hooks; sae-lens's own evaluation
functions are the reference in ``tests-peers/sae_lens/test_evaluation_as_sae_lens_evals_score_it.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tl_core import TransformerBridge, UserError
from tl_core.sae import SparseDictionary, evaluate_dictionary, random_dictionary

HOOK = "blocks.0.hook_out"


@pytest.fixture(scope="module")
def llama() -> TransformerBridge:
    return TransformerBridge.boot_native("llama", n_layers=2, seed=4)


def _corpus(bridge: TransformerBridge) -> tuple[torch.Tensor, list[int]]:
    tok = bridge.tokenizer
    special = [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id]
    assert all(isinstance(i, int) for i in special)
    tokens = torch.randint(0, 200, (4, 10), generator=torch.Generator().manual_seed(2))
    tokens[:, 0] = special[0]
    tokens[1, 6] = special[1]
    tokens[2, 7:] = special[2]
    return tokens, special  # type: ignore[return-value]


def _by_hand(
    bridge: TransformerBridge, d: SparseDictionary, tokens: torch.Tensor, ignored: list[int]
) -> dict[str, Any]:
    keep = ~torch.isin(tokens, torch.tensor(ignored, dtype=tokens.dtype))
    with torch.no_grad():
        clean, cache = bridge.run_with_cache(tokens, names_filter=[HOOK], prepend_bos=False)

        def splice(x: torch.Tensor, *, hook: Any) -> torch.Tensor:
            return torch.where(keep[..., None], d.reconstruct(x), x)

        with bridge.hooks([(HOOK, splice)]):
            spliced = bridge(tokens, prepend_bos=False)
        with bridge.hooks([(HOOK, lambda x, *, hook: torch.zeros_like(x))]):
            zero = bridge(tokens, prepend_bos=False)

    def ce(logits: torch.Tensor) -> float:
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].double().flatten(0, 1), tokens[:, 1:].flatten(), reduction="none"
        )
        return float(nll[keep[:, :-1].flatten()].mean())

    p, q = (torch.log_softmax(t.double(), -1) for t in (clean, spliced))
    kl = (p.exp() * (p - q)).sum(-1)
    x = cache[HOOK][keep].double()
    fired = d.encode(cache[HOOK])[keep] != 0
    resid = (x - d.reconstruct(cache[HOOK])[keep].double()).pow(2).sum()
    return {
        "ce": (ce(clean), ce(spliced), ce(zero)),
        "kl": float(kl[keep].mean()),
        "ev": float(1 - resid / (x - x.mean(0)).pow(2).sum()),
        "l0": float(fired.sum(-1).double().mean()),
        "counts": fired.sum(0),
        "left_out": int((~keep).sum()),
    }


@pytest.mark.parametrize("option", ["default", "explicit ids", "none left out"])
def test_special_tokens_are_left_out_as_sae_lens_leaves_them_out(
    llama: TransformerBridge, option: str
) -> None:
    d = random_dictionary(llama.cfg.d_model, 4 * llama.cfg.d_model, seed=6, architecture="jumprelu")
    tokens, special = _corpus(llama)
    options: dict[str, Any] = {
        "default": {},
        "explicit ids": {"exclude_special_tokens": special[1:]},
        "none left out": {"exclude_special_tokens": False},
    }[option]
    ignored = {"default": special, "explicit ids": special[1:], "none left out": []}[option]
    want = _by_hand(llama, d, tokens, ignored)
    got = evaluate_dictionary(llama, d, tokens, hook_name=HOOK, batch_size=3, **options)
    assert (got.ce_clean, got.ce_splice, got.ce_zero) == pytest.approx(want["ce"], rel=1e-5)
    assert got.kl == pytest.approx(want["kl"], rel=1e-4)
    assert got.explained_variance == pytest.approx(want["ev"], rel=1e-4)
    assert got.l0 == pytest.approx(want["l0"], rel=1e-6)
    assert torch.equal(got.feature_counts, want["counts"])
    assert got.dead_features == int((want["counts"] == 0).sum())
    assert got.special_tokens == want["left_out"] and got.tokens == tokens.numel()
    assert (f"({want['left_out']} special left out)" in str(got)) == bool(want["left_out"])


def test_nothing_left_to_score_and_bad_options_are_refused_before_any_forward(
    llama: TransformerBridge,
) -> None:
    d = random_dictionary(llama.cfg.d_model, 16)
    tokens, special = _corpus(llama)
    only_special = torch.tensor([[special[0], special[1], 5]])
    with pytest.raises(
        UserError, match=r"every position but the last of each row holds a special token"
    ):
        evaluate_dictionary(llama, d, only_special, hook_name=HOOK)
    with pytest.raises(UserError, match=r"exclude_special_tokens takes True .* got 'bos'"):
        evaluate_dictionary(llama, d, tokens, hook_name=HOOK, exclude_special_tokens="bos")  # type: ignore[arg-type]
    with pytest.raises(
        UserError, match=r"exclude_special_tokens takes int token ids, got \[1\.5\]"
    ):
        evaluate_dictionary(llama, d, tokens, hook_name=HOOK, exclude_special_tokens=[1.5])  # type: ignore[list-item]
    assert not llama.namespace.dictionaries
