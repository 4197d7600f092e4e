"""Compiled mode across residual-stream layouts: what runs inside the compiled graph
(residual captures, logits, ``add`` edits) against the hf driver, per family.

One compiled engine per family, chosen for how its blocks hand the residual stream on:
fused ``(delta, residual)`` pairs (Llama), plain hidden states with learned positions
(GPT-2), sandwich norms and a scaled embedding (Gemma 2), parallel blocks (GPT-J), an
embedding norm and an MLP activation the driver replaces before vLLM traces the model
(BLOOM), and the residual two arguments after the hidden states (gpt-oss, a mixture of
experts). Each run
must stay in the compiled graph (a Python hook on decoder layer 0 runs only in the eager
forward), match an eager engine of the same checkpoint within 1e-5 relative and the hf
driver within the parity suite's band, over a ragged batch with chunked prefill; steered
greedy generation must give the eager engine's and the hf driver's tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from _tlv_support import ENGINE_OPTIONS, check, layer_calls, prompt_part, rounding_ratio  # noqa: E402

from tl_core import RemoteBridge, TransformerBridge  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FAMILIES = ("llama", "gpt2", "gemma2", "gptj", "bloom", "gpt_oss")
#: Built from its default transformers config (as in ``test_parity.py``).
DEFAULT_CONFIG = frozenset({"gpt_oss"})
LENGTHS = [9, 70, 3, 17]
WITHIN = 1.0


@pytest.fixture(scope="module", params=FAMILIES)
def family(
    request: pytest.FixtureRequest, checkpoint: Any, default_checkpoint: Any
) -> Iterator[dict[str, Any]]:
    name = request.param
    folder = default_checkpoint(name) if name in DEFAULT_CONFIG else checkpoint(name)
    bridge = RemoteBridge.boot_vllm(folder, dtype="float32", enforce_eager=False, **ENGINE_OPTIONS)
    eager = RemoteBridge.boot_vllm(folder, dtype="float32", **ENGINE_OPTIONS)
    try:
        assert all(w["resident"] for w in bridge.driver.workers)
        hf, exact = (
            TransformerBridge.boot_transformers(str(folder), dtype=dtype).driver
            for dtype in (torch.float32, torch.float64)
        )
        gen = torch.Generator().manual_seed(3)
        prompts = [
            torch.randint(4, bridge.cfg.d_vocab, (n,), generator=gen).tolist() for n in LENGTHS
        ]
        yield {
            "vllm": bridge.driver, "eager": eager.driver, "hf": hf, "exact": exact,
            "prompts": prompts,
        }  # fmt: skip
    finally:
        eager.close()
        bridge.close()


def _specs(d: int) -> list[dict[str, Any] | None]:
    gen = torch.Generator().manual_seed(9)
    vec, other = (torch.randn(d, generator=gen).tolist() for _ in range(2))
    return [
        {"blocks.0.hook_out": {"op": "add", "value": vec}},
        {"blocks.1.hook_in": {"op": "add", "value": other, "pos": [0, 40, -1]}},  # a later chunk
        None,
        {
            "blocks.0.hook_in": {"op": "add", "value": 0.5},
            "ln_final.hook_in": {"op": "add", "value": vec, "pos": -1},
        },
    ]


def test_residual_runs_inside_the_compiled_graph_match_the_hf_driver(
    family: dict[str, Any],
) -> None:
    driver, prompts = family["vllm"], family["prompts"]
    n_layers = driver.info.n_layers
    # Every site's value after its edit (a capture ahead of an edit at the same site, such
    # as blocks.{n-1}.hook_out with ln_final.hook_in edited, runs eagerly).
    capture = [
        *(f"blocks.{i}.hook_in" for i in range(n_layers)),
        "ln_final.hook_in",
        "ln_final.hook_out",
    ]
    assert set(capture).isdisjoint(driver.namespace.eager_only)
    specs = _specs(driver.info.d_model)
    calls, handle = layer_calls(driver)
    try:
        runs = [
            driver.forward(prompts, capture=capture, intervene=specs, max_new_tokens=0),
            driver.forward(prompts, capture=capture[:1], max_new_tokens=0),
        ]
        steered = driver.forward(
            prompts[:2], intervene=specs[:2], max_new_tokens=5, return_logits=False,
            stop_at_eos=False,
        )  # fmt: skip
        assert calls == [], "a residual-stream run left the compiled graph"
    finally:
        handle.remove()
    report: dict[str, float] = {}
    for run, (ours, intervene) in enumerate(zip(runs, [specs, None], strict=True)):
        names = list(ours.captured)
        eager, theirs, exact = (
            family[k].forward(prompts, capture=names, intervene=intervene, max_new_tokens=0)
            for k in ("eager", "hf", "exact")
        )
        for b, n in enumerate(LENGTHS):
            for name in [*names, "logits"]:
                got, same, want, truth = (
                    prompt_part(r.logits if name == "logits" else r.captured[name], b, n)
                    for r in (ours, eager, theirs, exact)
                )
                report[f"run{run}:p{b}:{name}"] = rounding_ratio(got, want, truth, name)
                scale = max(1.0, float(same.abs().max()))
                gap = float((got.float() - same.float()).abs().max())
                report[f"run{run}:p{b}:{name} vs eager"] = gap / (1e-5 * scale)
    check(report, WITHIN, f"{driver.info.architecture} compiled residual stream")
    again = family["eager"].forward(
        prompts[:2], intervene=specs[:2], max_new_tokens=5, return_logits=False,
        stop_at_eos=False,
    )  # fmt: skip
    assert torch.equal(steered.new_tokens, again.new_tokens)
    for b in range(2):
        want = family["hf"].forward(
            prompts[b : b + 1], intervene=specs[b], max_new_tokens=5, return_logits=False,
            stop_at_eos=False,
        )  # fmt: skip
        assert steered.new_tokens[b].tolist() == want.new_tokens[0].tolist(), f"prompt {b}"
