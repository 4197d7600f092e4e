"""Certification against the model's own parameters, beside the equations over hooks.

Multi-head latent attention's up-projections, each norm's weight rule, the exported weights
(``W_Q``, ``W_in``...) applied to the captured inputs, and the readout (token ids, the
unembedding, soft-capped logits). ``certify_driver`` (``_certify``) runs them.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from tl_core.certification import CertificationCheck, HookCertificate, compare
from tl_driver_hf._runtime._norms import apply_weight

if TYPE_CHECKING:
    from tl_driver_hf._certification._certification_target import CertifiableDriver

__all__ = ["exported_weight_checks", "latent_checks", "readout_checks", "weight_rule_checks"]


def _per_head(up: nn.Module, latent: torch.Tensor, heads: int) -> torch.Tensor | None:
    """``up(latent)`` split into ``heads`` per position (``[b, p, heads, -1]``), or ``None``
    where the latent does not fit the projection or its output does not split evenly."""
    try:
        with torch.no_grad():
            out: torch.Tensor = up(latent)
    except RuntimeError:  # a latent of another width than the projection reads
        return None
    if out.shape[-1] % heads:
        return None
    return out.reshape(*out.shape[:2], heads, -1)


def _unexpandable(name: str, up: str | None) -> CertificationCheck:
    detail = f"{up} does not take it, or its output does not split into the heads"
    return CertificationCheck(
        f"{name} expanded by {up} gives every head", (name,), False, math.inf, 0.0, detail
    )


def latent_checks(
    driver: CertifiableDriver, cache: dict[str, torch.Tensor], rtol: float
) -> list[CertificationCheck]:
    """Multi-head latent attention: each head's value and the unrotated part of its key and
    query are the up-projections of the served latents (``[nope | rope]`` per head)."""
    checks: list[CertificationCheck] = []
    for i, layer in enumerate(driver.hooked_model.parts.layers):
        a = f"blocks.{i}.attn."
        kv, v, k = (
            cache.get(a + "hook_kv_latent"),
            cache.get(a + "hook_v"),
            cache.get(a + "hook_rot_k"),
        )
        if kv is None or layer.kv_up is None or v is None or k is None:
            continue
        kv_heads = _per_head(layer.kv_up, kv, v.shape[2])
        if kv_heads is None:
            checks.append(_unexpandable(a + "hook_kv_latent", driver.adapter.kv_up))
            continue
        nope = kv_heads.shape[-1] - v.shape[-1]
        vouched = (a + "hook_kv_latent",)
        for target, got, want in (
            ("hook_v", v, kv_heads[..., nope:]),
            ("hook_rot_k[..., :nope]", k[..., :nope], kv_heads[..., :nope]),
        ):
            equation = (
                f"{a}{target} == {a}hook_kv_latent expanded by {driver.adapter.kv_up} (per head)"
            )
            checks.append(compare(equation, vouched, got, want, rtol=rtol))
        q_latent, q = cache.get(a + "hook_q_latent"), cache.get(a + "hook_rot_q")
        if q_latent is None or layer.q_up is None or q is None:
            continue
        q_heads = _per_head(layer.q_up, q_latent, q.shape[2])
        if q_heads is None:
            checks.append(_unexpandable(a + "hook_q_latent", driver.adapter.q_up))
            continue
        equation = f"{a}hook_rot_q[..., :nope] == {a}hook_q_latent expanded by {driver.adapter.q_up} (per head)"
        checks.append(
            compare(equation, (a + "hook_q_latent",), q[..., :nope], q_heads[..., :nope], rtol=rtol)
        )
    return checks


def weight_rule_checks(
    driver: CertifiableDriver, cache: dict[str, torch.Tensor], rtol: float
) -> list[CertificationCheck]:
    """Each norm's output is its ``hook_normalized`` through the family's weight rule."""
    parts = driver.hooked_model.parts
    modules: dict[str, nn.Module | None] = {
        "ln_final": parts.final_norm,
        "embed_ln": parts.embed_norm,
    }
    for i, lay in enumerate(parts.layers):
        for key in ("ln1", "ln2", "ln1_post", "ln2_post"):
            modules[f"blocks.{i}.{key}"] = getattr(lay, key)
    checks: list[CertificationCheck] = []
    kind = driver.adapter.description.norm
    if kind is None or kind == "unknown":
        return checks  # no weight rule to check against (nor hook_normalized served)
    for prefix, module in modules.items():
        normed, out = cache.get(f"{prefix}.hook_normalized"), cache.get(f"{prefix}.hook_out")
        weight = getattr(module, "weight", None)
        if (
            module is None
            or normed is None
            or out is None
            or (weight is not None and weight.is_meta)
        ):
            continue
        rebuilt = apply_weight(normed, module, kind, out.dtype)
        checks.append(
            compare(
                f"{prefix}.hook_out == {kind} weight rule of {prefix}.hook_normalized",
                (f"{prefix}.hook_normalized", f"{prefix}.hook_scale"),
                rebuilt,
                out,
                rtol=rtol,
            )
        )
    return checks


def exported_weight_checks(
    driver: CertifiableDriver,
    cache: dict[str, torch.Tensor],
    ids: torch.Tensor,
    rtol: float,
    *,
    inferred: bool,
) -> tuple[dict[str, CertificationCheck], dict[str, HookCertificate]]:
    """Each weight accessor reproduces, in block 0, the activation its matrix produces."""
    model = driver.hooked_model
    b = "blocks.0."
    get = cache.get
    found: dict[str, CertificationCheck] = {}

    def weight(name: str, layer: bool = True) -> torch.Tensor | None:
        """Block 0's slice of a stacked weight (``layer``), or the whole model-level one."""
        try:
            value = getattr(model, name)
        except Exception:  # no such matrix in this family (a mixture of experts, no bias)
            return None
        if value.is_meta:
            return None
        picked: torch.Tensor = value[0] if layer else value
        return picked.detach().double()

    def check(
        names: tuple[str, ...], equation: str, got: torch.Tensor | None, want: torch.Tensor | None
    ) -> None:
        if got is None:
            return  # its input is not served here: nothing to check the weight against
        result = compare(equation, (), got, want, rtol=rtol)
        for name in names:
            found.setdefault(name, result)
            if not result.passed:
                found[name] = result

    def project(
        x: torch.Tensor | None, w: str, bias: str | None, per_head: bool
    ) -> torch.Tensor | None:
        W, B = weight(w), weight(bias) if bias is not None else None
        if x is None or W is None:
            return None
        if x.shape[-1] != W.shape[-2]:
            return torch.full((1,), math.nan, dtype=torch.float64)  # shapes disagree: fails
        # Per head: [d_model] @ [h, d_model, dh] -> [h, dh].
        out = torch.einsum("bpd,hde->bphe", x.double(), W) if per_head else x.double() @ W
        return out if B is None else out + B

    reader = get(b + "attn.hook_in", get(b + "ln1.hook_out"))
    for key in ("Q", "K", "V"):
        target = get(f"{b}attn.hook_{key.lower()}")
        if target is not None:
            check((f"W_{key}", f"b_{key}"), f"{b}attn.hook_{key.lower()} == attention's input @ W_{key}[0] + b_{key}[0]",
                  project(reader, f"W_{key}", f"b_{key}", True), target)  # fmt: skip
    if not driver.adapter.description.moe:
        mlp_in = get(b + "mlp.hook_in")
        gated = driver.adapter.description.gated
        pre, lin = get(b + "mlp.hook_pre"), get(b + "mlp.hook_pre_linear")
        if gated and pre is not None:
            check(
                ("W_gate",),
                f"{b}mlp.hook_pre == {b}mlp.hook_in @ W_gate[0]",
                project(mlp_in, "W_gate", None, False),
                pre,
            )
        first = lin if gated else pre
        if first is not None:
            site = "hook_pre_linear" if gated else "hook_pre"
            check(
                ("W_in", "b_in"),
                f"{b}mlp.{site} == {b}mlp.hook_in @ W_in[0] + b_in[0]",
                project(mlp_in, "W_in", "b_in", False),
                first,
            )
        post, out = get(b + "mlp.hook_post"), get(b + "mlp.hook_out")
        if out is not None and post is not None:
            check(
                ("W_out", "b_out"),
                f"{b}mlp.hook_out == {b}mlp.hook_post @ W_out[0] + b_out[0]",
                project(post, "W_out", "b_out", False),
                out,
            )
    z, attn_out = get(b + "attn.hook_z"), get(b + "attn.hook_out")
    W_O = weight("W_O")
    if z is not None and attn_out is not None and W_O is not None:
        result = torch.einsum("bphd,hde->bpe", z.double(), W_O)
        b_O = weight("b_O")
        check(
            ("W_O", "b_O"),
            f"{b}attn.hook_out == {b}attn.hook_z @ W_O[0] + b_O[0]",
            result if b_O is None else result + b_O,
            attn_out,
        )
    embed = get("embed.hook_out")
    with contextlib.suppress(Exception):  # a family without these accessors
        W_E = model.W_E
        if embed is not None and not W_E.is_meta:
            rows = W_E[ids.to(W_E.device)].double()  # the rows first: W_E is vocabulary-sized
            check(("W_E",), "embed.hook_out == W_E[tokens]", rows.to(embed.device), embed)
    normed, logits = get("ln_final.hook_out"), get("unembed.hook_out")
    with contextlib.suppress(Exception):
        W_U, b_U = model.W_U, model.b_U
        if normed is not None and logits is not None and not W_U.is_meta:
            rebuilt = (
                normed.to(W_U.dtype) @ W_U + b_U
            ).double()  # in the model's dtype: W_U is large
            check(
                ("W_U", "b_U"), "unembed.hook_out == ln_final.hook_out @ W_U + b_U", rebuilt, logits
            )
    unchecked: dict[str, HookCertificate] = {}
    if inferred:
        why = "no served activation of this model checks it, and its architecture was inferred"
        unchecked = {
            n: HookCertificate("uncertified", why)
            for n in _WEIGHTS
            if n not in found and weight(n, layer=False) is not None
        }
    return found, unchecked


_WEIGHTS = (
    "W_E",
    "W_Q",
    "W_K",
    "W_V",
    "b_Q",
    "b_K",
    "b_V",
    "W_O",
    "b_O",
    "W_in",
    "W_gate",
    "W_out",
    "b_in",
    "b_out",
    "W_U",
    "b_U",
)


def readout_checks(
    driver: CertifiableDriver,
    cache: dict[str, torch.Tensor],
    ids: torch.Tensor,
    logits: torch.Tensor,
    rtol: float,
) -> list[CertificationCheck]:
    """The token ids, the final norm's output through the unembedding, and the logits."""
    start = driver.adapter.position_ids_start
    positions = torch.arange(ids.shape[1], device=ids.device) + start
    # The integer inputs each embedding table must receive; certification passes no segment
    # ids, so the model's default, sentence A (0), is the token-type table's.
    expected = {
        "embed.hook_in": ("the token ids", ids),
        "pos_embed.hook_in": ("the positions", positions.expand_as(ids)),
        "token_type_embed.hook_in": ("the segment ids (0: none given)", torch.zeros_like(ids)),
    }
    checks = [
        compare(f"{name} == {what}", (name,), cache[name].double(), want.double(), rtol=0.0)
        for name, (what, want) in expected.items()
        if name in cache
    ]
    checks += _head_transform_checks(driver, cache, rtol)
    head, normed, out = (
        driver.hooked_model.parts.lm_head,
        cache.get("ln_final.hook_out"),
        cache.get("unembed.hook_out"),
    )
    if normed is not None and out is not None:
        with torch.no_grad():
            rebuilt = head(normed)
        checks.append(
            compare(
                "unembed.hook_out == unembedding(ln_final.hook_out)",
                ("ln_final.hook_out",),
                rebuilt,
                out,
                rtol=rtol,
            )
        )
    if out is not None:
        capped = driver._softcap(out)
        checks.append(
            compare(
                "the logits == unembed.hook_out (soft-capped where the model caps)",
                ("unembed.hook_out",),
                capped,
                logits,
                rtol=rtol,
            )
        )
    return checks


def _head_transform_checks(
    driver: CertifiableDriver, cache: dict[str, torch.Tensor], rtol: float
) -> list[CertificationCheck]:
    """A masked LM's head transform: its projection's output is the projection of its input,
    and the final norm reads the activation of that output (where the activation is a
    module)."""
    parts = driver.hooked_model.parts
    x, dense_out = cache.get("mlm_head.hook_in"), cache.get("mlm_head.hook_out")
    if parts.head_dense is None or x is None or dense_out is None:
        return []
    with torch.no_grad():
        projected = parts.head_dense(x)
    checks = [
        compare(
            "mlm_head.hook_out == the head transform's projection of mlm_head.hook_in",
            ("mlm_head.hook_out",),
            dense_out,
            projected,
            rtol=rtol,
        )
    ]
    normed_in = cache.get("ln_final.hook_in")
    if parts.head_act is not None and normed_in is not None:
        with torch.no_grad():
            activated = parts.head_act(dense_out)
        checks.append(
            compare(
                "ln_final.hook_in == the head transform's activation of mlm_head.hook_out",
                ("mlm_head.hook_out", "ln_final.hook_in"),
                normed_in,
                activated,
                rtol=rtol,
            )
        )
    return checks
