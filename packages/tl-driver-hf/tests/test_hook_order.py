"""On one site of a transformers model, bridge hooks run before ``intervene`` specs, and
specs before ``intervene`` callables (``docs/interventions.md``); partial forwards refuse
hooks they never run. References: the same maps composed by hand and applied with one
plain hook, and full forwards."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tl_core import TransformerBridge, UserError

SITE, ALIAS = "blocks.0.hook_out", "blocks.0.hook_resid_post"
IDS = [[1, 5, 9, 14, 20, 33], [1, 7, 30, 2, 8, 4]]
SPECS = [{"op": "scale", "factor": 2.0}, {"op": "add", "value": 5.0}]


def _step(
    seen: dict[str, torch.Tensor], name: str, fn: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[..., torch.Tensor]:
    def hook(x: torch.Tensor, hook: object) -> torch.Tensor:
        seen[name] = x.detach().clone()
        return fn(x)

    return hook


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hooks_then_specs_then_callables_on_one_site(
    family: str, bridge_of: Callable[[str], TransformerBridge]
) -> None:
    model = bridge_of(family)
    with torch.no_grad():
        x0 = model.run_with_cache(IDS, names_filter=SITE)[1][SITE].clone()
        want = {"permanent": x0, "temporary": x0 + 1, "first": 2 * (3 * (x0 + 1)) + 5}
        want["second"] = want["first"] - 7
        final = want["second"] * 0.5
        reference = model.run_with_hooks(IDS, fwd_hooks=[(SITE, lambda x, hook: final)])
        seen: dict[str, torch.Tensor] = {}
        callables = [
            _step(seen, "first", lambda x: x - 7),
            _step(seen, "second", lambda x: x * 0.5),
        ]
        model.add_hook(SITE, _step(seen, "permanent", lambda x: x + 1), is_permanent=True)
        try:
            with model.hooks([(SITE, _step(seen, "temporary", lambda x: x * 3))]):
                logits, cache = model.run_with_cache(
                    IDS, names_filter=SITE, intervene={SITE: SPECS, ALIAS: callables}
                )
        finally:
            model.reset_hooks(including_permanent=True)
    assert set(seen) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(seen[name], value, msg=name)
    torch.testing.assert_close(cache[SITE], final)
    torch.testing.assert_close(logits, reference)


def test_partial_forwards_refuse_hooks_they_never_run(
    bridge_of: Callable[[str], TransformerBridge],
) -> None:
    model = bridge_of("llama")
    with pytest.raises(UserError, match=r"stop_at_layer=1 .*names_filter: 'blocks\.1\.hook_out'"):
        model.run_with_cache(IDS, names_filter=["blocks.1.hook_out"], stop_at_layer=1)
    residual = model(IDS, stop_at_layer=1)
    with pytest.raises(UserError, match=r"start_at_layer=1 .*intervene: 'blocks\.0\.attn\.hook_z'"):
        model(
            None,
            start_at_layer=1,
            residual=residual,
            tokens=IDS,
            intervene={"blocks.0.attn.hook_z": {"op": "suppress"}},
        )
    _, full = model.run_with_cache(IDS, names_filter=lambda n: n.endswith("hook_out"))
    _, cache = model.run_with_cache(
        IDS, names_filter=lambda n: n.endswith("hook_out"), stop_at_layer=1
    )
    assert set(cache) == {n for n in full if not n.startswith(("blocks.1.", "ln_final", "unembed"))}
    for name in cache:
        torch.testing.assert_close(cache[name], full[name], rtol=0, atol=0)
