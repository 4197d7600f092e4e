"""generate (greedy, sampling, batches, hooks and specs active), loss and token helpers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tl_core import TransformerBridge, UserError


def _greedy_by_hand(
    bridge: TransformerBridge, prompt: str, n: int, intervene: object = None
) -> list[int]:
    ids = bridge.to_tokens(prompt)[0].tolist()
    out = []
    for _ in range(n):
        logits = bridge(torch.tensor([ids]), intervene=intervene)
        token = int(logits[0, -1].argmax())
        out.append(token)
        ids.append(token)
    return out


def test_greedy_generation_matches_repeated_forwards(bridge: TransformerBridge) -> None:
    tokens = bridge.generate("Once upon", max_new_tokens=6, stop_at_eos=False, return_type="tokens")
    assert tokens[0].tolist() == _greedy_by_hand(bridge, "Once upon", 6)


def test_batched_generation_with_left_padding_matches_single(bridge: TransformerBridge) -> None:
    prompts = ["Hi", "A much longer prompt"]
    batched = bridge.generate(prompts, max_new_tokens=5, stop_at_eos=False, return_type="tokens")
    for i, prompt in enumerate(prompts):
        single = bridge.generate(prompt, max_new_tokens=5, stop_at_eos=False, return_type="tokens")
        assert batched[i].tolist() == single[0].tolist()


def test_specs_and_hooks_are_active_at_every_step(bridge: TransformerBridge) -> None:
    steer = {"blocks.0.hook_out": {"op": "add", "value": 3.0}}
    steered = bridge.generate(
        "Steer", max_new_tokens=5, intervene=steer, stop_at_eos=False, return_type="tokens"
    )
    assert steered[0].tolist() == _greedy_by_hand(bridge, "Steer", 5, steer)
    calls: list[int] = []
    with bridge.hooks([("blocks.0.hook_out", lambda x, hook: calls.append(x.shape[1]))]):
        bridge.generate("Steer", max_new_tokens=3, stop_at_eos=False)
    assert calls == [6, 7, 8]


def test_sampling_is_seeded_and_respects_top_k(bridge: TransformerBridge) -> None:
    a = bridge.generate("Sample", max_new_tokens=8, do_sample=True, seed=3, return_type="tokens")
    b = bridge.generate("Sample", max_new_tokens=8, do_sample=True, seed=3, return_type="tokens")
    assert torch.equal(a, b)
    top1 = bridge.generate(
        "Sample",
        max_new_tokens=4,
        do_sample=True,
        top_k=1,
        seed=5,
        stop_at_eos=False,
        return_type="tokens",
    )
    greedy = bridge.generate("Sample", max_new_tokens=4, stop_at_eos=False, return_type="tokens")
    assert torch.equal(top1, greedy)


def test_text_in_text_out(bridge: TransformerBridge) -> None:
    text = bridge.generate("abc", max_new_tokens=3)
    assert isinstance(text, str)
    texts = bridge.generate(["abc", "de"], max_new_tokens=3)
    assert isinstance(texts, list) and len(texts) == 2


def test_loss_matches_cross_entropy_and_ignores_padding(bridge: TransformerBridge) -> None:
    tokens = bridge.to_tokens("Loss is next-token cross entropy")
    logits = bridge(tokens)
    expected = F.cross_entropy(logits[0, :-1], tokens[0, 1:])
    torch.testing.assert_close(bridge.loss("Loss is next-token cross entropy"), expected)
    per_token = bridge.loss(["ab", "abcdef"], per_token=True)
    assert per_token.shape == (2, 6)
    assert per_token[0, 2:].abs().sum() == 0
    torch.testing.assert_close(
        per_token[1], bridge.loss("abcdef", per_token=True)[0], atol=1e-5, rtol=1e-5
    )


def test_token_helpers_round_trip(bridge: TransformerBridge) -> None:
    tokens = bridge.to_tokens("héllo")
    assert tokens[0, 0].item() == bridge.tokenizer.bos_token_id
    assert bridge.to_string(tokens[0]) == "héllo"
    assert bridge.to_str_tokens("ab") == ["<bos>", "a", "b"]
    assert bridge.to_single_token("a") == ord("a")
    with pytest.raises(UserError, match="not a single token"):
        bridge.to_single_token("ab")
    batch = bridge.to_tokens(["a", "abc"])
    assert batch.shape == (2, 4) and batch[0, 2].item() == bridge.tokenizer.pad_token_id


def test_bad_generation_arguments(bridge: TransformerBridge) -> None:
    with pytest.raises(UserError, match="max_new_tokens"):
        bridge.generate("x", max_new_tokens=0)
    with pytest.raises(UserError, match="temperature"):
        bridge.generate("x", max_new_tokens=2, do_sample=True, temperature=0)
