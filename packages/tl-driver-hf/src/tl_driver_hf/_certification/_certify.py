"""Certify the ``hf`` driver's hooks on the booted model.

A few token ids run three ways: plain transformers (its logits and ``hidden_states``, the
references), tl capturing every hook (the engine-independent equations of
``tl_core.certification.equation_checks`` plus each norm's weight rule), and tl with one edit
at a time against the same edit made by a plain torch hook on the module that holds the
site (both runs must move the logits alike). Every check names the hooks it vouches for;
``statuses_from_checks`` turns them into each hook's status.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from torch import nn

from tl_core import ConfigError
from tl_core.architecture import uses_alibi
from tl_core.certification import (
    Certification,
    CertificationCheck,
    HookCertificate,
    certified_level,
    compare,
    compare_differs,
    equation_checks,
    silent_hook_checks,
    statuses_from_checks,
)
from tl_driver_hf._architecture._modules import has_attention_sinks
from tl_driver_hf._architecture._probe import probe_ids
from tl_driver_hf._certification._image_checks import image_checks
from tl_driver_hf._certification._weight_checks import (
    exported_weight_checks,
    latent_checks,
    readout_checks,
    weight_rule_checks,
)
from tl_driver_hf._runtime._torch_hooks import _with_input

if TYPE_CHECKING:
    from tl_driver_hf._certification._certification_target import CertifiableDriver

__all__ = ["boot_refusal", "certify_driver", "on_residual_stream"]


def _rtol(dtype: torch.dtype) -> float:
    return 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2


def _add_to_output(delta: torch.Tensor) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if isinstance(output, tuple):
            return (output[0] + delta, *output[1:])
        return output + delta

    return hook


def _add_to_input(delta: torch.Tensor) -> Callable[..., Any]:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = args[0] if args else kwargs["hidden_states"]
        return _with_input(args, kwargs, x + delta)

    return hook


@contextmanager
def _captured(driver: CertifiableDriver, names: list[str]) -> Iterator[dict[str, torch.Tensor]]:
    cache: dict[str, torch.Tensor] = {}
    points = driver.hook_points

    def keep(x: torch.Tensor, *, hook: Any) -> None:
        if isinstance(x, torch.Tensor):
            cache[hook.name] = x.detach().clone()

    handles = [points[n].add_hook(keep) for n in names if n in points]
    try:
        yield cache
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _left_as_found(model: nn.Module) -> Iterator[None]:
    """Undo the output-capturing hooks transformers installs, for good, on the first call
    with ``output_hidden_states``: between runs the model carries no hook it did not have."""
    flag = "_output_capturing_hooks_installed"
    before = {id(m): (set(m._forward_hooks), set(m._forward_pre_hooks)) for m in model.modules()}
    flags = {id(m): vars(m).get(flag) for m in model.modules()}
    try:
        yield
    finally:
        for m in model.modules():
            post, pre = before.get(id(m), (set(), set()))
            for key in [k for k in m._forward_hooks if k not in post]:
                del m._forward_hooks[key]
            for key in [k for k in m._forward_pre_hooks if k not in pre]:
                del m._forward_pre_hooks[key]
            if flags.get(id(m)) is None:
                vars(m).pop(flag, None)


def _plain(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    with torch.no_grad(), _left_as_found(model):
        mask = torch.ones_like(ids)
        out = model(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=True)
    return out.logits, tuple(getattr(out, "hidden_states", None) or ())


def _edit_checks(
    driver: CertifiableDriver, ids: torch.Tensor, rtol: float
) -> list[CertificationCheck]:
    """An edit at each editable site moves the logits as a plain torch hook on its module does."""
    parts = driver.hooked_model.parts
    points = driver.hook_points
    n = len(parts.layers)
    embed_weight = cast(torch.Tensor, parts.embed.weight)
    dtype, d_model = embed_weight.dtype, int(embed_weight.shape[1])
    gen = torch.Generator().manual_seed(0)
    sites: list[tuple[str, nn.Module, Literal["in", "out"], int]] = []
    after: nn.Module | None
    target = 1 if n > 1 else 0
    sites.append((f"blocks.{target}.hook_in", parts.layers[target].layer, "in", d_model))
    # One block: its output is what the head transform (a masked LM's) or final norm reads.
    reader = parts.head_dense if parts.head_dense is not None else parts.final_norm
    after = parts.layers[1].layer if n > 1 else reader
    if after is not None:
        sites.append(("blocks.0.hook_out", after, "in", d_model))
    lay = parts.layers[0]
    adapter = driver.adapter
    if lay.attn is not lay.layer and not adapter.sublayers_add_residual:
        sites.append(("blocks.0.attn.hook_out", lay.attn, "out", d_model))
    if lay.mlp is not lay.layer and not (
        adapter.sublayers_add_residual or adapter.mlp_inline or adapter.mlp_out_inplace
    ):
        sites.append(("blocks.0.mlp.hook_out", lay.mlp, "out", d_model))
    if lay.down is not None and lay.down is not lay.mlp and not adapter.description.moe:
        width = int(
            cast(torch.Tensor, lay.down.weight).shape[1 if adapter.linear == "linear" else 0]
        )
        sites.append(("blocks.0.mlp.hook_post", lay.down, "in", width))
    if adapter.description.norm_after_residual:
        # Post-LN (BERT): the sublayers' outputs are their projections', and each norm's
        # input is a residual sum no other module reads.
        sites.append(("blocks.0.attn.hook_out", lay.o, "out", d_model))
        if lay.down is not None:
            sites.append(("blocks.0.mlp.hook_out", lay.down, "out", d_model))
        for norm, module in (("ln1", lay.ln1), ("ln2", lay.ln2)):
            if module is not None:
                sites.append((f"blocks.0.{norm}.hook_in", module, "in", d_model))
    if lay.mixer is not None:
        sites += [
            ("blocks.0.mixer.hook_in", lay.mixer, "in", d_model),
            ("blocks.0.mixer.hook_out", lay.mixer, "out", d_model),
        ]
    info = driver.info
    for suffix, latent, latent_width in (
        ("hook_q_latent", lay.q_latent, info.d_q_latent),
        ("hook_kv_latent", lay.kv_latent, info.d_kv_latent),
    ):
        if latent is not None and latent_width is not None:
            sites.append((f"blocks.0.attn.{suffix}", latent, "out", latent_width))
    if lay.o is not lay.attn and lay.o is not lay.layer:
        width = int(cast(torch.Tensor, lay.o.weight).shape[1 if adapter.linear == "linear" else 0])
        sites.append(("blocks.0.attn.hook_z", lay.o, "in", width))
    checks: list[CertificationCheck] = []
    for name, module, side, width in sites:
        if name not in points:
            continue
        vec = torch.randn(width, generator=gen).to(dtype=dtype, device=ids.device)
        hook = _add_to_input(vec) if side == "in" else _add_to_output(vec)
        handle = (
            module.register_forward_pre_hook(hook, with_kwargs=True)
            if side == "in"
            else module.register_forward_hook(hook)
        )
        try:
            plain, _ = _plain(driver.hf_model, ids)
        finally:
            handle.remove()
        view = vec if name != "blocks.0.attn.hook_z" else vec.reshape(driver.info.n_heads, -1)
        edit = points[name].add_hook(lambda x, *, hook, v=view: x + v.to(x.dtype))
        try:
            with torch.no_grad():
                edited = driver.run_model(ids)
        finally:
            edit.remove()
        template = name.replace("blocks.0.", "blocks.{i}.").replace(
            f"blocks.{target}.", "blocks.{i}."
        )
        vouched = [template.format(i=i) for i in range(n)] if "{i}" in template else [name]
        where = "input" if side == "in" else "output"
        checks.append(
            compare(
                f"an edit at {template} moves the logits as adding to {type(module).__name__}'s {where} does",
                vouched,
                edited,
                plain,
                rtol=rtol,
            )
        )
    return checks


def certify_driver(
    driver: CertifiableDriver,
    *,
    model: str,
    inferred: bool,
    description: dict[str, str],
    thorough: bool = True,
) -> Certification:
    """Run the checks on ``driver``'s booted model and build the report.

    Args:
        driver: The booted driver (its hooks are those to certify).
        model: What was booted, for the report.
        inferred: Whether the architecture was inferred.
        description: Facts about the architecture for the report.
        thorough: Every check. Otherwise (the boot of a described family, whose parity
            tests check the rest by hand) only the equations over tl's own capture: no run
            of plain transformers, no edit or weight checks.
    """
    parts = driver.hooked_model.parts
    embed_weight = cast(torch.Tensor, parts.embed.weight)
    ids = probe_ids(int(embed_weight.shape[0])).to(driver.device)
    rtol = _rtol(embed_weight.dtype)
    n = driver.info.n_layers
    reference = later = None
    hidden: tuple[torch.Tensor, ...] = ()
    if thorough:
        # One plain forward of two rows: the probe, and the probe with its last token
        # changed (for causality).
        changed = ids.clone()
        changed[0, -1] = (int(ids[0, -1]) + 1) % int(embed_weight.shape[0])
        both, hidden = _plain(driver.hf_model, torch.cat((ids, changed)))
        reference, later = both[:1], both[1:]
        hidden = tuple(h[:1] for h in hidden)
    notes: list[CertificationCheck] = []
    if thorough and len(hidden) != n + 1:
        notes.append(
            CertificationCheck(
                "blocks.{i}.hook_in == the engine's hidden_states[i]",
                (),
                True,
                0.0,
                0.0,
                f"not compared: the engine returned {len(hidden)} hidden states for {n} blocks",
            )
        )
        hidden = ()
    names = [name for name in driver.hook_points]
    stop = None if thorough else min(_QUICK_BLOCKS, n)
    if stop is not None:
        # The boot of a described family: its blocks are alike, so the first ones show
        # whether this checkpoint matches the description; the run stops there.
        names = [name for name in names if _before_block(name, stop)]
    with _captured(driver, names) as cache, torch.no_grad():
        out = driver.run_model(ids, stop_at_layer=stop)
    logits = out if stop is None else None  # stopped early: the residual stream, no logits
    W_O = b_O = None
    if any(name.endswith("attn.hook_z") for name in cache):
        try:
            W_O, b_O = driver.hooked_model.W_O, driver.hooked_model.b_O
        except Exception:  # an attention without a recognisable output projection
            W_O = b_O = None
        if W_O is not None and W_O.is_meta:  # offloaded to disk: the equation needs values
            W_O = b_O = None
    softcap_field = driver.adapter.description.attn_softcap
    softcap = getattr(driver.hf_model.config, softcap_field, None) if softcap_field else None
    info = driver.info if stop is None else dataclasses.replace(driver.info, n_layers=stop)
    checks = equation_checks(
        cache,
        info,
        rtol=rtol,
        hidden_states=hidden,
        logits=logits,
        reference_logits=reference,
        W_O=W_O,
        b_O=b_O,
        attn_softcap=float(softcap) if softcap is not None else None,
        score_bias=uses_alibi(driver.hf_model.config),
        attention_sinks=has_attention_sinks(parts),
    )
    if later is not None and reference is not None:
        checks.append(_direction_check(driver, later, reference, rtol))
    checks += weight_rule_checks(driver, cache, rtol)
    checks += latent_checks(driver, cache, rtol)
    if logits is not None:
        checks += readout_checks(driver, cache, ids, logits, rtol)
    checks += silent_hook_checks([n for n in names if not _opt_in(n)], cache)
    vision = driver.architecture.vision
    if vision is not None and isinstance(vision.tokens_per_image, int):
        checks += image_checks(driver, vision, rtol)
    weight_checks: dict[str, CertificationCheck] = {}
    unchecked_weights: dict[str, HookCertificate] = {}
    if thorough:
        weight_checks, unchecked_weights = exported_weight_checks(
            driver, cache, ids, rtol, inferred=inferred
        )
        checks += list({id(c): c for c in weight_checks.values()}.values())
        checks += _edit_checks(driver, ids, rtol)
    checks += notes
    statuses = statuses_from_checks(
        _all_names(driver),
        checks,
        described=not inferred,
        absent=driver.absent_reasons,
        read_only=driver.read_only_reasons,
        strict=True,  # an equation vouches for nothing when another hook it covers failed
    )
    if not thorough:
        _every_layer_alike(statuses)
    _follow_parents(statuses)
    level = certified_level(statuses, n)
    scope = (
        "every check: plain transformers as the reference, the attention direction, edits against plain torch hooks, weights"
        if thorough
        else f"quick (the boot of a described family): tl's own equations over blocks 0-{min(_QUICK_BLOCKS, n) - 1}; "
        "driver.certify() runs every check"
    )
    description = {**description, "scope": scope}
    return Certification(
        model=model,
        driver="hf",
        family="inferred" if inferred else driver.adapter.family,
        inferred=inferred,
        level=level,
        description=description,
        architecture=driver.architecture,
        checks=tuple(checks),
        statuses=statuses,
        weights={
            **{
                name: HookCertificate("real", c.equation)
                if c.passed
                else HookCertificate("uncertified", f"failed: {c.line()}")
                for name, c in weight_checks.items()
            },
            **unchecked_weights,
        },
    )


#: Opt-in hooks no equation sees (they fire only in a mode): each holds what its parents
#: hold, so it is served only where they certified.
_PARENTS = {
    "hook_q_input": ("hook_in", "hook_q"),
    "hook_k_input": ("hook_in", "hook_k"),
    "hook_v_input": ("hook_in", "hook_v"),
    "hook_result": ("hook_z", "hook_out"),
}


def _follow_parents(statuses: dict[str, HookCertificate]) -> None:
    for name, cert in list(statuses.items()):
        prefix, _, leaf = name.rpartition(".")
        parents = _PARENTS.get(leaf)
        if parents is None or cert.status != "real":
            continue
        for parent in (f"{prefix}.{p}" for p in parents):
            status = statuses.get(parent)
            if status is None or status.status != "real":
                statuses[name] = HookCertificate(
                    "uncertified", f"it holds what {parent} holds, which is not certified"
                )
                break


#: Blocks the quick certification (the boot of a described family) runs and checks.
_QUICK_BLOCKS = 2


def _before_block(name: str, stop: int) -> bool:
    """Whether a hook fires before block ``stop`` (model-level hooks after the blocks do not)."""
    parts = name.split(".")
    if parts[0] == "blocks":
        return int(parts[1]) < stop
    return parts[0] in ("embed", "pos_embed", "embed_ln")


def _every_layer_alike(statuses: dict[str, HookCertificate]) -> None:
    """A site that failed in a checked block is not served in any block (same wiring)."""
    failed: dict[str, tuple[str, str]] = {}
    for name, cert in statuses.items():
        parts = name.split(".")
        if cert.status == "uncertified" and parts[0] == "blocks":
            failed.setdefault(".".join(parts[2:]), (name, cert.reason))
    for name, cert in list(statuses.items()):
        parts = name.split(".")
        if parts[0] == "blocks" and cert.status == "real" and ".".join(parts[2:]) in failed:
            where, why = failed[".".join(parts[2:])]
            statuses[name] = HookCertificate("uncertified", f"as {where}: {why}")


def _opt_in(name: str) -> bool:
    """Opt-in hooks that fire only in a mode (split per-head inputs, per-head results)."""
    return name.endswith(("hook_q_input", "hook_k_input", "hook_v_input", "hook_result"))


def _all_names(driver: CertifiableDriver) -> list[str]:
    return [*driver.hooked_model.hook_points, *driver.absent_reasons]


def on_residual_stream(name: str) -> bool:
    """Whether a hook is outside the blocks or a block's input or output."""
    return not name.startswith("blocks.") or (
        name.count(".") == 2 and name.endswith((".hook_in", ".hook_out"))
    )


def _direction_check(
    driver: CertifiableDriver, later: torch.Tensor, reference: torch.Tensor, rtol: float
) -> CertificationCheck:
    """The attention direction the description claims, against plain transformers: a causal
    stack's earlier logits ignore a change of the last token, an encoder's read it."""
    stacks = driver.adapter.description.stacks
    if stacks and stacks[0].attention == "bidirectional":
        check = compare_differs
        equation = (
            "logits before the last position read the last token (the model attends both ways)"
        )
    else:
        check = compare
        equation = "logits before the last position ignore the last token (the model is causal)"
    return check(equation, ("unembed.hook_out",), later[:, :-1], reference[:, :-1], rtol=rtol)


def boot_refusal(
    cert: Certification,
    *,
    inferred: bool,
    architecture: str | None,
    family: str,
    layers: str,
    name: str,
) -> ConfigError | None:
    """Why a boot must be refused after certification, or ``None``: the model's run or its
    residual stream fails, or (inferred) nothing confirms the layer list is the stream.

    Args:
        cert: The boot's report.
        inferred: Whether the architecture was inferred.
        architecture: The architecture's class name.
        family: The described family (when not inferred).
        layers: The decoder-layer list's path.
        name: What was booted.
    """
    unconfirmed = [c for c in cert.checks if c.detail.startswith("not compared")]
    if inferred and unconfirmed:
        return ConfigError(
            f"architecture {architecture!r} has no hand-written description, and transformers' "
            f"own hidden_states cannot confirm that the inferred layer list ({layers}) is the "
            f"model's residual stream ({unconfirmed[0].detail}); describe it with an "
            f"ArchitectureAdapter (docs/adding-a-family.md)."
        )
    if cert.residual_holds:
        return None
    first = sorted(
        cert.failed, key=lambda c: (not c.equation.startswith("logits"), not c.on_residual)
    )
    failed = "; ".join(c.line() for c in first[:3])
    if inferred:
        return ConfigError(
            f"architecture {architecture!r} has no hand-written description and the one "
            f"inferred from its modules does not reproduce the model ({failed}); tl refuses to "
            f"serve it rather than serve a wrong tensor. Describe it with an ArchitectureAdapter "
            f"(docs/adding-a-family.md)."
        )
    return ConfigError(
        f"the {family!r} description does not hold for {name}: its residual stream fails "
        f"certification ({failed}); tl refuses to serve it rather than serve a wrong tensor. "
        f"Fix the adapter (docs/adding-a-family.md)."
    )
