"""The order in which Python hooks, ``intervene`` specs and ``intervene`` callables run on one
site (documented in ``docs/interventions.md``), pinned on the native driver.

Each step applies a different affine map, so any other order gives other numbers; the
reference is the same maps composed by hand in the documented order and fed to the model
through one plain hook.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tl_core import TransformerBridge

SITE, ALIAS = "blocks.0.hook_out", "blocks.0.hook_resid_post"
IDS = [[1, 5, 9, 14, 20, 33], [1, 7, 30, 2, 8, 4]]
#: Specs under the canonical name and callables under the alias (one list holds one kind).
SPECS = [{"op": "scale", "factor": 2.0}, {"op": "add", "value": 5.0}]


def _steps(seen: dict[str, torch.Tensor]) -> dict[str, Callable[..., torch.Tensor]]:
    def step(name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
        def hook(x: torch.Tensor, hook: object) -> torch.Tensor:
            seen[name] = x.detach().clone()
            return fn(x)

        return hook

    return {
        "permanent": step("permanent", lambda x: x + 1),
        "temporary": step("temporary", lambda x: x * 3),
        "first_callable": step("first_callable", lambda x: x - 7),
        "second_callable": step("second_callable", lambda x: x * 0.5),
    }


def check_documented_order(model: TransformerBridge) -> None:
    """Bridge hooks (attach order), then specs (list order), then callables (list order)."""
    with torch.no_grad():
        _, plain = model.run_with_cache(IDS, names_filter=SITE)
        x0 = plain[SITE]
        # The documented order, composed by hand.
        want = {"permanent": x0, "temporary": x0 + 1}
        want["first_callable"] = 2 * (3 * (x0 + 1)) + 5
        want["second_callable"] = want["first_callable"] - 7
        final = want["second_callable"] * 0.5
        reference = model.run_with_hooks(IDS, fwd_hooks=[(SITE, lambda x, hook: final)])

        seen: dict[str, torch.Tensor] = {}
        steps = _steps(seen)
        intervene = {SITE: SPECS, ALIAS: [steps["first_callable"], steps["second_callable"]]}
        model.add_hook(SITE, steps["permanent"], is_permanent=True)
        try:
            with model.hooks([(SITE, steps["temporary"])]):
                logits, cache = model.run_with_cache(IDS, names_filter=SITE, intervene=intervene)
            assert set(seen) == set(want)
            for name, value in want.items():
                torch.testing.assert_close(seen[name], value, msg=name)
            torch.testing.assert_close(cache[SITE], final)
            torch.testing.assert_close(logits, reference)

            seen.clear()
            hooked = model.run_with_hooks(
                IDS, fwd_hooks=[(SITE, steps["temporary"])], intervene=intervene
            )
            for name, value in want.items():
                torch.testing.assert_close(seen[name], value, msg=name)
            torch.testing.assert_close(hooked, reference)
        finally:
            model.reset_hooks(including_permanent=True)


def test_hooks_then_specs_then_callables_on_one_site() -> None:
    check_documented_order(TransformerBridge.boot_native(seed=2))
