"""Malformed inputs, hooks and over-long prompts on real transformers models: tl
``UserError``s raised before any forward pass (issue #21)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tl_core import TransformerBridge, UserError


@pytest.fixture
def llama(bridge_of: Callable[[str], TransformerBridge]) -> Iterator[TransformerBridge]:
    """The tiny Llama (rotary, n_ctx=256), with a check that no forward pass started."""
    bridge = bridge_of("llama")
    fired: list[int] = []
    with bridge.hooks([("embed.hook_out", lambda x, hook: fired.append(1))]):
        yield bridge
    assert not fired, "a forward pass started before the input was refused"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (["ok", None], r"prompt 1 is None, but the input is a list of texts"),
        (None, r"the input is None"),
        (7, r"the input is int 7.*\[7\]"),
        ([], r"the input is an empty list"),
        (["ok", "bad \ud800 text"], r"prompt 1 holds '\\ud800' at character 4, a lone surrogate"),
        ([[1, 5, 6.0]], r"prompt 0, position 2: float 6\.0 is not a token id"),
        ([[1, 5], [1, False]], r"prompt 1, position 1: bool False is not a token id"),
        ([[1, 5], 6], r"prompt 1 is int 6, not a list of token ids"),
        (
            [[1, 5], [1, 512]],
            r"prompt 1, position 1: token id 512 is outside this model's vocabulary, ids 0 to 511",
        ),
        (torch.tensor([[1, -3, 5]]), r"prompt 0, position 1: token id -3 .*never negative"),
    ],
)
@pytest.mark.parametrize("method", ["forward", "run_with_cache", "generate"])
def test_bad_inputs_are_tl_errors_naming_the_prompt(
    llama: TransformerBridge, method: str, value: Any, message: str
) -> None:
    call = {
        "forward": lambda: llama(value),
        "run_with_cache": lambda: llama.run_with_cache(value, names_filter="blocks.0.hook_out"),
        "generate": lambda: llama.generate(value, max_new_tokens=2),
    }[method]
    with pytest.raises(UserError, match=message):
        call()


def test_to_tokens_refuses_a_lone_surrogate_and_a_none(llama: TransformerBridge) -> None:
    with pytest.raises(UserError, match=r"prompt 0 holds '\\ud800'"):
        llama.to_tokens("\ud800")
    with pytest.raises(UserError, match=r"prompt 2 is None"):
        llama.to_tokens(["a", "b", None])  # type: ignore[list-item]


def test_hook_signature_and_returned_shape(bridge_of: Callable[[str], TransformerBridge]) -> None:
    llama = bridge_of("llama")
    with pytest.raises(
        UserError,
        match=r"'blocks\.1\.attn\.hook_z' has the signature \(x\).*def fn\(activation, hook\)",
    ):
        llama.run_with_hooks([[1, 5, 6]], fwd_hooks=[("blocks.1.attn.hook_z", lambda x: x)])
    d_head = llama.cfg.d_head
    with pytest.raises(
        UserError,
        match=rf"'blocks\.1\.attn\.hook_z' returned a tensor of shape \(1, 3, {d_head}\), but the value "
        rf"there has shape \(1, 3, {llama.cfg.n_heads}, {d_head}\)",
    ):
        with torch.no_grad():
            llama.run_with_hooks(
                [[1, 5, 6]], fwd_hooks=[("blocks.1.attn.hook_z", lambda x, hook: x[:, :, 0])]
            )
    assert not any(p.has_hooks for p in llama.hook_dict.values())


def test_rotary_model_refuses_prompts_past_n_ctx(llama: TransformerBridge) -> None:
    n_ctx = llama.cfg.n_ctx
    assert llama.cfg.positional_embedding_type == "rotary"
    prompts = [[1, 5, 6], [1] + [7] * (n_ctx + 4)]
    with pytest.raises(
        UserError,
        match=rf"prompt 1 is {n_ctx + 5} tokens long, which exceeds n_ctx={n_ctx}.*"
        r"boot_transformers\(model, n_ctx=N\)",
    ):
        llama(prompts)
    with pytest.raises(UserError, match=rf"exceeds n_ctx={n_ctx}"):
        llama.run_with_cache(prompts, names_filter="blocks.0.hook_out")


def test_generate_refuses_up_front_with_the_largest_max_new_tokens(
    llama: TransformerBridge,
) -> None:
    n_ctx = llama.cfg.n_ctx
    prompt = [1] + [7] * (n_ctx - 5)
    with pytest.raises(
        UserError,
        match=rf"generate: prompt 0 is {n_ctx - 4} tokens and max_new_tokens=10, which runs the "
        rf"model on {n_ctx + 5} positions .*more than n_ctx={n_ctx}.*largest max_new_tokens that fits is 5",
    ):
        llama.generate([prompt], max_new_tokens=10)


def test_generate_to_exactly_n_ctx_runs(bridge_of: Callable[[str], TransformerBridge]) -> None:
    llama = bridge_of("llama")
    n_ctx = llama.cfg.n_ctx
    new = llama.generate(
        [[1] + [7] * (n_ctx - 3)], max_new_tokens=2, stop_at_eos=False, return_type="tokens"
    )
    assert isinstance(new, torch.Tensor) and new.shape == (1, 2)


def test_a_larger_n_ctx_lets_a_rotary_model_run_longer(checkpoint: Callable[[str], Path]) -> None:
    with pytest.warns(UserWarning, match="larger than the 256 positions"):
        long = TransformerBridge.boot_transformers(str(checkpoint("llama")), n_ctx=300)
    with torch.no_grad():
        assert long([[1] + [7] * 279]).shape == (1, 280, long.cfg.d_vocab)


def test_learned_positions_say_that_no_option_helps(
    bridge_of: Callable[[str], TransformerBridge],
) -> None:
    gpt2 = bridge_of("gpt2")
    n_ctx = gpt2.cfg.n_ctx
    with pytest.raises(
        UserError, match=rf"prompt 0 is {n_ctx + 1} tokens long.*{n_ctx} learned positions"
    ):
        gpt2([[1] * (n_ctx + 1)])


def test_the_driver_itself_refuses_a_rotary_prompt_past_n_ctx(
    bridge_of: Callable[[str], TransformerBridge],
) -> None:
    driver = bridge_of("llama").driver
    n_ctx = driver.info.n_ctx
    with pytest.raises(
        UserError, match=rf"prompt 0 is {n_ctx + 1} tokens long, which exceeds n_ctx={n_ctx}"
    ):
        driver.forward([[1] * (n_ctx + 1)], max_new_tokens=0)
