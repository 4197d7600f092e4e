"""Certification equations of attention: pattern, values, scores, rotary, output, sinks.

Part of ``equation_checks`` (``_equations``): pure tensor arithmetic over one capture of
canonical hooks under ``blocks.{i}.attn.``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from tl_core.certification._report import CertificationCheck, compare

if TYPE_CHECKING:
    import torch

    from tl_core.hooks._model_info import ModelInfo

__all__ = ["attention_checks"]


def attention_checks(
    b: str,
    cache: Mapping[str, torch.Tensor],
    info: ModelInfo,
    rtol: float,
    W_O: torch.Tensor | None,
    b_O: torch.Tensor | None,
    attn_softcap: float | None,
    layer: int,
    score_bias: bool = False,
    attention_sinks: bool = False,
) -> list[CertificationCheck]:
    import torch

    a = b + "attn."
    pattern, v, z = cache.get(a + "hook_pattern"), cache.get(a + "hook_v"), cache.get(a + "hook_z")
    if pattern is None and z is None and v is None:
        return []
    out: list[CertificationCheck] = []
    if pattern is not None and attention_sinks:
        rows = pattern.double().sum(dim=-1)
        over = (rows - 1.0).clamp(min=0.0)
        out.append(
            compare(
                f"{a}hook_pattern sums to at most 1 over keys (sinks take the rest)",
                (a + "hook_pattern",),
                over,
                torch.zeros_like(over),
                rtol=rtol,
            )
        )
    elif pattern is not None:
        rows = pattern.double().sum(dim=-1)
        out.append(
            compare(
                f"{a}hook_pattern sums to 1 over keys",
                (a + "hook_pattern",),
                rows,
                torch.ones_like(rows),
                rtol=rtol,
            )
        )
    if pattern is not None and v is not None and z is not None:
        # pattern [b h q k], v [b k h_kv dh], z [b q h dh]
        rep = pattern.shape[1] // max(1, v.shape[2])
        values = v.double().repeat_interleave(rep, dim=2) if rep > 1 else v.double()
        rebuilt = torch.einsum("bhqk,bkhd->bqhd", pattern.double(), values)
        out.append(
            compare(
                f"{a}hook_z == {a}hook_pattern @ {a}hook_v",
                (a + "hook_z", a + "hook_v", a + "hook_pattern"),
                rebuilt,
                z,
                rtol=rtol,
            )
        )
    else:
        out.append(
            compare(
                f"{a}hook_z == {a}hook_pattern @ {a}hook_v",
                (a + "hook_z", a + "hook_v", a + "hook_pattern"),
                None,
                None,
                rtol=rtol,
            )
        )
    scores = cache.get(a + "hook_attn_scores")
    if scores is not None and pattern is not None:
        allowed = torch.isfinite(scores)
        rebuilt = torch.softmax(
            scores.double().masked_fill(~allowed, -math.inf), dim=-1
        ).nan_to_num(0.0)
        if attention_sinks:
            rebuilt = rebuilt * pattern.double().sum(dim=-1, keepdim=True)
        what = "softmax(scores) * its row sum" if attention_sinks else "softmax(scores)"
        out.append(
            compare(
                f"{a}hook_pattern == {what.replace('scores', a + 'hook_attn_scores')}",
                (a + "hook_attn_scores",),
                rebuilt,
                pattern,
                rtol=rtol,
            )
        )
        q = cache.get(
            a + ("hook_rot_q" if info.positional_embedding_type == "rotary" else "hook_q")
        )
        k = cache.get(
            a + ("hook_rot_k" if info.positional_embedding_type == "rotary" else "hook_k")
        )
        if q is not None and k is not None and not score_bias:
            out.append(_scores_check(a, q, k, scores, allowed, info, rtol, attn_softcap))
    out.extend(_rotary_checks(a, cache, rtol))
    if W_O is not None and z is not None and a + "hook_out" in cache:
        result = torch.einsum("bqhd,hde->bqe", z.double(), W_O[layer].double())
        if b_O is not None:
            result = result + b_O[layer].double()
        out.append(
            compare(
                f"{a}hook_out == {a}hook_z @ W_O + b_O",
                (a + "hook_out", a + "hook_z"),
                result,
                cache[a + "hook_out"],
                rtol=rtol,
            )
        )
    return out


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """``x`` (``b p h dh``) rotated by a ``b p r`` table on its first ``r`` features."""
    import torch

    r = cos.shape[-1]
    head, rest = x[..., :r], x[..., r:]
    if interleaved:
        turned = torch.stack((-head[..., 1::2], head[..., ::2]), dim=-1).flatten(-2)
    else:
        first, second = head[..., : r // 2], head[..., r // 2 :]
        turned = torch.cat((-second, first), dim=-1)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return torch.cat((head * c + turned * s, rest), dim=-1)


def _rotary_checks(
    a: str, cache: Mapping[str, torch.Tensor], rtol: float
) -> list[CertificationCheck]:
    """``hook_rot_q``/``hook_rot_k`` are ``hook_q``/``hook_k`` (after any QK-norm) rotated by
    the served table, or, without a served table, of the same length (a rotation)."""
    import torch

    q, k = (
        cache.get(a + "q_norm.hook_out", cache.get(a + "hook_q")),
        cache.get(a + "k_norm.hook_out", cache.get(a + "hook_k")),
    )
    rq, rk = cache.get(a + "hook_rot_q"), cache.get(a + "hook_rot_k")
    if rq is None or rk is None or q is None or k is None:
        return []
    sources = [a + "hook_q", a + "hook_k", a + "q_norm.hook_out", a + "k_norm.hook_out"]
    sources = [n for n in sources if n in cache]
    cos, sin = cache.get(a + "hook_cos"), cache.get(a + "hook_sin")
    if cos is not None and sin is not None and cos.shape[-1] <= q.shape[-1]:
        hooks = (*sources, a + "hook_cos", a + "hook_sin")
        tried = []
        half = cos.shape[-1] // 2
        layouts: tuple[tuple[str, torch.Tensor, torch.Tensor, bool], ...] = (
            ("halves", cos, sin, False),
            ("interleaved pairs", cos, sin, True),
            # GLM: the first half of the table, each entry twice, on interleaved pairs.
            (
                "interleaved, half table",
                cos[..., :half].repeat_interleave(2, -1),
                sin[..., :half].repeat_interleave(2, -1),
                True,
            ),
        )
        if 2 * cos.shape[-1] <= q.shape[-1]:
            # gpt-oss: one table entry per rotated pair, applied to the two halves.
            layouts += (
                (
                    "halves, one entry per pair",
                    torch.cat((cos, cos), -1),
                    torch.cat((sin, sin), -1),
                    False,
                ),
            )
        for layout, c, s_, interleaved in layouts:
            got = torch.cat(
                (
                    _rotate(q.double(), c.double(), s_.double(), interleaved),
                    _rotate(k.double(), c.double(), s_.double(), interleaved),
                ),
                dim=2,
            )
            want = torch.cat((rq.double(), rk.double()), dim=2)
            check = compare(
                f"{a}hook_rot_q/k == {a}hook_q/k rotated by {a}hook_cos/sin ({layout})",
                hooks,
                got,
                want,
                rtol=rtol,
            )
            if check.passed:
                return [check]
            tried.append(check)
        return tried[:1]
    lengths = torch.cat((q.double().norm(dim=-1), k.double().norm(dim=-1)), dim=2)
    rotated = torch.cat((rq.double().norm(dim=-1), rk.double().norm(dim=-1)), dim=2)
    # YaRN multiplies its table by an attention factor: one constant for every head and
    # position, fitted here; a plain rotation gives exactly 1.
    factor = float((rotated * lengths).sum() / (lengths * lengths).sum().clamp_min(1e-30))
    scaled = (
        ""
        if abs(factor - 1.0) <= rtol
        else f" times one factor, {factor:.4g} (YaRN's attention factor)"
    )
    return [
        compare(
            f"|{a}hook_rot_q/k| == |{a}hook_q/k|{scaled} (rotation keeps each head's length)",
            sources,
            rotated,
            lengths * factor,
            rtol=rtol,
        )
    ]


def _scores_check(
    a: str,
    q: torch.Tensor,
    k: torch.Tensor,
    scores: torch.Tensor,
    allowed: torch.Tensor,
    info: ModelInfo,
    rtol: float,
    softcap: float | None,
) -> CertificationCheck:
    """Scores are ``q . k`` times one scale per model (fitted), soft-capped if the model caps."""
    import torch

    qn = "hook_rot_q" if info.positional_embedding_type == "rotary" else "hook_q"
    kn = "hook_rot_k" if info.positional_embedding_type == "rotary" else "hook_k"
    rep = q.shape[2] // max(1, k.shape[2])
    keys = k.double().repeat_interleave(rep, dim=2) if rep > 1 else k.double()
    dots = torch.einsum("bqhd,bkhd->bhqk", q.double(), keys)
    target = scores.double()
    if softcap is not None:
        target = torch.atanh((target / softcap).clamp(-1 + 1e-12, 1 - 1e-12)) * softcap
    mask = allowed.expand_as(target)
    x, y = dots[mask], target[mask]
    scale = float((x * y).sum() / (x * x).sum().clamp(min=1e-300)) if x.numel() else 1.0
    return compare(
        f"{a}hook_attn_scores == {a}{qn} . {a}{kn} * scale (fitted {scale:.4g})",
        (a + qn, a + kn),
        dots * scale,
        target,
        rtol=rtol,
        mask=allowed,
    )
