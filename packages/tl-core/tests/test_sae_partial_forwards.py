"""Spliced dictionaries in partial forwards (``stop_at_layer``, ``start_at_layer`` with
``residual=``): a split forward equals the whole one, and nothing one forward computes
reaches another. A transcoder's input belongs to the forward that read it: a forward that
stops between its two sites keeps nothing for the next, and one that starts after the site
it reads is refused before it runs (its input is not in the residual it is given).

The reference for the whole forward is plain Python hooks running the dictionaries' own
math; the hf driver's copy of these checks is in tl-driver-hf's ``test_dictionaries.py``.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tl_core import TransformerBridge, UserError
from tl_core.hooks import forward_order
from tl_core.sae import SparseDictionary, random_dictionary

N_LAYERS = 3
_PER_BLOCK = ("hook_in", "ln1.hook_out", "attn.hook_out", "ln2.hook_in", "ln2.hook_out",
              "mlp.hook_in", "mlp.hook_out", "hook_out")  # fmt: skip
SITES = ("embed.hook_out", *(f"blocks.{i}.{s}" for i in range(N_LAYERS) for s in _PER_BLOCK))


@pytest.fixture(scope="module")
def llama() -> TransformerBridge:
    return TransformerBridge.boot_native("llama", n_layers=N_LAYERS, seed=2)


def _ids(bridge: TransformerBridge, seed: int, batch: int = 2, length: int = 6) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, bridge.cfg.d_vocab, (batch, length), generator=gen)


def _transcoder(width: int, seed: int) -> SparseDictionary:
    return random_dictionary(width, 3 * width, seed=seed, apply_b_dec_to_input=False, skip=True)


def test_a_transcoders_input_does_not_outlive_its_forward(llama: TransformerBridge) -> None:
    width = llama.cfg.d_model
    t = _transcoder(width, seed=4)
    a, b = _ids(llama, 1), _ids(llama, 2)
    spliced = llama.add_sae(
        t, hook_name="blocks.0.ln2.hook_out", output_hook_name="blocks.1.mlp.hook_out"
    )
    try:
        whole_b = llama(b)
        r_b = llama(b, stop_at_layer=1)
        llama(a, stop_at_layer=1)  # reads a's input to the transcoder, stops before its output
        # Starting after the site it reads: refused (it once decoded batch a into batch b).
        with pytest.raises(
            UserError,
            match=re.escape(
                "start_at_layer=1 begins the forward at block 1, after 'blocks.0.ln2.hook_out', which "
                "the transcoder writing 'blocks.1.mlp.hook_out' reads"
            )
            + r".*start at block 0 or earlier, or remove the transcoder",
        ):
            llama(b, start_at_layer=1, residual=r_b)
        # A forward that stops before the output site returns what the model does there.
        torch.testing.assert_close(
            r_b, llama.run_with_cache(b, names_filter=["blocks.1.hook_in"])[1]["blocks.1.hook_in"]
        )
        torch.testing.assert_close(llama(b), whole_b)
    finally:
        spliced.remove()
    # After the refused forward, the same split without the transcoder runs.
    torch.testing.assert_close(
        llama(b, start_at_layer=1, residual=llama(b, stop_at_layer=1)), llama(b)
    )


def test_a_forward_that_failed_midway_leaves_nothing_behind(llama: TransformerBridge) -> None:
    width = llama.cfg.d_model
    t = _transcoder(width, seed=5)
    a, b = _ids(llama, 3), _ids(llama, 4)
    spliced = llama.add_sae(
        t, hook_name="blocks.0.ln2.hook_out", output_hook_name="blocks.2.mlp.hook_out"
    )

    def boom(x: torch.Tensor, *, hook: Any) -> None:
        raise RuntimeError("a hook failed")

    try:
        want = llama(b)
        with (
            pytest.raises(RuntimeError, match="a hook failed"),
            llama.hooks([("blocks.1.hook_in", boom)]),
        ):
            llama(a)
        assert all(run._pending is None for run in llama.driver._dictionary_runs.values())
        torch.testing.assert_close(llama(b), want)
    finally:
        spliced.remove()


@st.composite
def _layouts(draw: st.DrawFn) -> list[tuple[str, str | None, bool]]:
    """Dictionaries on distinct sites: ``(reads, writes or None for an SAE, error term)``."""
    free = list(SITES)
    out: list[tuple[str, str | None, bool]] = []
    for _ in range(draw(st.integers(1, 4))):
        if len(free) < 2:
            break
        read = draw(st.sampled_from(free[:-1]))
        later = free[free.index(read) + 1 :]
        write = draw(st.sampled_from(later)) if draw(st.booleans()) else None
        free = [s for s in free if s not in (read, write)]
        out.append((read, write, draw(st.booleans())))
    return out


def _reference(
    bridge: TransformerBridge,
    ids: torch.Tensor,
    layout: list[tuple[str, str | None, bool]],
    dictionaries: list[SparseDictionary],
) -> torch.Tensor:
    """The whole forward with plain hooks computing each dictionary's output."""
    seen: dict[str, torch.Tensor] = {}
    hooks: list[tuple[str, Any]] = []
    for (read, write, error), d in zip(layout, dictionaries, strict=True):
        if write is None:

            def sae(
                x: torch.Tensor, *, hook: Any, d: SparseDictionary = d, error: bool = error
            ) -> torch.Tensor:
                return x if error else d.reconstruct(x)

            hooks.append((read, sae))
        else:

            def keep(x: torch.Tensor, *, hook: Any, read: str = read) -> None:
                seen[read] = x

            def put(y: torch.Tensor, *, hook: Any, d: SparseDictionary = d, read: str = read,
                    error: bool = error) -> torch.Tensor:  # fmt: skip
                return y if error else d.reconstruct(seen[read])

            hooks += [(read, keep), (write, put)]
    with bridge.hooks(hooks):
        return bridge(ids)


@settings(max_examples=20, deadline=None)
@given(layout=_layouts(), seed=st.integers(0, 1000), split=st.integers(1, N_LAYERS))
def test_a_split_forward_equals_the_whole_and_nothing_leaks(
    llama: TransformerBridge, layout: list[tuple[str, str | None, bool]], seed: int, split: int
) -> None:
    width = llama.cfg.d_model
    ids, other = _ids(llama, seed), _ids(llama, seed + 1, batch=3, length=4)
    dictionaries = [
        random_dictionary(width, 2 * width, seed=seed + i)
        if write is None
        else _transcoder(width, seed + i)
        for i, (_, write, _) in enumerate(layout)
    ]
    want = _reference(llama, ids, layout, dictionaries)
    splices = [
        llama.add_sae(d, hook_name=read, output_hook_name=write, use_error_term=error)
        for (read, write, error), d in zip(layout, dictionaries, strict=True)
    ]
    try:
        torch.testing.assert_close(llama(ids), want, rtol=1e-5, atol=1e-5)
        residual = llama(ids, stop_at_layer=split)
        llama(other, stop_at_layer=split)  # another forward in between, also stopped midway
        straddling = [
            (read, write)
            for read, write, _ in layout
            if write is not None and _block(read) < split <= _block(write)
        ]
        if straddling:
            with pytest.raises(
                UserError,
                match=rf"start_at_layer={split} begins the forward .* the transcoder writing",
            ):
                llama(ids, start_at_layer=split, residual=residual)
        else:
            got = llama(ids, start_at_layer=split, residual=residual)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(llama(ids), want, rtol=1e-5, atol=1e-5)
    finally:
        for s in splices:
            s.remove()
    assert forward_order(SITES) == list(SITES)  # the layouts read before they write


def _block(site: str) -> int:
    return -1 if not site.startswith("blocks.") else int(site.split(".")[1])
