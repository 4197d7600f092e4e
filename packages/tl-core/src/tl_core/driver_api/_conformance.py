"""``check_driver``: the Driver contract, checked by running a booted driver.

A driver's own test suite calls it on each engine it can boot; it goes beyond
``validate_driver`` (the attributes) to what a researcher relies on: every served hook
captures with its canonical shape, aliases resolve through the namespace, a spec edits the
tensor it names and only at the positions it lists, bad names and specs are refused,
ragged batches keep each prompt's length and give each prompt the values it gets alone, and
sampling options change what is generated as they promise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tl_core._errors import DriverContractError, HookNameError, SpecError
from tl_core.driver_api._protocol import Driver, validate_driver
from tl_core.driver_api._request import run_keywords

__all__ = ["check_driver"]

#: A ragged batch: three prompts of different lengths.
_LENGTHS = (5, 9, 2)


def _fail(driver: Any, what: str) -> DriverContractError:
    return DriverContractError(f"driver {getattr(driver, 'name', driver)!r}: {what}")


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(1, max(2, vocab - 1), (n,), generator=gen).tolist() for n in _LENGTHS]


def check_driver(driver: Driver, *, prompts: Sequence[Sequence[int]] | None = None) -> None:
    """Run the contract checks on a booted driver; raises on the first broken promise.

    Args:
        driver: A booted driver (``MyDriver.boot(...)``); it is not closed.
        prompts: Token id lists to run (default: a ragged batch of random ids).

    Raises:
        DriverContractError: Naming what the driver did and what the contract expects.
    """
    validate_driver(driver, name=getattr(driver, "name", None))
    namespace = driver.namespace
    info = driver.info
    rows = [list(p) for p in prompts] if prompts is not None else _prompts(info.d_vocab)
    lengths = tuple(len(r) for r in rows)
    served = namespace.ordered
    result = run_keywords(driver, rows, capture=served, max_new_tokens=0)
    if tuple(result.lengths) != lengths:
        raise _fail(driver, f"returned lengths {result.lengths}, expected {lengths}")
    for name in served:
        _check_shape(driver, name, result.captured.get(name), len(rows), max(lengths))
    if driver.provides_sequence_logits:
        logits = result.logits
        if logits is None or tuple(logits.shape) != (len(rows), max(lengths), info.d_vocab):
            raise _fail(
                driver,
                f"sequence logits have shape {None if logits is None else tuple(logits.shape)}",
            )
    _check_alias(driver)
    _check_padding(driver, rows, result.captured)
    _check_refusals(driver, rows)
    _check_edit(driver, rows)
    if driver.supports("generation"):
        out = run_keywords(driver, rows[:1], max_new_tokens=3, stop_at_eos=False)
        if out.new_tokens is None or tuple(out.new_tokens.shape) != (1, 3):
            raise _fail(driver, "generation did not return [batch, 3] new tokens")
        _check_sampling(driver, rows[:2])


#: Tokens sampled per prompt: on a model with a flat next-token distribution (the tiny random
#: ones drivers are tested on), two samplings of this many agree only by a chance of about
#: ``d_vocab ** -8``, and a sampling agrees with greedy decoding as rarely.
_SAMPLED = 8


def _check_sampling(driver: Any, rows: list[list[int]]) -> None:
    """Each sampling option changes what is generated, as it promises."""

    def generate(**options: Any) -> torch.Tensor:
        out = run_keywords(
            driver, rows, max_new_tokens=_SAMPLED, stop_at_eos=False, return_logits=False, **options
        )
        return torch.as_tensor(out.new_tokens)

    greedy = generate()
    first = generate(do_sample=True, seed=1)
    if torch.equal(first, greedy):
        raise _fail(
            driver,
            f"do_sample=True generated the greedy tokens ({_SAMPLED} per prompt): it ignores do_sample",
        )
    if not torch.equal(generate(do_sample=True, seed=1), first):
        raise _fail(driver, "two samplings with seed=1 differ: it ignores seed")
    if torch.equal(generate(do_sample=True, seed=2), first):
        raise _fail(driver, "seed=1 and seed=2 sampled the same tokens: it ignores seed")
    if not torch.equal(generate(do_sample=True, seed=1, top_k=1), greedy):
        raise _fail(driver, "sampling with top_k=1 differs from greedy decoding: it ignores top_k")
    # The most likely token alone reaches this nucleus on any vocabulary under a million.
    if not torch.equal(generate(do_sample=True, seed=1, top_p=1e-6), greedy):
        raise _fail(
            driver, "sampling with top_p=1e-6 differs from greedy decoding: it ignores top_p"
        )


def _check_shape(driver: Any, name: str, tensor: Any, batch: int, pos: int) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise _fail(driver, f"serves {name!r} but returned no tensor for it")
    feature = driver.namespace.feature_shape(name)
    expected = (batch, driver.info.n_heads, pos, pos) if feature is None else (batch, pos, *feature)
    if tuple(tensor.shape) != expected:
        raise _fail(driver, f"{name!r} has shape {tuple(tensor.shape)}, expected {expected}")


def _check_alias(driver: Any) -> None:
    canonical = "blocks.0.hook_out"
    if canonical not in driver.namespace.served:
        return
    result = run_keywords(
        driver, [[1, 2, 3]], capture=["blocks.0.hook_resid_post"], max_new_tokens=0
    )
    if set(result.captured) != {canonical}:
        raise _fail(
            driver,
            f"capturing an alias returned keys {sorted(result.captured)}, expected the canonical name",
        )


#: Hooks compared between a batch and a prompt run alone: block 0's attention reads every
#: position (a padding or offset mistake shows there) and runs before any router, whose top-k
#: could flip on a rounding difference and make later values legitimately differ.
_PADDING_PROBES = ("embed.hook_out", "blocks.0.attn.hook_out", "blocks.0.attn.hook_z")


def _check_padding(driver: Any, rows: list[list[int]], batched: Mapping[str, torch.Tensor]) -> None:
    """What a prompt gets in a ragged batch, it gets alone and as its own prefix: padding
    and batching change no value a hook serves at a real position."""
    probes = [n for n in _PADDING_PROBES if n in driver.namespace.served]
    if not probes:
        return
    shortest = min(range(len(rows)), key=lambda r: len(rows[r]))
    longest = max(range(len(rows)), key=lambda r: len(rows[r]))
    half = max(1, len(rows[longest]) // 2)
    runs = [
        (f"prompt {shortest} run alone", rows[shortest], shortest),
        (f"the first {half} tokens of prompt {longest} run alone", rows[longest][:half], longest),
    ]
    for what, prompt, row in runs:
        alone = run_keywords(driver, [prompt], capture=probes, max_new_tokens=0).captured
        for name in probes:
            _check_shape(driver, name, alone.get(name), 1, len(prompt))
            want = batched[name][row, : len(prompt)].float()
            got = alone[name][0].float()
            scale = max(1.0, float(want.abs().max()))
            if not torch.allclose(got, want, rtol=1e-3, atol=1e-3 * scale):
                raise _fail(
                    driver,
                    f"{what} gives another {name!r} than in the ragged batch (largest "
                    f"difference {float((got - want).abs().max()):.3g}): padding or batching "
                    f"reaches real positions",
                )


def _check_refusals(driver: Any, rows: list[list[int]]) -> None:
    try:
        run_keywords(driver, rows, capture=["blocks.0.hook_no_such_site"], max_new_tokens=0)
    except HookNameError:
        pass
    else:
        raise _fail(driver, "accepted an unknown hook name instead of raising HookNameError")
    read_only = sorted(driver.namespace.read_only)
    if read_only:
        try:
            run_keywords(
                driver, rows, intervene={read_only[0]: {"op": "suppress"}}, max_new_tokens=0
            )
        except (SpecError, HookNameError):
            pass
        else:
            raise _fail(driver, f"accepted a spec on read-only {read_only[0]!r}")


def _check_edit(driver: Any, rows: list[list[int]]) -> None:
    """A suppress spec at one position zeroes that position of the hook, and only it."""
    namespace = driver.namespace
    target = next(
        (
            n
            for n in namespace.ordered
            if n in namespace.editable and namespace.layout(n) == "b p d"
        ),
        None,
    )
    if target is None:
        return
    position = min(len(r) for r in rows) - 1
    plain = run_keywords(driver, rows, capture=[target], max_new_tokens=0).captured[target]
    spec = {target: {"op": "suppress", "pos": position}}
    edited = run_keywords(
        driver, rows, capture=[target], intervene=spec, max_new_tokens=0
    ).captured[target]
    if bool(edited[:, position].abs().max() > 0):
        raise _fail(
            driver, f"a suppress spec on {target!r} at position {position} left non-zero values"
        )
    others = [p for p in range(edited.shape[1]) if p != position]
    for row, length in enumerate(len(r) for r in rows):
        kept = [p for p in others if p < length]
        if kept and not torch.allclose(edited[row, kept], plain[row, kept]):
            raise _fail(
                driver, f"a spec at position {position} of {target!r} changed other positions"
            )
