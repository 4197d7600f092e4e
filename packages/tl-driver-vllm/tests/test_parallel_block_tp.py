"""Tensor parallelism 2 on a parallel-block family (GPT-J): every site, gathered, as on the hf driver.

GPT-J's block feeds one norm to attention and the MLP and adds both outputs to the block
input; under TP=2 each rank holds half the heads and half the MLP neurons, and both read the
shared norm. Every served hook of a ragged batch (one prompt prefilled in chunks) must equal
the hf driver's, gathered in head and neuron order, and every site both drivers edit,
``ln2.hook_in`` (the block input as the MLP alone reads it) included, must steer the
activations and logits alike, with each rank cutting its columns out of the edit tables.
The engine is compiled (the driver's default): runs with hooks beyond the residual stream
take its eager forward on both ranks, residual-stream runs stay in its graph; every result
must also equal an eager TP=2 engine's within ``COMPILED_RTOL``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from _tlv_support import ENGINE_OPTIONS, ENGINE_SIZES, check, compare_modes  # noqa: E402

from tl_core import RemoteBridge, TransformerBridge  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LENGTHS = [9, 40, 3, 17, 1, 24]


def _every_site(driver: Any, hf: Any, prompts: int) -> list[dict[str, Any] | None]:
    """Per-prompt specs on every site both drivers edit, round robin; the last prompt none."""
    ns = driver.namespace
    gen = torch.Generator().manual_seed(3)
    per: list[dict[str, Any] | None] = [{} for _ in range(prompts - 1)] + [None]
    for k, name in enumerate(sorted(set(ns.editable) & set(hf.namespace.editable))):
        vec = torch.randn(math.prod(ns.feature_shape(name)), generator=gen).tolist()
        kinds: list[Any] = [
            [{"op": "scale", "factor": 0.5, "pos": 0}, {"op": "add", "value": 0.05}],
            {"op": "add", "value": vec, "pos": -1},
            {"op": "scale", "factor": 1.5},
        ]
        mapping = per[k % (prompts - 1)]
        assert mapping is not None
        mapping[name] = kinds[k % len(kinds)]
    return per


def test_gptj_tensor_parallel_2_every_site(
    checkpoint: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    # Two workers on a one-NUMA-node machine: vLLM's automatic thread binding refuses.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    folder = checkpoint("gptj")
    options = {"dtype": "float32", "tensor_parallel_size": 2, "use_attn_result": True}
    bridge = RemoteBridge.boot_vllm(folder, **options, **ENGINE_SIZES)
    eager_bridge: RemoteBridge | None = None
    try:
        eager_bridge = RemoteBridge.boot_vllm(folder, **options, **ENGINE_OPTIONS)
        driver, eager = bridge.driver, eager_bridge.driver
        assert sorted(w["tp_rank"] for w in driver.workers) == [0, 1]
        assert all(w["compiled"] and w["resident"] for w in driver.workers)
        hf, exact = (
            TransformerBridge.boot_transformers(
                str(folder), dtype=dtype, use_attn_result=True
            ).driver
            for dtype in (torch.float32, torch.float64)
        )
        gen = torch.Generator().manual_seed(99)
        prompts = [
            torch.randint(4, driver.info.d_vocab, (n,), generator=gen).tolist() for n in LENGTHS
        ]
        capture = sorted(driver.supported_hook_points)
        assert {
            "blocks.1.ln2.hook_in",
            "blocks.1.attn.hook_result",
            "blocks.1.mlp.hook_post",
        } <= set(capture)
        intervene = _every_site(driver, hf, len(prompts))
        assert any(spec and "blocks.0.ln2.hook_in" in spec for spec in intervene)
        # Residual-stream captures and adds only: served inside the compiled graph.
        stream = [f"blocks.{i}.hook_in" for i in range(driver.info.n_layers)]
        adds = [
            {"blocks.1.hook_in": {"op": "add", "value": 0.5, "pos": [0, -1]}},
            None, None, None, None,
            {"blocks.0.hook_out": {"op": "add", "value": [0.1] * driver.info.d_model}},
        ]  # fmt: skip
        report: dict[str, float] = {}
        for label, names, specs in (
            ("plain", capture, None), ("specs", capture, intervene), ("stream", stream, adds),
        ):  # fmt: skip
            drivers = (driver, eager, hf, exact)
            report.update(compare_modes(drivers, prompts, names, specs, f"{label}:"))
        check(
            report,
            1.0,
            f"GPT-J TP=2 ({len(capture)} hooks), error / allowed against float64, and "
            "compiled against eager",
        )
        steered = driver.forward(prompts, intervene=intervene, max_new_tokens=4, stop_at_eos=False)
        want = hf.forward(prompts, intervene=intervene, max_new_tokens=4, stop_at_eos=False)
        again = eager.forward(prompts, intervene=intervene, max_new_tokens=4, stop_at_eos=False)
        assert steered.new_tokens is not None and want.new_tokens is not None
        assert steered.new_tokens.tolist() == want.new_tokens.tolist()
        assert torch.equal(steered.new_tokens, again.new_tokens)
    finally:
        if eager_bridge is not None:
            eager_bridge.close()
        bridge.close()
