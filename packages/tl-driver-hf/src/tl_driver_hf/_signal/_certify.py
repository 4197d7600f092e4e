"""Certification of a pixel or audio model on the hf driver.

One forward of a seeded random input of the config's size, twice: plainly, with torch
hooks that record what each block receives and returns, and through tl with every site
captured. Each block's input and output must equal the plain ones, the stream must run on
from each block to the next, the logits must equal the model's, and an ``add`` at a block's
input and at the last block's output must equal the same add by a plain torch hook. The
model is refused when any of these fails: only the residual stream is served, and it is
served right or not at all.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tl_core import ConfigError
from tl_core.certification import (
    Certification,
    CertificationCheck,
    compare,
    statuses_from_checks,
)
from tl_core.driver_api import canonical_hook_names
from tl_driver_hf._runtime._torch_hooks import _input_of
from tl_driver_hf._runtime._whole_model import plain_add
from tl_driver_hf._signal._layout import probe_signal, run_plain

if TYPE_CHECKING:
    from tl_driver_hf._signal._driver import SignalDriver

__all__ = ["certify_signal"]

_RTOL = 1e-4


def _output_of(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output  # type: ignore[no-any-return]


def _reference(
    driver: SignalDriver, signal: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The plain forward's logits, and each block's input and output as transformers
    hands them over."""
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    handles = []
    for block in driver.layout.blocks:
        handles.append(
            block.register_forward_pre_hook(
                lambda m, a, k: inputs.append(_input_of(a, k)), with_kwargs=True
            )
        )
        handles.append(block.register_forward_hook(lambda m, a, o: outputs.append(_output_of(o))))
    try:
        with torch.no_grad():
            logits = run_plain(driver.hf_model, driver.signal_input, signal).logits
    finally:
        for handle in handles:
            handle.remove()
    return logits, inputs, outputs


def _captured(
    driver: SignalDriver, signal: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    store: dict[str, torch.Tensor] = {}
    handles = []
    for name, point in driver.candidate_points.items():

        def keep(x: torch.Tensor, *, hook: Any, name: str = name) -> None:
            store[name] = x.detach().clone()

        handles.append(point.add_hook(keep))
    try:
        with torch.no_grad():
            logits = driver.run_model(signal)
    finally:
        for handle in handles:
            handle.remove()
    return logits, store


def _edit_check(
    driver: SignalDriver,
    signal: torch.Tensor,
    baseline: torch.Tensor,
    name: str,
    block: nn.Module,
    pre: bool,
) -> CertificationCheck:
    """``add`` at ``name`` through tl == the same add by a plain torch hook on ``block``'s
    input (``pre``) or output, compared on the logits."""
    delta = torch.randn(driver.info.d_model, generator=torch.Generator().manual_seed(1))
    delta = delta.to(driver.device)
    handle = driver.candidate_points[name].add_hook(lambda x, *, hook: x + delta.to(x.dtype))
    try:
        with torch.no_grad():
            got = driver.run_model(signal)
    finally:
        handle.remove()

    with plain_add(block, delta, at_input=pre), torch.no_grad():
        want = run_plain(driver.hf_model, driver.signal_input, signal).logits
    check = compare(
        f"add at {name} == the same add by a plain torch hook", (name,), got, want, rtol=_RTOL
    )
    if check.passed and torch.equal(got, baseline):
        # An edit that moves nothing proves nothing.
        return replace(check, passed=False, detail="the add did not change the logits")
    return check


def certify_signal(driver: SignalDriver, *, name: str) -> Certification:
    """Certify ``driver``'s residual sites on its model.

    Raises:
        ConfigError: tl's run does not reproduce the model: its logits, a block's input or
            output, or an edit differ from transformers' own.
    """
    signal = probe_signal(driver.hf_model, driver.signal_input).to(driver.device)
    reference, block_inputs, block_outputs = _reference(driver, signal)
    logits, store = _captured(driver, signal)
    checks = [compare("logits == the engine's logits", (), logits, reference, rtol=_RTOL)]
    n = driver.info.n_layers
    for i in range(n):
        for site, plain, what in (
            ("hook_in", block_inputs, "input"),
            ("hook_out", block_outputs, "output"),
        ):
            hook = f"blocks.{i}.{site}"
            want = plain[i] if i < len(plain) else None
            checks.append(
                compare(
                    f"{hook} == the engine's {what} of block {i}",
                    (hook,),
                    store.get(hook),
                    want,
                    rtol=_RTOL,
                )
            )
        if i + 1 < n:
            out, nxt = f"blocks.{i}.hook_out", f"blocks.{i + 1}.hook_in"
            checks.append(
                compare(f"{out} == {nxt}", (out, nxt), store.get(out), store.get(nxt), rtol=_RTOL)
            )
    blocks = driver.layout.blocks
    edited = min(1, n - 1)
    for site, block, pre in (
        (f"blocks.{edited}.hook_in", blocks[edited], True),
        (f"blocks.{n - 1}.hook_out", blocks[n - 1], False),
    ):
        checks.append(_edit_check(driver, signal, reference, site, block, pre))
    failed = [c for c in checks if not c.passed]
    if failed:
        raise ConfigError(
            f"tl's run of {name!r} does not reproduce the model: {failed[0].line()}; the "
            "model is refused rather than served wrong"
        )
    names = canonical_hook_names(driver.info)
    candidates = set(driver.candidate_points)
    not_built = {
        n: "the hf driver serves the residual stream of models that read pixels or audio "
        "(blocks.{i}.hook_in, hook_out), not their sublayers yet"
        for n in names
        if n not in candidates
    }
    driver.serve(not_built)
    # Not served is no structural absence: the model has these tensors, tl does not read them.
    unserved = {n: f"uncertified: {why}" for n, why in not_built.items()}
    statuses = statuses_from_checks(
        names, checks, described=False, absent=unserved, read_only={}, strict=True
    )
    return Certification(
        model=name,
        driver="hf",
        family="inferred",
        inferred=True,
        level="residual",
        description={
            "kind": "image classifier"
            if driver.signal_input == "pixels"
            else "CTC speech recogniser",
            "reads": driver.signal_input,
            "blocks": f"{driver.layout.path}: {n} blocks on [batch, positions, {driver.info.d_model}]",
        },
        checks=tuple(checks),
        statuses=statuses,
    )
