"""Certification of an encoder-decoder on the hf driver.

One forward of two short random prompts and their decoder inputs, twice: plainly, with
torch hooks that record what each of transformers' blocks receives, and through tl with
every site captured. The engine-independent equations (``stacked_equation_checks``) hold
each stack's chain and its blocks' residual, norm and attention equations; this module
adds what needs the model's weights (each projection's output from its input, the output
projections) and two edit checks: an ``add`` at a block's input and at cross-attention's
output must equal the same add made by a plain torch hook. A site that fails is not served;
a model whose logits or residual stream fail is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from tl_core import ConfigError
from tl_core.certification import (
    Certification,
    CertificationCheck,
    compare,
    stacked_equation_checks,
    statuses_from_checks,
)
from tl_core.driver_api import canonical_hook_names
from tl_driver_hf._runtime._torch_hooks import _input_of
from tl_driver_hf._runtime._whole_model import plain_add

if TYPE_CHECKING:
    from tl_driver_hf._seq2seq._driver import Seq2SeqDriver

__all__ = ["certify_seq2seq"]

_RTOL = 1e-4


def _inputs(driver: Seq2SeqDriver) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    high = min(driver.info.d_vocab, 1000)
    encoder = torch.randint(3, high, (2, 7), generator=generator)
    decoder = torch.randint(3, high, (2, 5), generator=generator)
    return encoder.to(driver.device), decoder.to(driver.device)


_Blocks = dict[str, list[torch.Tensor]]


def _reference(
    driver: Seq2SeqDriver, encoder: torch.Tensor, decoder: torch.Tensor
) -> tuple[Any, _Blocks, _Blocks]:
    """The plain forward, with each block's input as transformers hands it over and its
    output as the block returns it, per stack."""
    inputs: _Blocks = {}
    block_outputs: _Blocks = {}
    handles = []
    for stack in driver.stacks:
        seen: list[torch.Tensor] = []
        outputs: list[torch.Tensor] = []
        inputs[stack.prefix] = seen
        block_outputs[stack.prefix] = outputs
        for block in stack.blocks:

            def keep(m: nn.Module, a: tuple[Any, ...], k: dict[str, Any], s: Any = seen) -> None:
                s.append(_input_of(a, k).detach().clone())

            def keep_out(m: nn.Module, a: tuple[Any, ...], out: Any, s: Any = outputs) -> None:
                s.append((out[0] if isinstance(out, tuple) else out).detach().clone())

            handles.append(block.register_forward_pre_hook(keep, with_kwargs=True))
            handles.append(block.register_forward_hook(keep_out))
    try:
        with torch.no_grad():
            out = driver.hf_model(
                input_ids=encoder,
                decoder_input_ids=decoder,
                use_cache=False,
                output_hidden_states=True,
            )
    finally:
        for handle in handles:
            handle.remove()
    return out, inputs, block_outputs


def _captured(
    driver: Seq2SeqDriver, encoder: torch.Tensor, decoder: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    store: dict[str, torch.Tensor] = {}
    handles = []
    for name, point in driver.candidate_points.items():

        def keep(x: torch.Tensor, *, hook: Any, n: str = name) -> None:
            store[n] = x.detach().clone()

        handles.append(point.add_hook(keep))
    try:
        with torch.no_grad():
            logits = driver.run_model(encoder, decoder_input_ids=decoder)
    finally:
        for handle in handles:
            handle.remove()
    return logits, store


def _heads(w: nn.Linear, x: torch.Tensor, n_heads: int) -> torch.Tensor:
    y = nn.functional.linear(
        x.double(), w.weight.double(), None if w.bias is None else w.bias.double()
    )
    return y.reshape(*y.shape[:-1], n_heads, -1)


def _projection_checks(
    driver: Seq2SeqDriver, store: dict[str, torch.Tensor], encoder_out: torch.Tensor
) -> list[CertificationCheck]:
    """Each attention's q/k/v from its input (cross-attention's k/v from the encoder's
    output) and its output from z through the output projection."""
    checks: list[CertificationCheck] = []
    for stack in driver.stacks:
        for i, sites in enumerate(stack.sites):
            for attn in ("attn", "cross_attn"):
                b = f"{stack.prefix}.{i}.{attn}."
                if b + "hook_in" not in store:
                    continue
                source = {"q": store[b + "hook_in"]}
                kv = encoder_out if attn == "cross_attn" else store[b + "hook_in"]
                source.update(k=kv, v=kv)
                for x in ("q", "k", "v"):
                    site = sites.get(f"{attn}.hook_{x}")
                    got = store.get(b + f"hook_{x}")
                    if site is None or got is None:
                        continue
                    n = got.shape[-2]
                    want = _heads(site.module, source[x], n)  # type: ignore[arg-type]
                    what = (
                        "the encoder's output" if x != "q" and attn == "cross_attn" else "hook_in"
                    )
                    checks.append(
                        compare(
                            f"{b}hook_{x} == W_{x.upper()}({what})",
                            (b + f"hook_{x}",),
                            want,
                            got,
                            rtol=_RTOL,
                        )
                    )
                o = sites.get(f"{attn}.hook_z")
                z, out = store.get(b + "hook_z"), store.get(b + "hook_out")
                if o is not None and z is not None and out is not None:
                    w: nn.Linear = o.module  # type: ignore[assignment]
                    want = nn.functional.linear(
                        z.flatten(-2).double(),
                        w.weight.double(),
                        None if w.bias is None else w.bias.double(),
                    )
                    checks.append(
                        compare(
                            f"{b}hook_out == {b}hook_z @ W_O + b_O",
                            (b + "hook_out", b + "hook_z"),
                            want,
                            out,
                            rtol=_RTOL,
                        )
                    )
    return checks


def _edit_check(
    driver: Seq2SeqDriver,
    encoder: torch.Tensor,
    decoder: torch.Tensor,
    name: str,
    module: nn.Module,
    pre: bool,
) -> CertificationCheck | None:
    """``add`` at ``name`` through tl == the same add by a plain torch hook on ``module``'s
    input (``pre``) or output (logits)."""
    point = driver.candidate_points.get(name)
    if point is None:
        return None
    delta = torch.randn(driver.info.d_model, generator=torch.Generator().manual_seed(1))
    delta = delta.to(driver.device)
    handle = point.add_hook(lambda x, *, hook: x + delta.to(x.dtype))
    try:
        with torch.no_grad():
            got = driver.run_model(encoder, decoder_input_ids=decoder)
    finally:
        handle.remove()

    with plain_add(module, delta, at_input=pre), torch.no_grad():
        want = driver.hf_model(input_ids=encoder, decoder_input_ids=decoder, use_cache=False).logits
    return compare(
        f"add at {name} == the same add by a plain torch hook", (name,), got, want, rtol=_RTOL
    )


def _weights(
    driver: Seq2SeqDriver,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | None]]:
    """Each stack's self-attention output projections as ``[n_layers, h, dh, d_model]``."""
    W_O: dict[str, torch.Tensor] = {}
    b_O: dict[str, torch.Tensor | None] = {}
    info = driver.info
    for stack in driver.stacks:
        outs = [sites.get("attn.hook_z") for sites in stack.sites]
        if any(o is None for o in outs):
            continue
        linears = [cast(nn.Linear, o.module) for o in outs if o is not None]
        mats = [w.weight.T.reshape(info.n_heads, info.d_head, -1) for w in linears]
        W_O[stack.prefix] = torch.stack(mats).detach()
        biases = [w.bias.detach() for w in linears if w.bias is not None]
        b_O[stack.prefix] = torch.stack(biases) if len(biases) == len(linears) else None
    return W_O, b_O


def certify_seq2seq(driver: Seq2SeqDriver, *, name: str) -> Certification:
    """Certify ``driver``'s sites on its model; serve only those that pass.

    Raises:
        ConfigError: tl's run does not reproduce the model's logits, or the blocks' inputs
            differ from what transformers hands each block.
    """
    encoder, decoder = _inputs(driver)
    reference, block_inputs, block_outputs = _reference(driver, encoder, decoder)
    logits, store = _captured(driver, encoder, decoder)
    W_O, b_O = _weights(driver)
    checks = stacked_equation_checks(
        store,
        driver.info,
        rtol=_RTOL,
        hidden_states=block_inputs,
        logits=logits,
        reference_logits=reference.logits,
        W_O=W_O,
        b_O=b_O,
        score_bias=True,
    )
    checks += _projection_checks(driver, store, reference.encoder_last_hidden_state)
    for stack in driver.stacks:
        for i, want in enumerate(block_outputs[stack.prefix]):
            name_out = f"{stack.prefix}.{i}.hook_out"
            checks.append(
                compare(
                    f"{name_out} == the engine's output of that block",
                    (name_out,),
                    store.get(name_out),
                    want,
                    rtol=_RTOL,
                )
            )
    decoder_states = getattr(reference, "decoder_hidden_states", None)
    if "ln_final.hook_out" in store and decoder_states:
        # The decoder's last hidden state is its final norm's output.
        checks.append(
            compare(
                "ln_final.hook_out == the engine's decoder output",
                ("ln_final.hook_out",),
                store["ln_final.hook_out"],
                decoder_states[-1],
                rtol=_RTOL,
            )
        )
    if "unembed.hook_out" in store:
        # BART adds final_logits_bias after its lm_head: the head's output is not the logits.
        checks.append(
            compare(
                "unembed.hook_out == the logits",
                ("unembed.hook_out",),
                store["unembed.hook_out"],
                reference.logits,
                rtol=_RTOL,
            )
        )
    enc, dec = driver.stacks
    first, last = min(1, len(enc.blocks) - 1), min(1, len(dec.blocks) - 1)
    edits = [
        _edit_check(driver, encoder, decoder, f"encoder_blocks.{first}.hook_in",
                    enc.blocks[first], True),
        _edit_check(driver, encoder, decoder, f"decoder_blocks.{last}.hook_in",
                    dec.blocks[last], True),
        _edit_check(driver, encoder, decoder, "decoder_blocks.0.cross_attn.hook_out",
                    dec.sites[0]["cross_attn.hook_out"].module, False),
    ]  # fmt: skip
    checks += [c for c in edits if c is not None]
    fatal = [
        c for c in checks if not c.passed and (c.equation.startswith("logits") or c.on_residual)
    ]
    if fatal:
        raise ConfigError(
            f"tl's run of {name!r} does not reproduce the model: {fatal[0].line()}; "
            "the encoder-decoder is refused rather than served wrong"
        )
    names = canonical_hook_names(driver.info)
    candidates = set(driver.candidate_points)
    not_built = {
        n: "the hf driver does not serve this site of an encoder-decoder yet"
        for n in names
        if n not in candidates
    }
    statuses = statuses_from_checks(
        names,
        checks,
        described=False,
        # Not served is no structural absence: the model has these tensors.
        absent={n: f"uncertified: {why}" for n, why in not_built.items()},
        read_only=driver.read_only_reasons,
        strict=True,
    )
    refused = {
        n: f"uncertified: {c.reason}"
        for n, c in statuses.items()
        if c.status == "uncertified" and n in candidates
    }
    driver.serve({**not_built, **{n: r.removeprefix("uncertified: ") for n, r in refused.items()}})
    served = {n for n, c in statuses.items() if c.status == "real"}
    sublayers = all(
        f"{s.prefix}.{i}.{x}.hook_out" in served
        for s in driver.stacks
        for i in range(len(s.blocks))
        for x in ("attn", "mlp")
    )
    full = sublayers and all(
        f"{s.prefix}.{i}.attn.hook_pattern" in served
        for s in driver.stacks
        for i in range(len(s.blocks))
    )
    return Certification(
        model=name,
        driver="hf",
        family="inferred",
        inferred=True,
        level="full" if full else "sublayers" if sublayers else "residual",
        description=_description(driver),
        checks=tuple(checks),
        statuses=statuses,
    )


def _description(driver: Seq2SeqDriver) -> dict[str, str]:
    enc, dec = driver.stacks
    kind = "T5-style (a list of sublayers)" if hasattr(enc.blocks[0], "layer") else "BART-style"
    return {
        "kind": "encoder-decoder",
        "blocks": kind,
        "encoder": f"{len(enc.blocks)} blocks, bidirectional",
        "decoder": f"{len(dec.blocks)} blocks, causal, cross-attention to the encoder's output",
        "norms": "post-LN (after each residual add), measured"
        if driver.info.post_residual_norm
        else "pre-LN, measured",
    }
