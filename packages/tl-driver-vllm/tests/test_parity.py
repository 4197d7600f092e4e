"""Parity: every served hook, logits, specs and generation against a reference.

References: the plain transformers model hooked by ``_tlv_reference`` (per prompt, for
captures, specs and greedy generation) and the project's hf driver through the same
``Driver.forward`` call (``test_matches_the_hf_driver``). One engine per family (module
scope), float32, a 32-token step so the 70-token prompt is prefilled in chunks across
steps, next to shorter prompts that finish earlier.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from _tlv_reference import Reference  # noqa: E402
from _tlv_support import ENGINE_OPTIONS, check, diff, prompt_part, reference_served  # noqa: E402

from tl_core import RemoteBridge  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gpt2"]
TOL = 1e-4
LENGTHS = [9, 70, 3, 17, 33, 1, 24]


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, checkpoint: Any) -> Iterator[tuple[Any, Reference, list[list[int]]]]:
    folder = checkpoint(request.param)
    bridge = RemoteBridge.boot_vllm(folder, dtype="float32", **ENGINE_OPTIONS)
    try:
        ref = Reference(folder)
        yield bridge.driver, ref, _prompts(bridge.cfg.d_vocab)
    finally:
        bridge.close()


def _compare_batch(
    driver: Any, ref: Reference, prompts: list[list[int]], intervene: Any, capture: list[str]
) -> dict[str, float]:
    result = driver.forward(prompts, capture=capture, intervene=intervene, max_new_tokens=0)
    assert result.lengths == tuple(len(p) for p in prompts)
    report: dict[str, float] = {}
    for b, ids in enumerate(prompts):
        n = len(ids)
        mapping = intervene[b] if isinstance(intervene, list) else intervene
        want, logits = ref.run(ids, capture, mapping)
        for name in capture:
            report[f"p{b}:{name}"] = diff(result.captured[name][b, :n], want[name])
        report[f"p{b}:logits"] = diff(result.logits[b, :n], logits)
    return report


def test_every_served_hook_single_prompt(family: Any) -> None:
    driver, ref, prompts = family
    served = reference_served(driver)
    assert {"embed.hook_out", "blocks.1.hook_out", "unembed.hook_out"} <= set(served)
    report = _compare_batch(driver, ref, [prompts[0]], None, served)
    check(report, TOL, f"{driver.info.architecture} single prompt")


def test_every_served_hook_ragged_batch_with_chunked_prefill(family: Any) -> None:
    driver, ref, prompts = family
    assert max(LENGTHS) > ENGINE_OPTIONS["max_num_batched_tokens"]
    served = reference_served(driver)
    report = _compare_batch(driver, ref, prompts, None, served)
    check(report, TOL, f"{driver.info.architecture} ragged batch")


def _per_prompt_specs(d: int, arch: str) -> list[dict[str, Any] | None]:
    gen = torch.Generator().manual_seed(7)
    vec = torch.randn(d, generator=gen).tolist()
    rows = torch.randn(2, d, generator=gen).tolist()
    specs: list[dict[str, Any] | None] = [
        {"blocks.0.attn.hook_out": {"op": "suppress", "pos": [1, -1]}},
        {
            "blocks.0.hook_out": {"op": "scale", "factor": 0.5},
            "blocks.1.hook_in": {"op": "add", "value": vec, "pos": 50},  # a later prefill chunk
        },
        {"blocks.0.ln2.hook_in": {"op": "set", "value": rows, "pos": [0, 2]}},
        {
            "blocks.1.mlp.hook_out": [
                {"op": "scale", "factor": 2.0},
                {"op": "add", "value": 0.3},
                {"op": "suppress", "pos": -1},
            ]
        },
        None,
        {
            "embed.hook_out": {"op": "add", "value": vec},
            "ln_final.hook_out": {"op": "set", "value": 0.25, "pos": 0},
        },
        {
            "blocks.1.hook_out": {"op": "suppress"},
            "blocks.0.hook_in": {"op": "scale", "factor": -1.0, "pos": [3, 4]},
            "ln_final.hook_in": {"op": "set", "value": vec},
        },
    ]
    extra = specs[3]
    assert extra is not None
    if arch == "Gemma2ForCausalLM":
        extra["blocks.0.ln1_post.hook_out"] = {"op": "scale", "factor": 3.0, "pos": [0, 5]}
        extra["blocks.1.ln2_post.hook_in"] = {"op": "add", "value": vec}
    elif arch == "GPT2LMHeadModel":
        extra["pos_embed.hook_out"] = {"op": "set", "value": 0.0, "pos": [1, 2]}
    else:
        extra["blocks.1.attn.hook_out"] = {"op": "set", "value": vec, "pos": 10}
    return specs


def test_every_spec_op_per_prompt_in_a_batch(family: Any) -> None:
    driver, ref, prompts = family
    specs = _per_prompt_specs(driver.info.d_model, driver.info.architecture)
    capture = ["blocks.0.hook_out", "blocks.1.attn.hook_out", "blocks.1.hook_out", "ln_final.hook_normalized"]
    report = _compare_batch(driver, ref, prompts, specs, capture)
    check(report, TOL, f"{driver.info.architecture} per-prompt specs")
    plain = driver.forward(prompts, max_new_tokens=0)
    edited = driver.forward(prompts, intervene=specs, max_new_tokens=0)
    changed = [float((plain.logits[b] - edited.logits[b]).abs().max()) for b in range(len(prompts))]
    assert changed[4] <= 1e-5, "a prompt without specs changed"
    assert all(c > 1e-3 for i, c in enumerate(changed) if specs[i]), changed


def test_one_mapping_for_every_prompt(family: Any) -> None:
    driver, ref, prompts = family
    vec = torch.linspace(-1, 1, driver.info.d_model).tolist()
    intervene = {
        "blocks.0.hook_out": {"op": "add", "value": vec},
        "blocks.1.attn.hook_out": {"op": "scale", "factor": 0.0, "pos": -1},
    }
    report = _compare_batch(driver, ref, prompts, intervene, ["blocks.1.hook_in", "blocks.1.hook_out"])
    check(report, TOL, f"{driver.info.architecture} shared specs")


def test_greedy_generation_with_steering(family: Any) -> None:
    driver, ref, prompts = family
    chosen = [prompts[0], prompts[3], prompts[1], prompts[2]]
    vec = (torch.linspace(-2, 2, driver.info.d_model)).tolist()
    intervene = [
        {"blocks.0.hook_out": {"op": "add", "value": vec}},
        {"blocks.1.mlp.hook_out": {"op": "scale", "factor": 1.5}, "blocks.0.hook_in": {"op": "suppress", "pos": 0}},
        None,
        {"blocks.1.hook_in": [{"op": "add", "value": 0.5}, {"op": "set", "value": vec, "pos": -1}]},
    ]
    result = driver.forward(
        chosen, capture=["blocks.1.hook_out"], intervene=intervene, max_new_tokens=6, stop_at_eos=False
    )
    assert result.new_tokens is not None and result.new_tokens.shape == (4, 6)
    for b, ids in enumerate(chosen):
        want = ref.generate(ids, 6, intervene[b])
        assert result.new_tokens[b].tolist() == want, f"prompt {b}"
        prompt_capture, logits = ref.run(ids, ["blocks.1.hook_out"], intervene[b])
        n = len(ids)
        check(
            {"capture": diff(result.captured["blocks.1.hook_out"][b, :n], prompt_capture["blocks.1.hook_out"]),
             "logits": diff(result.logits[b, :n], logits)},
            TOL,
            f"prompt {b} during generation",
        )


def test_matches_the_hf_driver(family: Any) -> None:
    """The same Driver.forward call on the hf driver (the project's reference) agrees."""
    driver, ref, prompts = family
    from tl_core import TransformerBridge

    hf = TransformerBridge.boot_transformers(ref.model.name_or_path, dtype=torch.float32, use_attn_result=True).driver
    served = sorted(driver.supported_hook_points)
    specs = _per_prompt_specs(driver.info.d_model, driver.info.architecture)
    report: dict[str, float] = {}
    for label, intervene in (("plain", None), ("specs", specs)):
        ours = driver.forward(prompts, capture=served, intervene=intervene, max_new_tokens=0)
        theirs = hf.forward(prompts, capture=served, intervene=intervene, max_new_tokens=0)
        assert ours.lengths == tuple(theirs.lengths)
        for b, n in enumerate(ours.lengths):
            for name in served:
                report[f"{label}:p{b}:{name}"] = diff(
                    prompt_part(ours.captured[name], b, n), prompt_part(theirs.captured[name], b, n)
                )
            report[f"{label}:p{b}:logits"] = diff(ours.logits[b, :n], theirs.logits[b, :n])
    check(report, TOL, f"{driver.info.architecture} vs the hf driver")
