"""Ragged batches, left padding, generation with specs, partial forwards."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from tl_core import TransformerBridge

PROMPTS = [[1, 45, 210, 33, 97, 400, 12], [1, 300, 8], [1, 77, 150, 260, 5]]


def test_ragged_batch_equals_single_prompts(bridge: TransformerBridge) -> None:
    names = ["blocks.1.hook_out", "blocks.0.attn.hook_pattern", "blocks.1.mlp.hook_out"]
    with torch.no_grad():
        logits, cache = bridge.run_with_cache(PROMPTS, names_filter=names)
        for row, prompt in enumerate(PROMPTS):
            n = len(prompt)
            single_logits, single = bridge.run_with_cache([prompt], names_filter=names)
            torch.testing.assert_close(logits[row, :n], single_logits[0], atol=1e-5, rtol=1e-5)
            for name in names:
                got = cache[name][row]
                got = got[:, :n, :n] if name.endswith("pattern") else got[:n]
                torch.testing.assert_close(got, single[name][0], atol=1e-5, rtol=1e-5)
    assert tuple(cache.lengths) == tuple(len(p) for p in PROMPTS)


def test_batched_generation_matches_transformers_generate(
    bridge: TransformerBridge, reference: PreTrainedModel
) -> None:
    steps = 4
    new = bridge.generate(PROMPTS, max_new_tokens=steps, stop_at_eos=False, return_type="tokens")
    width = max(len(p) for p in PROMPTS)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    with torch.no_grad():
        out = reference.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=pad,
        )
    assert new.tolist() == out[:, width:].tolist()


def test_generation_with_a_spec_equals_greedy_by_hand(bridge: TransformerBridge) -> None:
    spec = {
        "blocks.0.hook_resid_post": {
            "op": "add",
            "value": torch.linspace(-2, 2, bridge.cfg.d_model).tolist(),
        }
    }
    steps = 4
    new = bridge.generate(
        [PROMPTS[0]], max_new_tokens=steps, intervene=spec, stop_at_eos=False, return_type="tokens"
    )
    boost = torch.zeros(bridge.cfg.d_vocab)
    boost[77] = 1e3
    forced = bridge.generate(
        PROMPTS[:2],
        max_new_tokens=steps,
        intervene={"hook_unembed": {"op": "add", "value": boost.tolist()}},
        stop_at_eos=False,
        return_type="tokens",
    )
    sequence = list(PROMPTS[0])
    with torch.no_grad():
        for _ in range(steps):
            logits = bridge([sequence], intervene=spec)
            sequence.append(int(logits[0, -1].argmax()))
    assert new[0].tolist() == sequence[len(PROMPTS[0]) :]
    assert forced.tolist() == [[77] * steps] * 2  # the spec is active at every step


def test_stop_and_start_at_layer_round_trip(bridge: TransformerBridge, ids: torch.Tensor) -> None:
    with torch.no_grad():
        full = bridge(ids)
        for layer in range(bridge.cfg.n_layers + 1):
            resid = bridge(ids, stop_at_layer=layer)
            _, cache = bridge.run_with_cache(
                ids,
                names_filter=[
                    "ln_final.hook_in",
                    *([f"blocks.{layer}.hook_in"] if layer < bridge.cfg.n_layers else []),
                ],
            )
            expected = (
                cache[f"blocks.{layer}.hook_in"]
                if layer < bridge.cfg.n_layers
                else cache["ln_final.hook_in"]
            )
            torch.testing.assert_close(resid, expected, atol=1e-5, rtol=1e-5)
            rest = bridge(None, start_at_layer=layer, residual=resid, tokens=ids)
            torch.testing.assert_close(rest, full, atol=1e-5, rtol=1e-5)


def test_start_at_layer_fires_only_later_hooks(
    bridge: TransformerBridge, ids: torch.Tensor
) -> None:
    seen: list[str] = []
    with torch.no_grad():
        resid = bridge(ids, stop_at_layer=1)
        bridge.run_with_hooks(
            None,
            fwd_hooks=[(lambda n: n.endswith("hook_in"), lambda x, hook: seen.append(hook.name))],
            start_at_layer=1,
            residual=resid,
            tokens=ids,
        )
    assert seen and all(n.startswith(("blocks.1.", "ln_final.")) for n in seen), seen


def test_start_at_layer_fires_no_hook_of_an_earlier_block(
    bridge: TransformerBridge, ids: torch.Tensor
) -> None:
    # The forward that finds block 1's arguments (masks, rotary tables) runs block 0 on the
    # given residual: a hook left on block 0 must not see that stand-in input.
    earlier = [name for name in bridge.hook_dict if name.startswith("blocks.0.")]
    assert any(".attn.hook_" in name for name in earlier)
    seen: list[str] = []
    with torch.no_grad():
        resid = bridge(ids, stop_at_layer=1)
        full = bridge(ids)
        try:
            for name in earlier:
                bridge.add_hook(name, lambda x, hook: seen.append(hook.name))
            rest = bridge(None, start_at_layer=1, residual=resid, tokens=ids)
        finally:
            bridge.reset_hooks()
    assert seen == []
    torch.testing.assert_close(rest, full, atol=1e-5, rtol=1e-5)
