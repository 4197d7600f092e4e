"""How much of a model's behaviour a dictionary keeps, measured over a token corpus on any
driver (inside the engine on vLLM).

The dictionary is attached once, with its error term on, and every batch runs three times
with different specs on its sites: unedited (the model itself, since reconstruction plus
error is the site's value), with ``hook_sae_error`` suppressed (the reconstruction replaces
the site: the spliced model), and with ``hook_sae_output`` suppressed (the site zero-ablated).

Special tokens are left out as sae-lens 6.54's ``run_evals`` leaves them out by default
(``exclude_special_tokens=True``): the tokenizer's BOS, EOS, pad, separator and decoder-start
ids. At their positions the spliced run keeps the model's own value, and no metric counts
them: not L0, explained variance or feature counts, not the KL at those positions, and not
the loss of predicting the next token from one. (The zero-ablated run zeroes every
position, as sae-lens's does.)
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from tl_core._dictionaries._dictionary import SparseDictionary
from tl_core._errors import UserError

__all__ = ["DictionaryEvaluation", "evaluate_dictionary"]


@dataclass(frozen=True)
class DictionaryEvaluation:
    """A dictionary's scores over a corpus (sae-lens's evaluation quantities).

    Attributes:
        ce_clean: Mean next-token cross-entropy of the model itself.
        ce_splice: The same with the reconstruction in place of the site's value.
        ce_zero: The same with the site set to zero.
        ce_recovered: ``(ce_zero - ce_splice) / (ce_zero - ce_clean)``: 1 when the
            dictionary loses nothing the model needs, 0 when it is as bad as ablating.
        kl: Mean KL divergence from the model's next-token distribution to the spliced
            one, over every scored position (the last of each row included, as sae-lens).
        explained_variance: ``1 - sum|x - x_hat|^2 / sum|x - mean(x)|^2`` over every scored
            token of the written site (``x_hat`` the reconstruction, ``mean`` over them).
        l0: Mean number of active features per scored token.
        dead_features: Features that never fired on a scored token.
        feature_counts: How many scored tokens each feature fired on, ``[d_sae]``.
        tokens: Tokens read.
        special_tokens: Positions left out as special tokens (0 with
            ``exclude_special_tokens=False``). Next-token losses average over the
            positions that are neither special nor last in their row.
    """

    ce_clean: float
    ce_splice: float
    ce_zero: float
    ce_recovered: float
    kl: float
    explained_variance: float
    l0: float
    dead_features: int
    feature_counts: torch.Tensor
    tokens: int
    special_tokens: int = 0

    def __str__(self) -> str:
        rows = [
            ("CE recovered", f"{self.ce_recovered:.4f}"),
            (
                "CE clean / spliced / zero",
                f"{self.ce_clean:.4f} / {self.ce_splice:.4f} / {self.ce_zero:.4f}",
            ),
            ("KL to the model", f"{self.kl:.4f}"),
            ("explained variance", f"{self.explained_variance:.4f}"),
            ("L0", f"{self.l0:.2f}"),
            ("dead features", f"{self.dead_features} of {self.feature_counts.numel()}"),
            (
                "tokens",
                f"{self.tokens} ({self.special_tokens} special left out)"
                if self.special_tokens
                else str(self.tokens),
            ),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _token_rows(tokens: Any) -> torch.Tensor:
    try:
        rows = torch.as_tensor(tokens)
    except (TypeError, ValueError) as exc:
        raise UserError(
            f"evaluate_dictionary takes token ids [rows, positions] of one length, got {type(tokens).__name__}: {exc}"
        ) from None
    if (
        rows.dim() != 2
        or rows.dtype not in (torch.int32, torch.int64)
        or rows.shape[1] < 2
        or rows.shape[0] < 1
    ):
        raise UserError(
            "evaluate_dictionary takes integer token ids shaped [rows, positions] with at least one row "
            f"of at least 2 positions (next-token losses), got {tuple(rows.shape)} {rows.dtype}"
        )
    return rows.long()


#: The tokenizer attributes whose ids sae-lens's evaluations leave out (its
#: ``get_special_token_ids``): structural special tokens, not chat-template ones.
SPECIAL_TOKEN_ATTRIBUTES = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
)


def _ignored_ids(bridge: Any, exclude: bool | Iterable[int]) -> list[int]:
    if exclude is True:
        tokenizer = getattr(bridge, "tokenizer", None)
        found = {getattr(tokenizer, attr, None) for attr in SPECIAL_TOKEN_ATTRIBUTES}
        return sorted(i for i in found if isinstance(i, int) and not isinstance(i, bool))
    if exclude is False:
        return []
    if isinstance(exclude, (str, bytes)) or not isinstance(exclude, Iterable):
        raise UserError(
            "exclude_special_tokens takes True (the tokenizer's BOS, EOS, pad, separator and "
            f"decoder-start ids), False, or token ids to leave out; got {exclude!r}"
        )
    ids = list(exclude)
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int)]
    if bad:
        raise UserError(f"exclude_special_tokens takes int token ids, got {bad[:3]!r}")
    return sorted(set(ids))


def evaluate_dictionary(
    bridge: Any,
    dictionary: SparseDictionary,
    tokens: Any,
    *,
    hook_name: str | None = None,
    output_hook_name: str | None = None,
    batch_size: int = 8,
    exclude_special_tokens: bool | Iterable[int] = True,
    progress: bool = False,
) -> DictionaryEvaluation:
    """Score ``dictionary`` on ``bridge`` over ``tokens`` (see ``DictionaryEvaluation``).

    Args:
        bridge: Any bridge whose driver runs dictionaries and returns sequence logits.
        dictionary: A sparse autoencoder or transcoder; attached for the evaluation only.
        tokens: Token ids ``[rows, positions]``, every row as long (sae-lens's context
            size); no BOS is added.
        hook_name: Where it reads (default its own ``hook_name``).
        output_hook_name: Where a transcoder writes (default its own).
        batch_size: Rows per forward.
        exclude_special_tokens: Leave special-token positions out (sae-lens's
            ``run_evals`` default and meaning, see the module docstring): ``True`` for the
            tokenizer's BOS, EOS, pad, separator and decoder-start ids, ``False`` to score
            every position, or the token ids to leave out.
        progress: Print one line per batch to stderr.

    Raises:
        UserError: Bad tokens, batch size or ``exclude_special_tokens``, or no position
            left to score, before any forward pass; and what ``splice`` raises.
    """
    rows = _token_rows(tokens)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"batch_size must be an int >= 1, got {batch_size!r}")
    ignored = _ignored_ids(bridge, exclude_special_tokens)
    keep = ~torch.isin(rows, torch.tensor(ignored, dtype=rows.dtype))
    if not bool(keep[:, :-1].any()):
        raise UserError(
            f"every position but the last of each row holds a special token ({ignored} are left "
            "out), so no next-token loss is left to score; pass other tokens, or "
            "exclude_special_tokens=False to score them"
        )
    spliced = bridge.add_sae(
        dictionary, hook_name=hook_name, output_hook_name=output_hook_name, use_error_term=True
    )
    try:
        with torch.no_grad():
            return _evaluate(bridge, spliced, rows, keep, batch_size, progress)
    finally:
        spliced.remove()


def _splice_specs(error: str, keep: torch.Tensor) -> Any:
    """Specs that put the reconstruction in place of the site at the kept positions only
    (special positions keep the model's value, as in sae-lens's replacement hook)."""
    if bool(keep.all()):
        return {error: {"op": "suppress"}}
    return [
        {error: {"op": "suppress", "pos": row.nonzero().flatten().tolist()}}
        if bool(row.any())
        else None
        for row in keep
    ]


def _evaluate(
    bridge: Any,
    spliced: Any,
    rows: torch.Tensor,
    keep: torch.Tensor,
    batch_size: int,
    progress: bool,
) -> DictionaryEvaluation:
    acts, error, out = (
        spliced.site(s) for s in ("hook_sae_acts_post", "hook_sae_error", "hook_sae_output")
    )
    ce = {"clean": 0.0, "splice": 0.0, "zero": 0.0}
    kl_sum, predicted = 0.0, 0
    counts = torch.zeros(spliced.dictionary.d_sae, dtype=torch.long)
    active = 0
    err_sq, x_sum, x_sq = 0.0, None, 0.0
    starts = range(0, rows.shape[0], batch_size)
    for step, start in enumerate(starts):
        batch, kept = rows[start : start + batch_size], keep[start : start + batch_size]
        clean, cache = bridge.run_with_cache(
            batch, names_filter=[acts, error, out], prepend_bos=False
        )
        splice = bridge.forward(batch, intervene=_splice_specs(error, kept), prepend_bos=False)
        zero = bridge.forward(batch, intervene={out: {"op": "suppress"}}, prepend_bos=False)
        targets = batch[:, 1:].to(clean.device)
        scored = kept[:, :-1].to(clean.device)
        logp = {
            k: torch.log_softmax(v.double(), dim=-1)
            for k, v in (("clean", clean), ("splice", splice), ("zero", zero))
        }
        for k, lp in logp.items():
            nll = -lp[:, :-1].gather(-1, targets[..., None])[..., 0]
            ce[k] += float(nll[scored].sum())
        kl = (logp["clean"].exp() * (logp["clean"] - logp["splice"])).sum(-1)
        kl_sum += float(kl[kept.to(kl.device)].sum())
        predicted += int(scored.sum())
        flat_kept = kept.flatten()
        fired = (cache[acts].detach().cpu() != 0).flatten(0, -2)[flat_kept]
        counts += fired.sum(0)
        active += int(fired.sum())
        # The written site's value is reconstruction + error (= the output unedited).
        x = cache[out].detach().cpu().double().flatten(0, -2)[flat_kept]
        err_sq += float(cache[error].detach().cpu().double().flatten(0, -2)[flat_kept].pow(2).sum())
        x_sum = x.sum(0) if x_sum is None else x_sum + x.sum(0)
        x_sq += float(x.pow(2).sum())
        if progress:
            print(f"evaluate_dictionary: batch {step + 1}/{len(starts)}", file=sys.stderr)
    n = int(keep.sum())
    assert x_sum is not None
    total_var = x_sq - float(x_sum.pow(2).sum()) / n
    ce_clean, ce_splice, ce_zero = (ce[k] / predicted for k in ("clean", "splice", "zero"))
    gap = ce_zero - ce_clean
    return DictionaryEvaluation(
        ce_clean=ce_clean, ce_splice=ce_splice, ce_zero=ce_zero,
        ce_recovered=(ce_zero - ce_splice) / gap if gap != 0 else math.nan,
        kl=kl_sum / n, explained_variance=1 - err_sq / total_var if total_var > 0 else math.nan,
        l0=active / n, dead_features=int((counts == 0).sum()), feature_counts=counts,
        tokens=rows.numel(), special_tokens=rows.numel() - n,
    )  # fmt: skip
