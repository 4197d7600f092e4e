"""Malformed inputs, hooks and over-long prompts: tl ``UserError``s that say what, where and
how to fix it, raised before the engine runs (issue #21).

Native models of both position schemes, and a ``RemoteBridge`` over the fake remote driver
(loaded from the test fixtures by path, so these tests need no installed fixture).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tl_core import RemoteBridge, TransformerBridge, UserError
from tl_core.bridges._prompts import check_context
from tl_core.driver_api import fits_context, pad_batch

Bridge = TransformerBridge | RemoteBridge

N_CTX = 16
_NATIVE_LLAMA = TransformerBridge.boot_native("llama", n_layers=1, n_ctx=N_CTX, seed=2)
_FAKE = (
    Path(__file__).parent / "fixtures" / "tl-fake-driver" / "src" / "tl_fake_driver" / "_driver.py"
)


def _remote(config: str) -> RemoteBridge:
    spec = importlib.util.spec_from_file_location("_tl_fake_remote_driver", _FAKE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return RemoteBridge(module.FakeRemoteDriver.boot(config, n_layers=2, n_ctx=N_CTX, seed=2))


@pytest.fixture(scope="module", params=["native-llama", "native-gpt2", "remote-llama"])
def bridge(request: pytest.FixtureRequest) -> Bridge:
    """Small models with ``n_ctx=16``: rotary and learned positions, local and remote."""
    kind, config = str(request.param).split("-")
    if kind == "remote":
        return _remote(config)
    return TransformerBridge.boot_native(config, n_layers=2, n_ctx=N_CTX, seed=2)


@pytest.fixture
def engine_calls(bridge: Bridge, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """A list that grows each time the bridge hands work to its driver."""
    calls: list[int] = []
    forward = bridge.driver.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return forward(*args, **kwargs)

    monkeypatch.setattr(bridge.driver, "forward", counted)
    yield calls


def _methods(bridge: Bridge) -> dict[str, Callable[[Any], Any]]:
    return {
        "forward": lambda x: bridge(x),
        "run_with_cache": lambda x: bridge.run_with_cache(x, names_filter="blocks.0.hook_out"),
        "generate": lambda x: bridge.generate(x, max_new_tokens=2),
        "loss": lambda x: bridge.loss(x),
    }


# -- malformed inputs ---------------------------------------------------------------

BAD_INPUTS = [
    pytest.param(
        None, r"the input is None; expected a text, a list of texts, or token ids", id="none"
    ),
    pytest.param(
        ["ok", None], r"prompt 1 is None, but the input is a list of texts", id="none-in-texts"
    ),
    pytest.param(7, r"the input is int 7.*a single token id goes in a list: \[7\]", id="int"),
    pytest.param(3.5, r"the input is float 3\.5; expected a text", id="float"),
    pytest.param([], r"the input is an empty list", id="empty-list"),
    pytest.param(
        ["ok", "a\ud800b"],
        r"prompt 1 holds '\\ud800' at character 1, a lone surrogate",
        id="surrogate",
    ),
    pytest.param("\udfff", r"prompt 0 holds '\\udfff' at character 0", id="surrogate-str"),
    pytest.param([1, 2.0, 3], r"prompt 0, position 1: float 2\.0 is not a token id", id="float-id"),
    pytest.param(
        [[1, 2], [3, True]], r"prompt 1, position 1: bool True is not a token id", id="bool-id"
    ),
    pytest.param(
        [[1, 2], [3, None]], r"prompt 1, position 1: None is not a token id", id="none-id"
    ),
    pytest.param(
        [[1, 2], 3],
        r"prompt 1 is int 3, not a list of token ids.*\[\[1, 2, 3\], \[4, 5\]\]",
        id="ragged-row",
    ),
    pytest.param(
        [[1, 2], "ab"],
        r"prompt 0 is list \[1, 2\], but the input is a list of texts",
        id="texts-and-ids",
    ),
    pytest.param([[1, 2], []], r"prompt 1 is an empty list of token ids", id="empty-row"),
    pytest.param(
        [[1, 2], [3, 259]],
        r"prompt 1, position 1: token id 259 is outside this model's vocabulary, ids 0 to 258",
        id="oov",
    ),
    pytest.param(
        [[1, 2, -1]], r"prompt 0, position 2: token id -1 .*never negative", id="negative"
    ),
    pytest.param(
        torch.tensor([[1, 2], [5, 300]]), r"prompt 1, position 1: token id 300", id="oov-tensor"
    ),
    pytest.param(
        torch.tensor([[1.0, 2.0]]), r"integer tensor, found dtype torch\.float32", id="float-tensor"
    ),
    pytest.param(
        torch.zeros(1, 2, 2, dtype=torch.long),
        r"\[pos\] or \[batch, pos\] tensor, found shape \(1, 2, 2\)",
        id="rank-3",
    ),
]


@pytest.mark.parametrize("method", ["forward", "run_with_cache", "generate", "loss"])
@pytest.mark.parametrize(("value", "message"), BAD_INPUTS)
def test_bad_inputs_are_refused_before_the_engine_runs(
    bridge: Bridge, engine_calls: list[int], method: str, value: Any, message: str
) -> None:
    with pytest.raises(UserError, match=message):
        _methods(bridge)[method](value)
    assert not engine_calls


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, "the input is None"),
        (7, r"\[7\]"),
        ([], "empty list"),
        (["a", None], "prompt 1 is None"),
        ("x\ud800", "prompt 0 holds"),
    ],
)
def test_to_tokens_refuses_what_it_cannot_tokenize(
    bridge: Bridge, value: Any, message: str
) -> None:
    with pytest.raises(UserError, match=message):
        bridge.to_tokens(value)


def test_empty_text_without_bos_names_the_prompt(bridge: Bridge, engine_calls: list[int]) -> None:
    with pytest.raises(
        UserError, match=r"prompt 1 is an empty text and prepend_bos=False.*prepend_bos=True"
    ):
        bridge(["ab", ""], prepend_bos=False)
    assert not engine_calls


def test_every_spelling_of_good_input_still_runs(bridge: Bridge) -> None:
    ids = [[256, 104, 105], [256, 33]]
    expected = bridge(ids)
    for spelling in (
        [tuple(r) for r in ids],
        [torch.tensor(r) for r in ids],
        [ids[0], torch.tensor(ids[1])],
    ):
        torch.testing.assert_close(bridge(spelling), expected)
    torch.testing.assert_close(bridge(torch.tensor(ids[0]))[0], expected[0])
    torch.testing.assert_close(bridge([256, 104, 105])[0], expected[0])
    torch.testing.assert_close(bridge(["hi", "!"]), expected)


# -- hook functions -----------------------------------------------------------------


def test_a_hook_without_the_hook_parameter_is_refused_when_added(
    bridge: Bridge, engine_calls: list[int]
) -> None:
    expected = r"hook '<lambda>' on 'blocks\.0\.hook_out' has the signature \(x\).*def fn\(activation, hook\)"
    with pytest.raises(UserError, match=expected):
        bridge.run_with_hooks("hi", fwd_hooks=[("blocks.0.hook_resid_post", lambda x: x)])
    with pytest.raises(UserError, match=expected):
        bridge.add_hook("blocks.0.hook_out", lambda x: x)
    with pytest.raises(
        UserError, match=r"'blocks\.0\.hook_out' has the signature \(x, scale, hook\)"
    ):
        bridge.add_hook("blocks.0.hook_out", lambda x, scale, hook: x)
    with pytest.raises(UserError, match=r"the hook for 'blocks\.0\.hook_out' is str"):
        bridge.add_hook("blocks.0.hook_out", "not a function")  # type: ignore[arg-type]
    assert not engine_calls
    assert not any(p.has_hooks for p in bridge.hook_dict.values())


def test_a_backward_hook_signature_is_checked_too() -> None:
    bridge = TransformerBridge.boot_native("llama", n_layers=2, n_ctx=N_CTX)
    with pytest.raises(
        UserError, match=r"'blocks\.1\.hook_out'.*backward hook.*def fn\(grad, hook\)"
    ):
        bridge.run_with_hooks("hi", bwd_hooks=[("blocks.1.hook_out", lambda g: None)])
    assert not any(p.has_hooks for p in bridge.hook_dict.values())


def test_a_callable_in_intervene_is_checked_before_the_forward() -> None:
    bridge = TransformerBridge.boot_native("llama", n_layers=2, n_ctx=N_CTX)
    fired: list[int] = []
    with bridge.hooks([("embed.hook_out", lambda x, hook: fired.append(1))]):
        with pytest.raises(UserError, match=r"'blocks\.0\.hook_out' has the signature \(x\)"):
            bridge("hi", intervene={"blocks.0.hook_out": lambda x: x})
    assert not fired


def test_accepted_hook_signatures_all_receive_the_hook_point(bridge: Bridge) -> None:
    seen: list[str] = []

    def keyword_only(x: torch.Tensor, *, hook: Any) -> None:
        seen.append(hook.name)

    def positional(activation: torch.Tensor, point: Any) -> None:
        seen.append(point.name)

    class Recorder:
        def __call__(self, x: torch.Tensor, **kwargs: Any) -> None:
            seen.append(kwargs["hook"].name)

    hooks = [
        lambda x, hook: seen.append(hook.name),
        keyword_only,
        positional,
        Recorder(),
        lambda *a: seen.append(a[1].name),
    ]
    bridge.run_with_hooks("hi", fwd_hooks=[("blocks.1.hook_out", fn) for fn in hooks])
    assert seen == ["blocks.1.hook_out"] * len(hooks)
    assert not any(p.has_hooks for p in bridge.hook_dict.values())


def test_a_positional_hook_can_be_removed_by_its_handle(bridge: Bridge) -> None:
    (handle,) = bridge.add_hook("blocks.0.hook_out", lambda x, point: None)
    assert bridge.get_hook_point("blocks.0.hook_out").has_hooks
    handle.remove()
    assert not bridge.get_hook_point("blocks.0.hook_out").has_hooks


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (
            lambda x, hook: x[:, :1],
            r"returned a tensor of shape \(1, 1, 64\), but the value there has shape \(1, 3, 64\)",
        ),
        (
            lambda x, hook: x.sum(-1),
            r"returned a tensor of shape \(1, 3\), but the value there has shape \(1, 3, 64\)",
        ),
        (
            lambda x, hook: 2.0,
            r"returned float 2\.0; a forward hook returns a tensor of shape \(1, 3, 64\)",
        ),
        (lambda x, hook: x.tolist(), r"returned list .*or None to keep the value"),
    ],
)
def test_a_hook_returning_a_bad_value_is_named_at_its_site(fn: Any, message: str) -> None:
    bridge = TransformerBridge.boot_native("llama", n_layers=2, n_ctx=N_CTX)
    with pytest.raises(UserError, match=r"hook '<lambda>' on 'blocks\.0\.hook_out' " + message):
        bridge.run_with_hooks("hi", fwd_hooks=[("blocks.0.hook_out", fn)])
    assert not any(p.has_hooks for p in bridge.hook_dict.values())
    # A same-shape edit and None are fine.
    bridge.run_with_hooks(
        "hi",
        fwd_hooks=[
            ("blocks.0.hook_out", lambda x, hook: x * 2),
            ("blocks.1.hook_out", lambda x, hook: None),
        ],
    )


# -- context length -----------------------------------------------------------------


@pytest.mark.parametrize("method", ["forward", "run_with_cache", "loss"])
def test_a_prompt_longer_than_n_ctx_is_refused_on_every_position_scheme(
    bridge: Bridge, engine_calls: list[int], method: str
) -> None:
    prompts = [[5] * 4, [6] * (N_CTX + 3)]
    with pytest.raises(
        UserError, match=rf"prompt 1 is {N_CTX + 3} tokens long, which exceeds n_ctx={N_CTX}"
    ):
        _methods(bridge)[method](prompts)
    text = "x" * (N_CTX + 1)  # + BOS
    with pytest.raises(UserError, match=rf"prompt 0 is {N_CTX + 2} tokens long.*n_ctx=N"):
        _methods(bridge)[method](text)
    assert not engine_calls
    # Exactly n_ctx tokens still run, and to_tokens cuts text to fit.
    _methods(bridge)[method]([[5] * N_CTX])
    assert bridge.to_tokens(text).shape == (1, N_CTX)


def test_the_context_hint_matches_the_driver() -> None:
    gpt2 = TransformerBridge.boot_native("gpt2", n_layers=1, n_ctx=N_CTX)
    with pytest.raises(UserError, match=r"boot_native\(config, n_ctx=N\)"):
        gpt2([[1] * (N_CTX + 1)])


def test_generate_checks_prompt_plus_new_tokens_before_decoding(
    bridge: Bridge, engine_calls: list[int]
) -> None:
    prompts = [[5] * 3, [6] * 10]
    with pytest.raises(
        UserError,
        match=rf"generate: prompt 1 is 10 tokens and max_new_tokens=9, which runs the model on "
        rf"18 positions .*more than n_ctx={N_CTX}.*largest max_new_tokens that fits is 7",
    ):
        bridge.generate(prompts, max_new_tokens=9)
    with pytest.raises(
        UserError, match=rf"prompt 0 is {N_CTX + 1} tokens long.*no room for new tokens"
    ):
        bridge.generate([[5] * (N_CTX + 1)], max_new_tokens=1)
    assert not engine_calls
    # The last new token is never fed back: 10 + 7 new tokens run 16 positions, and a prompt
    # of n_ctx tokens still gets one.
    new = bridge.generate(prompts, max_new_tokens=7, stop_at_eos=False, return_type="tokens")
    assert isinstance(new, torch.Tensor) and new.shape == (2, 7)
    one = bridge.generate([[5] * N_CTX], max_new_tokens=1, stop_at_eos=False, return_type="tokens")
    assert isinstance(one, torch.Tensor) and one.shape == (1, 1)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, N_CTX + 3), min_size=1, max_size=3),
    max_new_tokens=st.integers(0, N_CTX + 3),
)
def test_the_bridge_and_the_driver_apply_one_context_rule(
    lengths: list[int], max_new_tokens: int
) -> None:
    # fits_context is the only rule: the bridge's check and the local driver's refuse exactly
    # the runs it says do not fit (issue #44: they used two formulas, one token apart).
    driver = _NATIVE_LLAMA.driver
    batch = pad_batch([[5] * n for n in lengths], pad_id=0)
    fits = all(fits_context(n, max_new_tokens, N_CTX) for n in lengths)
    outcomes = []
    for check in (
        lambda: check_context(driver.info, driver.name, batch, max_new_tokens),
        lambda: driver._check_context(batch, max_new_tokens),
    ):
        try:
            check()
            outcomes.append(True)
        except UserError:
            outcomes.append(False)
    assert outcomes == [fits, fits]


def test_local_drivers_refuse_work_past_n_ctx_themselves() -> None:
    # Direct driver callers (the inspect provider, the fake remote driver) get the same
    # refusal before the model runs, rotary or not.
    for config in ("llama", "gpt2"):
        driver = TransformerBridge.boot_native(config, n_layers=1, n_ctx=N_CTX).driver
        with pytest.raises(
            UserError, match=rf"prompt 1 is {N_CTX + 1} tokens long, which exceeds n_ctx={N_CTX}"
        ):
            driver.forward([[5, 6], [5] * (N_CTX + 1)], max_new_tokens=0)
        with pytest.raises(
            UserError,
            match=r"generating 8 tokens runs the model on 17 positions.*max_new_tokens to 7",
        ):
            driver.forward([[5] * 10], max_new_tokens=8)
        assert driver.forward([[5] * 10], max_new_tokens=7).new_tokens.shape == (1, 7)
        assert driver.forward([[5] * N_CTX], max_new_tokens=1).new_tokens.shape == (1, 1)


def test_decode_takes_one_id_a_sequence_or_a_tensor_row(bridge: Bridge) -> None:
    ids = bridge.to_tokens("Hi!", prepend_bos=False)[0]
    tokenizer = bridge.tokenizer
    assert tokenizer.decode(ids) == tokenizer.decode(ids.tolist()) == "Hi!"
    assert tokenizer.decode(ids[0]) == tokenizer.decode(int(ids[0])) == "H"  # a 0-d tensor, an int
    with pytest.raises(TypeError, match="decode each row"):
        tokenizer.decode(ids[None])
