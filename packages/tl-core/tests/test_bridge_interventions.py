"""Spec interventions on local bridges: exact positions, equality with Python hooks."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tl_core import HookPoint, InterventionSpec, SpecError, TransformerBridge

PROMPT = "Steering vectors move models"
HOOK = "blocks.1.hook_out"


def _python_edit(
    spec: InterventionSpec, width: int
) -> Callable[[torch.Tensor, HookPoint], torch.Tensor]:
    """The same edit a spec describes, written by hand as a hook."""

    def edit(x: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        x = x.clone()
        positions = list(spec.pos) if spec.pos is not None else list(range(x.shape[1]))
        for j, p in enumerate(positions):
            value = spec.value
            if isinstance(value, tuple) and value and isinstance(value[0], tuple):
                value = value[j]
            v = torch.tensor(value, dtype=x.dtype) if value is not None else None
            if spec.op == "suppress":
                x[:, p] = 0
            elif spec.op == "scale":
                x[:, p] = x[:, p] * spec.factor
            elif spec.op == "add":
                x[:, p] = x[:, p] + v
            else:
                x[:, p] = v
        return x

    return edit


def _specs(width: int) -> list[InterventionSpec]:
    vec = tuple(float(i % 5) - 2.0 for i in range(width))
    return [
        InterventionSpec.suppress(),
        InterventionSpec.suppress(pos=2),
        InterventionSpec.scale(-1.5),
        InterventionSpec.scale(3.0, pos=[1, 3]),
        InterventionSpec.add(0.7),
        InterventionSpec.add(vec, pos=4),
        InterventionSpec.add((vec, tuple(-v for v in vec)), pos=[0, 2]),
        InterventionSpec.set(vec),
        InterventionSpec.set(1.25, pos=-1),
    ]


@pytest.mark.parametrize("index", range(9))
def test_spec_matches_python_hook_and_touches_only_its_positions(
    bridge: TransformerBridge, index: int
) -> None:
    spec = _specs(bridge.cfg.d_model)[index]
    names = [HOOK, "blocks.2.hook_out"]
    clean_logits, clean = bridge.run_with_cache(PROMPT, names_filter=names)
    spec_logits, edited = bridge.run_with_cache(PROMPT, names_filter=names, intervene={HOOK: spec})
    with bridge.hooks([(HOOK, _python_edit(spec, bridge.cfg.d_model))]):
        hook_logits, by_hook = bridge.run_with_cache(PROMPT, names_filter=names)
    torch.testing.assert_close(spec_logits, hook_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(edited[HOOK], by_hook[HOOK], atol=1e-6, rtol=1e-6)
    n = clean[HOOK].shape[1]
    touched = set(range(n)) if spec.pos is None else {p % n for p in spec.pos}
    changed = {p for p in range(n) if not torch.equal(clean[HOOK][0, p], edited[HOOK][0, p])}
    assert changed == touched
    # Causality: positions before the first edit are unchanged downstream too.
    first = min(touched)
    torch.testing.assert_close(spec_logits[0, :first], clean_logits[0, :first])


def test_composed_specs_apply_in_order(bridge: TransformerBridge) -> None:
    specs = [
        InterventionSpec.scale(2.0, pos=1),
        InterventionSpec.add(1.0, pos=1),
        InterventionSpec.scale(-1.0),
    ]
    _, clean = bridge.run_with_cache(PROMPT, names_filter=HOOK)
    _, edited = bridge.run_with_cache(PROMPT, names_filter=HOOK, intervene={HOOK: specs})
    x = clean[HOOK][0]
    expected = -x
    expected[1] = -(x[1] * 2.0 + 1.0)
    torch.testing.assert_close(edited[HOOK][0], expected)


def test_dict_specs_and_aliases_and_other_hook_layouts(bridge: TransformerBridge) -> None:
    spec = {
        "blocks.0.attn.hook_z": {"op": "scale", "factor": 0.0, "pos": 1},
        "hook_embed": [{"op": "add", "value": 0.1}],
    }
    _, cache = bridge.run_with_cache(
        PROMPT, names_filter=["blocks.0.attn.hook_z", "embed.hook_out"], intervene=spec
    )
    assert torch.equal(
        cache["blocks.0.attn.hook_z"][0, 1], torch.zeros_like(cache["blocks.0.attn.hook_z"][0, 1])
    )
    pattern_spec = {"blocks.0.attn.hook_pattern": {"op": "set", "value": 0.0, "pos": 3}}
    _, pc = bridge.run_with_cache(
        PROMPT, names_filter="blocks.0.attn.hook_pattern", intervene=pattern_spec
    )
    assert pc["blocks.0.attn.hook_pattern"][0, :, 3].abs().sum() == 0
    assert pc["blocks.0.attn.hook_pattern"][0, :, 2].sum() > 0


def test_per_prompt_specs_in_a_ragged_batch(bridge: TransformerBridge) -> None:
    prompts = ["first prompt here", "second", "a third, longer prompt"]
    per_prompt = [{HOOK: {"op": "suppress", "pos": 1}}, None, {HOOK: {"op": "add", "value": 2.0}}]
    _, batched = bridge.run_with_cache(
        prompts, names_filter="blocks.2.hook_out", intervene=per_prompt
    )
    for i, prompt in enumerate(prompts):
        _, single = bridge.run_with_cache(
            prompt, names_filter="blocks.2.hook_out", intervene=per_prompt[i]
        )
        torch.testing.assert_close(
            batched.prompt(i)["blocks.2.hook_out"],
            single["blocks.2.hook_out"],
            atol=1e-5,
            rtol=1e-5,
        )


def test_callables_in_intervene_run_on_local_drivers(bridge: TransformerBridge) -> None:
    _, cache = bridge.run_with_cache(
        PROMPT, names_filter=HOOK, intervene={HOOK: lambda x, hook: x * 0}
    )
    assert cache[HOOK].abs().sum() == 0


def test_bad_specs_fail_before_running(bridge: TransformerBridge) -> None:
    calls: list[int] = []
    with bridge.hooks([("embed.hook_out", lambda x, hook: calls.append(1))]):
        with pytest.raises(SpecError, match=r"factr.*factor"):
            bridge(PROMPT, intervene={HOOK: {"op": "scale", "factr": 2}})
        with pytest.raises(SpecError, match="suppres"):
            bridge(PROMPT, intervene={HOOK: {"op": "suppres"}})
        with pytest.raises(SpecError, match=str(bridge.cfg.d_model)):
            bridge(PROMPT, intervene={HOOK: {"op": "add", "value": [1.0, 2.0]}})
        with pytest.raises(SpecError, match="99"):
            bridge(PROMPT, intervene={HOOK: {"op": "suppress", "pos": 99}})
    assert calls == []
