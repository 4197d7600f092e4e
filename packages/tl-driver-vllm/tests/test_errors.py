"""Bad input fails before any engine work, with a message that says what and where."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")

from _tlv_support import ENGINE_OPTIONS

from tl_core import (
    ConfigError,
    HookNameError,
    RemoteBridge,
    SpecError,
    UserError,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def bridge(checkpoint: Any) -> Iterator[RemoteBridge]:
    bridge = RemoteBridge.boot_vllm(checkpoint("llama"), dtype="float32", **ENGINE_OPTIONS)
    yield bridge
    bridge.close()


@pytest.fixture
def engine_calls(bridge: RemoteBridge, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records every call into the engine (generate and worker RPCs)."""
    llm = bridge.driver._llm
    calls: list[str] = []
    for name in ("generate", "collective_rpc"):
        original = getattr(llm, name)

        def spy(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(llm, name, spy)
    return calls


PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]

BAD_INPUTS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("unfireable capture", {"capture": ["blocks.0.attn.hook_cos"]}, HookNameError, "rotary kernel"),
    (
        "opt-in capture",
        {"capture": ["blocks.1.attn.hook_result"]},
        HookNameError,
        "use_attn_result=True",
    ),
    ("unknown hook", {"capture": ["blocks.0.hook_outt"]}, HookNameError, "blocks.0.hook_out"),
    ("layer out of range", {"capture": ["blocks.7.hook_out"]}, HookNameError, "blocks.7"),
    (
        "spec on unfireable hook",
        {"intervene": {"blocks.0.attn.hook_sin": {"op": "suppress"}}},
        HookNameError,
        "rotary kernel",
    ),
    (
        "spec on a rebuilt pattern",
        {"intervene": {"blocks.0.attn.hook_pattern": {"op": "suppress"}}},
        SpecError,
        "'blocks.0.attn.hook_pattern': driver 'vllm' cannot edit it: vLLM's fused attention "
        "kernel never materialises it",
    ),
    (
        "spec on rebuilt scores",
        {"intervene": {"blocks.1.attn.hook_attn_scores": {"op": "scale", "factor": 2.0}}},
        SpecError,
        "edit blocks.1.attn.hook_rot_q/hook_rot_k or hook_v instead",
    ),
    (
        "spec on a derived norm site",
        {"intervene": {"blocks.0.ln1.hook_scale": {"op": "set", "value": 1.0}}},
        SpecError,
        "derived from the norm's input (vLLM's norm kernels return only the norm's output)",
    ),
    (
        "key spec of the query width",
        {"intervene": {"blocks.0.attn.hook_k": {"op": "add", "value": [0.0] * 128}}},
        SpecError,
        "width",
    ),
    (
        "spec on read-only hook",
        {"intervene": {"unembed.hook_out": {"op": "suppress"}}},
        SpecError,
        "cannot edit it: vLLM samples from logits it computes at the last position",
    ),
    (
        "spec on token ids",
        {"intervene": {"hook_tokens": {"op": "add", "value": 1}}},
        SpecError,
        "integer ids",
    ),
    (
        "alias absent on this model",
        {"capture": ["hook_pos_embed"]},
        HookNameError,
        "not learned embeddings",
    ),
    ("unknown op", {"intervene": {"blocks.0.hook_out": {"op": "zero"}}}, SpecError, "'op'"),
    (
        "unknown key",
        {"intervene": {"blocks.0.hook_out": {"op": "scale", "factr": 2}}},
        SpecError,
        "factr",
    ),
    (
        "wrong width",
        {"intervene": {"blocks.0.hook_out": {"op": "add", "value": [1.0, 2.0]}}},
        SpecError,
        "width 2",
    ),
    (
        "pos beyond a prompt",
        {"intervene": {"blocks.0.hook_out": {"op": "suppress", "pos": 3}}},
        SpecError,
        "prompt 1",
    ),
    (
        "python callable",
        {"intervene": {"blocks.0.hook_out": lambda x, hook: x}},
        SpecError,
        "declarative",
    ),
    ("per-prompt list of wrong length", {"intervene": [None]}, SpecError, "batch has 2"),
    ("unknown option", {"beam_width": 4}, UserError, "beam_width"),
    ("bad sampling", {"do_sample": True, "temperature": 0.0}, UserError, "temperature"),
    ("negative max_new_tokens", {"max_new_tokens": -1}, UserError, "max_new_tokens"),
]


@pytest.mark.parametrize(
    ("label", "kwargs", "error", "fragment"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input_fails_before_engine_work(
    bridge: RemoteBridge,
    engine_calls: list[str],
    label: str,
    kwargs: dict[str, Any],
    error: type[Exception],
    fragment: str,
) -> None:
    with pytest.raises(error, match=None) as info:
        bridge.driver.forward(PROMPTS, **kwargs)
    assert fragment in str(info.value), str(info.value)
    assert engine_calls == [], f"{label}: the engine was called before the input was rejected"


def test_bad_token_ids_fail_before_engine_work(
    bridge: RemoteBridge, engine_calls: list[str]
) -> None:
    vocab = bridge.cfg.d_vocab
    with pytest.raises(UserError, match=f"token id {vocab}"):
        bridge.driver.forward([[1, vocab]])
    with pytest.raises(UserError, match="max_model_len"):
        bridge.driver.forward([[5] * 250], max_new_tokens=10)
    with pytest.raises(UserError, match="empty list of token ids"):
        bridge.driver.forward([[]])
    assert engine_calls == []


def test_engine_still_serves_after_errors_and_aborted_runs(
    bridge: RemoteBridge, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver = bridge.driver
    before = driver.forward(PROMPTS, capture=["blocks.1.hook_out"], max_new_tokens=0)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("engine step failed")

    monkeypatch.setattr(driver._llm, "generate", broken)
    with pytest.raises(RuntimeError, match="engine step failed"):
        driver.forward(
            PROMPTS,
            capture=["blocks.1.hook_out"],
            intervene={"blocks.0.hook_out": {"op": "suppress"}},
        )
    monkeypatch.undo()
    handles = driver._llm.collective_rpc(lambda worker: len(worker._tl_handles))
    assert handles == [0], "an aborted run left hooks installed"
    after = driver.forward(PROMPTS, capture=["blocks.1.hook_out"], max_new_tokens=0)
    assert (
        after.captured["blocks.1.hook_out"] - before.captured["blocks.1.hook_out"]
    ).abs().max() == 0


def test_position_interventions_can_be_switched_off(checkpoint: Any) -> None:
    bridge = RemoteBridge.boot_vllm(
        checkpoint("llama"), dtype="float32", enable_position_interventions=False, **ENGINE_OPTIONS
    )
    try:
        assert not bridge.driver.supports("position_interventions")
        with pytest.raises(SpecError, match="enable_position_interventions"):
            bridge.driver.forward(
                PROMPTS, intervene={"blocks.0.hook_out": {"op": "suppress", "pos": 0}}
            )
        bridge.driver.forward(PROMPTS, intervene={"blocks.0.hook_out": {"op": "suppress"}})
    finally:
        bridge.close()


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"enable_prefix_caching": True}, "prefix"),
        ({"enforce_eager": 0}, "enforce_eager must be True, False or None"),
        ({"worker_extension_cls": "x.Y"}, "worker extension"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"enable_batching": False, "max_num_seqs": 4}, "max_num_seqs"),
    ],
)
def test_refused_boot_options_fail_before_the_engine_starts(
    checkpoint: Any, monkeypatch: pytest.MonkeyPatch, options: dict[str, Any], fragment: str
) -> None:
    import vllm

    def no_engine(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an engine was started")

    monkeypatch.setattr(vllm, "LLM", no_engine)
    with pytest.raises(ConfigError, match=fragment):
        RemoteBridge.boot_vllm(checkpoint("llama"), **options)


def test_unsupported_family_fails_before_the_engine_starts(
    checkpoint: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm

    monkeypatch.setattr(vllm, "LLM", lambda *a, **k: pytest.fail("an engine was started"))
    with pytest.raises(
        ConfigError,
        match=r"cannot serve architecture 'GPTNeoForCausalLM': vLLM 0\.32 has no GPT-Neo model",
    ) as info:
        RemoteBridge.boot_vllm(checkpoint("gpt_neo"))
    assert "Use the hf driver" in str(info.value)
