"""Hooks named for a partial forward that never runs them are refused, naming them.

``stop_at_layer`` ends a forward before a block and ``start_at_layer`` begins one at a block:
captures, specs, callables and hooks at sites outside that span used to be dropped without
a word (an empty cache, an edit never made). The references are full forwards of the same
model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tl_core import TransformerBridge, UserError
from tl_core.sae import random_dictionary

IDS = [[1, 5, 9, 14, 20, 33], [1, 7, 30, 2, 8, 4]]


@pytest.fixture(scope="module")
def model() -> TransformerBridge:
    return TransformerBridge.boot_native(n_layers=3, seed=1)


@pytest.mark.parametrize(
    ("names_filter", "stop", "match"),
    [
        (
            ["blocks.1.hook_out"],
            1,
            r"stop_at_layer=1 .*names_filter: 'blocks\.1\.hook_out'.*stop at block 2",
        ),
        ("blocks.2.hook_resid_pre", 1, r"names_filter: 'blocks\.2\.hook_in'.*stop at block 3"),
        (
            ["blocks.0.hook_out", "ln_final.hook_scale"],
            3,
            r"'ln_final\.hook_scale'.*leave stop_at_layer out",
        ),
        (lambda n: n.startswith("blocks.2."), -1, r"stop_at_layer=2 .*'blocks\.2\.hook_in'"),
    ],
    ids=["name", "alias", "after-blocks", "predicate"],
)
def test_run_with_cache_refuses_names_past_the_stop(
    model: TransformerBridge, names_filter: Any, stop: int, match: str
) -> None:
    with pytest.raises(UserError, match=match):
        model.run_with_cache(IDS, names_filter=names_filter, stop_at_layer=stop)


@pytest.mark.parametrize("names_filter", [None, lambda n: n.endswith("hook_out")])
def test_broad_filters_keep_what_runs_before_the_stop(
    model: TransformerBridge, names_filter: Any
) -> None:
    _, full = model.run_with_cache(IDS, names_filter=names_filter)
    _, cache = model.run_with_cache(IDS, names_filter=names_filter, stop_at_layer=2)
    assert cache.keys() and set(cache.keys()) < set(full.keys())
    assert all(not k.startswith(("blocks.2.", "ln_final", "unembed")) for k in cache)
    for name in cache:
        torch.testing.assert_close(cache[name], full[name], rtol=0, atol=0)


def test_dictionary_sites_before_the_stop_are_cached() -> None:
    model = TransformerBridge.boot_native(seed=1)
    model.add_sae(random_dictionary(64, 32), hook_name="blocks.0.hook_out")
    model.add_sae(
        random_dictionary(64, 16, seed=1, transcoder=True, apply_b_dec_to_input=False),
        hook_name="blocks.0.ln2.hook_out",
        output_hook_name="blocks.1.mlp.hook_out",
    )
    sae_sites = lambda n: ".hook_sae_" in n  # noqa: E731
    _, full = model.run_with_cache(IDS, names_filter=sae_sites)
    _, cache = model.run_with_cache(IDS, names_filter=sae_sites, stop_at_layer=1)
    # The transcoder writes its output into block 1, which this forward never reaches.
    assert set(cache.keys()) == set(full.keys()) - {"blocks.0.ln2.hook_out.hook_sae_output"}
    for name in cache:
        torch.testing.assert_close(cache[name], full[name], rtol=0, atol=0)
    with pytest.raises(UserError, match=r"'blocks\.0\.ln2\.hook_out\.hook_sae_output'"):
        model.run_with_cache(
            IDS, names_filter=["blocks.0.ln2.hook_out.hook_sae_output"], stop_at_layer=1
        )


def test_edits_and_hooks_outside_a_partial_forward_are_refused(model: TransformerBridge) -> None:
    residual = model(IDS, stop_at_layer=1)
    scale = {"op": "scale", "factor": 2.0}
    with pytest.raises(UserError, match=r"stop_at_layer=1 .*intervene: 'blocks\.1\.attn\.hook_z'"):
        model(IDS, stop_at_layer=1, intervene={"blocks.1.attn.hook_z": scale})
    with pytest.raises(
        UserError, match=r"start_at_layer=1 .*intervene: 'embed\.hook_out'.*from the tokens"
    ):
        model(
            None, start_at_layer=1, residual=residual, tokens=IDS, intervene={"hook_embed": scale}
        )
    with pytest.raises(UserError, match=r"intervene: 'blocks\.0\.hook_out'.*start at block 0"):
        model(
            None,
            start_at_layer=1,
            residual=residual,
            tokens=IDS,
            intervene={"blocks.0.hook_out": lambda x, hook: x * 2},
        )
    with pytest.raises(UserError, match=r"fwd_hooks: 'blocks\.2\.hook_out'"):
        model.run_with_hooks(
            IDS, fwd_hooks=[("blocks.2.hook_out", lambda x, hook: x)], stop_at_layer=-1
        )
    with pytest.raises(UserError, match=r"start_at_layer=2 .*bwd_hooks: 'blocks\.1\.hook_out'"):
        model.run_with_hooks(
            None,
            bwd_hooks=[("blocks.1.hook_out", lambda g, hook: None)],
            start_at_layer=2,
            residual=model(IDS, stop_at_layer=2),
            tokens=IDS,
        )
    assert all(not p.has_hooks for p in model.hook_dict.values())
    with pytest.raises(UserError, match=r"capture: 'blocks\.1\.hook_out'"):
        model.driver.forward(IDS, capture=["blocks.1.hook_out"], stop_at_layer=1)


def test_edits_inside_a_partial_forward_still_apply(model: TransformerBridge) -> None:
    edit = {"blocks.0.hook_out": {"op": "scale", "factor": 2.0}}
    full = model(IDS, intervene=edit)
    residual = model(IDS, stop_at_layer=1, intervene=edit)
    resumed = model(None, start_at_layer=1, residual=residual, tokens=IDS)
    torch.testing.assert_close(resumed, full, rtol=1e-5, atol=1e-5)
    late = {"blocks.2.hook_out": {"op": "scale", "factor": 2.0}}
    from_one = model(
        None, start_at_layer=1, residual=model(IDS, stop_at_layer=1), tokens=IDS, intervene=late
    )
    torch.testing.assert_close(from_one, model(IDS, intervene=late), rtol=1e-5, atol=1e-5)
