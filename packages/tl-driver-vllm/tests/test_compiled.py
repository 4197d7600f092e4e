"""Compiled mode (the default on vLLM's CPU build): runs with nothing to capture
or edit, and runs that capture the residual stream and logits or add to the residual
stream, use vLLM's compiled graph; runs with other hooks its eager forward. Both are within
float32 rounding of an eager engine and within the usual band of the hf driver; nothing is
traced again after boot.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from _tlv_support import (  # noqa: E402
    ENGINE_OPTIONS,
    ENGINE_SIZES,
    check,
    compare_modes,
    eager_ratio,
    layer_calls,
    prompt_part,
)

from tl_core import ConfigError, RemoteBridge, TransformerBridge  # noqa: E402
from tl_driver_vllm._driver_side._options import RUNNER_SWITCH  # noqa: E402
from tl_driver_vllm._wire import RESIDENT_KEY  # noqa: E402
from tl_driver_vllm._worker_side._resident import VISIT_OP, prepare_loaded_model  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LENGTHS = [9, 40, 3, 17]


@pytest.fixture(scope="module")
def engines(checkpoint: Any) -> Iterator[dict[str, Any]]:
    folder = checkpoint("llama")
    compiled = RemoteBridge.boot_vllm(folder, dtype="float32", **ENGINE_SIZES)
    try:
        eager = RemoteBridge.boot_vllm(folder, dtype="float32", **ENGINE_OPTIONS)
        try:
            hf = TransformerBridge.boot_transformers(str(folder), dtype=torch.float32)
            exact = TransformerBridge.boot_transformers(str(folder), dtype=torch.float64)
            gen = torch.Generator().manual_seed(5)
            vocab = compiled.cfg.d_vocab
            prompts = [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in LENGTHS]
            yield {
                "compiled": compiled.driver, "eager": eager.driver, "hf": hf.driver,
                "exact": exact.driver, "prompts": prompts,
            }  # fmt: skip
        finally:
            eager.close()
    finally:
        compiled.close()


def test_the_engine_is_compiled_by_default_and_reports_it(engines: dict[str, Any]) -> None:
    assert engines["compiled"].compiled and not engines["eager"].compiled
    assert all(w["compiled"] and w["resident"] for w in engines["compiled"].workers)
    assert not any(w["compiled"] or w["resident"] for w in engines["eager"].workers)
    assert engines["eager"].namespace.eager_only == {}


def test_the_namespace_marks_the_hooks_that_run_eagerly(engines: dict[str, Any]) -> None:
    eager_only = engines["compiled"].namespace.eager_only
    stream = {"blocks.0.hook_in", "blocks.1.hook_out", "ln_final.hook_in", "unembed.hook_out"}
    assert stream.isdisjoint(eager_only)
    assert {"blocks.0.attn.hook_z", "blocks.1.mlp.hook_post", "blocks.0.ln1.hook_out"} <= set(
        eager_only
    )
    assert "embed.hook_in" not in eager_only  # filled from the request by the driver
    assert not engines["eager"].namespace.eager_only


def test_a_run_without_hooks_uses_the_compiled_graph(engines: dict[str, Any]) -> None:
    driver, prompts = engines["compiled"], engines["prompts"]
    calls, handle = layer_calls(driver)
    try:
        plain = driver.forward(prompts, max_new_tokens=6, return_logits=False)
        assert calls == [], "the compiled engine ran its eager forward for a run without hooks"
        hooked = driver.forward(
            prompts, max_new_tokens=6, return_logits=False, capture=["blocks.0.attn.hook_z"]
        )
        assert calls, "a run with a head-level hook did not run the eager forward"
        calls.clear()
        driver.forward(prompts[:1], max_new_tokens=2, return_logits=False)
        assert calls == [], "the eager forward outlived the run that needed it"
    finally:
        handle.remove()
    eager = engines["eager"].forward(prompts, max_new_tokens=6, return_logits=False)
    assert torch.equal(plain.new_tokens, eager.new_tokens)
    assert torch.equal(hooked.new_tokens, eager.new_tokens)


def test_captures_edits_and_logits_match_the_eager_engine_and_the_hf_driver(
    engines: dict[str, Any],
) -> None:
    driver, prompts = engines["compiled"], engines["prompts"]
    served = sorted(driver.supported_hook_points)
    d = driver.info.d_model
    intervene = {
        "blocks.0.hook_out": {"op": "add", "value": [0.5] * d},
        "blocks.1.attn.hook_z": {"op": "scale", "factor": 0.25, "pos": [0, -1]},
    }
    # Against the eager engine: the eager forward of both; vLLM may bind some custom ops
    # (rotary embeddings) to other implementations when it compiles: float32 rounding.
    # (Measured: equal bits with both engines in this process, 1 ulp apart in separate
    # processes.)
    drivers = [engines[name] for name in ("compiled", "eager", "hf", "exact")]
    report = compare_modes(drivers, prompts, served, intervene)
    check(report, 1.0, "compiled engine against the hf driver and the eager engine")


def _resident_runs(driver: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """Residual captures, logits and per-prompt and positional edits (every spec op),
    prefill and steered generation, with prompts of several lengths and chunked prefill."""
    d = driver.info.d_model
    gen = torch.Generator().manual_seed(11)
    vectors = [torch.randn(d, generator=gen).tolist() for _ in range(3)]
    capture = ["blocks.0.hook_in", "blocks.0.hook_out", "blocks.1.hook_out", "ln_final.hook_in"]
    ops: list[Any] = [
        {"op": "add", "value": vectors[0]},
        {"op": "scale", "factor": 0.5},
        {"op": "set", "value": vectors[1], "pos": [0, -1]},
        [
            {"op": "scale", "factor": -1.0},
            {"op": "add", "value": 0.3},
            {"op": "suppress", "pos": 0},
        ],
    ]
    per_prompt = [{"blocks.0.hook_out": ops[b % len(ops)]} for b in range(len(prompts))]
    positional = {"blocks.1.hook_in": {"op": "add", "value": vectors[2], "pos": [0, 1, -1]}}
    steer = {"blocks.1.hook_out": {"op": "add", "value": vectors[0]}}
    final = [{"ln_final.hook_out": ops[(b + 1) % len(ops)]} for b in range(len(prompts))]
    return {
        "steered": driver.forward(prompts, max_new_tokens=7, return_logits=False, intervene=steer),
        "prefill": driver.forward(prompts, capture=capture, intervene=per_prompt),
        "positional": driver.forward(prompts, capture=capture[2:], intervene=positional),
        "final norm": driver.forward(prompts, capture=["ln_final.hook_out"], intervene=final),
        "final norm steered": driver.forward(
            prompts, max_new_tokens=5, return_logits=False, intervene=final[:1] * len(prompts)
        ),
    }


def test_residual_runs_stay_in_the_compiled_graph_and_match_the_eager_engine(
    engines: dict[str, Any],
) -> None:
    driver, prompts = engines["compiled"], engines["prompts"]
    calls, handle = layer_calls(driver)
    try:
        ours = _resident_runs(driver, prompts)
        assert calls == [], "a residual-stream run ran the eager forward"
        # blocks.0.hook_out and blocks.1.hook_in are one tensor: edited both, eagerly.
        scaled = {
            "blocks.0.hook_out": {"op": "add", "value": 0.25},
            "blocks.1.hook_in": {"op": "scale", "factor": 0.5},
        }
        fallback = driver.forward(prompts, capture=["blocks.0.hook_out"], intervene=scaled)
        assert calls, "a run editing two hooks of one site did not take the eager forward"
    finally:
        handle.remove()
    eager = engines["eager"]
    theirs = _resident_runs(eager, prompts)
    for run in ("prefill", "positional", "final norm"):
        for b, n in enumerate(LENGTHS):
            for name, value in [*theirs[run].captured.items(), ("logits", theirs[run].logits)]:
                got = ours[run].logits if name == "logits" else ours[run].captured[name]
                a, e = prompt_part(got, b, n), prompt_part(value, b, n)
                assert eager_ratio(a, e) <= 1.0, (run, b, name)
    for run in ("steered", "final norm steered"):
        assert torch.equal(ours[run].new_tokens, theirs[run].new_tokens), run
    plain = engines["eager"].forward(prompts, max_new_tokens=7, return_logits=False)
    assert not torch.equal(plain.new_tokens, theirs["steered"].new_tokens), "steering did nothing"
    reference = eager.forward(prompts, capture=["blocks.0.hook_out"], intervene=scaled)
    torch.testing.assert_close(
        fallback.captured["blocks.0.hook_out"], reference.captured["blocks.0.hook_out"],
        rtol=1e-5, atol=1e-5,
    )  # fmt: skip


def test_nothing_is_traced_again_after_boot(engines: dict[str, Any]) -> None:
    from torch._dynamo.utils import counters

    driver, prompts = engines["compiled"], engines["prompts"]
    before = counters["stats"]["unique_graphs"]
    d = driver.info.d_model
    driver.forward(prompts[:2], max_new_tokens=3, return_logits=False)
    driver.forward(prompts, capture=["blocks.1.hook_in"], max_new_tokens=0)
    driver.forward(
        prompts[1:], intervene={"blocks.0.hook_out": {"op": "add", "value": [1.0] * d}},
        max_new_tokens=4, return_logits=False,
    )  # fmt: skip
    driver.forward(prompts[2:3], max_new_tokens=5, return_logits=False)
    driver.forward(
        prompts[:3], capture=["blocks.0.hook_in", "ln_final.hook_in"], max_new_tokens=2,
        intervene={"blocks.1.hook_in": {"op": "add", "value": [0.5] * d, "pos": [1]}},
    )  # fmt: skip
    assert counters["stats"]["unique_graphs"] == before


def test_off_the_cpu_build_the_default_is_eager_and_a_gpu_gets_piecewise_graphs(
    checkpoint: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import vllm
    from vllm.platforms import current_platform

    asked: list[dict[str, Any]] = []

    class Stop(Exception):
        pass

    def no_engine(**kwargs: Any) -> Any:
        asked.append(kwargs)
        raise Stop

    folder = checkpoint("llama")
    platform = type(current_platform)
    monkeypatch.setattr(vllm, "LLM", no_engine)
    monkeypatch.setattr(platform, "is_cpu", lambda self: False)
    with pytest.raises(ConfigError, match="CPU build and on CUDA or ROCm"):
        RemoteBridge.boot_vllm(folder, enforce_eager=False)
    with pytest.raises(ConfigError, match="enforce_eager must be True, False or None"):
        RemoteBridge.boot_vllm(folder, enforce_eager="no")
    assert asked == []
    with caplog.at_level("INFO", logger="vllm.tl_driver_vllm"), pytest.raises(Stop):
        RemoteBridge.boot_vllm(folder)
    [kwargs] = asked
    assert kwargs["enforce_eager"] is True and "additional_config" not in kwargs
    assert "tl runs vLLM eagerly" in caplog.text
    # CUDA or ROCm: compiled on request, piecewise CUDA graphs only, sites in the config.
    monkeypatch.setattr(platform, "is_cuda_alike", lambda self: True)
    full = {"cudagraph_mode": "FULL_AND_PIECEWISE"}
    with pytest.raises(ConfigError, match="full CUDA graph"):
        RemoteBridge.boot_vllm(folder, enforce_eager=False, compilation_config=full)
    with pytest.raises(Stop):
        RemoteBridge.boot_vllm(folder, enforce_eager=False)
    kwargs = asked[-1]
    assert kwargs["enforce_eager"] is False
    assert kwargs["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    assert RESIDENT_KEY in kwargs["additional_config"]


def test_a_request_for_vllms_v2_model_runner_is_refused_before_any_engine(
    checkpoint: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm

    started: list[Any] = []
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: started.append(kwargs))
    monkeypatch.setenv(RUNNER_SWITCH, "1")
    with pytest.raises(ConfigError, match="V2 model runner"):
        RemoteBridge.boot_vllm(checkpoint("llama"), **ENGINE_OPTIONS)
    assert started == []


class _TinyModel(torch.nn.Module):
    """Two residual blocks and a final norm, laid out as the resident sites expect."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.model.norm = torch.nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            x = x + layer(x)
        return self.model.norm(x)


def _loaded(splitting_ops: list[str]) -> tuple[_TinyModel, Any]:
    from types import SimpleNamespace as Space

    layout = {
        "inner": "model", "layers": "layers", "final_norm": "norm", "layer_input": 0,
        "residual_offset": 1, "residual_pair": False, "d_model": 4, "mlp": "mlp",
        "activation": None, "sites": True,
    }  # fmt: skip
    config = Space(
        additional_config={RESIDENT_KEY: layout},
        model_config=Space(enforce_eager=False),
        parallel_config=Space(pipeline_parallel_size=1),
        scheduler_config=Space(max_num_batched_tokens=8),
        compilation_config=Space(splitting_ops=splitting_ops, max_cudagraph_capture_size=16),
    )
    model = _TinyModel()
    prepare_loaded_model(Space(vllm_config=config, get_model=lambda: model))
    return model, config.compilation_config


def test_where_vllm_splits_its_graph_the_capture_op_is_a_piece_of_its_own() -> None:
    """On GPUs vLLM replays a CUDA graph per piece between its splitting ops, so the op
    that hands residual values to captures (Python) must be split out to run every step."""
    from vllm.compilation.backends import split_graph

    from tl_driver_vllm._worker_side import _resident

    attention = "vllm::unified_attention_with_output"
    model, compilation = _loaded([attention])
    assert compilation.splitting_ops == [attention, VISIT_OP]
    assert model._tl_resident.sites[0].rows.shape[0] == 16  # the largest padded step
    # The CPU build splits nothing: its list stays empty.
    assert _loaded([])[1].splitting_ops == []

    pieces: list[Any] = []

    def splitting_backend(graph: Any, example_inputs: Any) -> Any:
        split, items = split_graph(graph, compilation.splitting_ops)
        pieces.extend(items)
        return split

    seen: dict[int, list[torch.Tensor]] = {}
    sites = [*model._tl_resident.sites, model._tl_resident.output]
    for k, site in enumerate(sites):
        _resident._WORK[site.token.data_ptr()] = seen.setdefault(k, []).append
    try:
        x = torch.randn(3, 4)
        got = torch.compile(model, backend=splitting_backend, fullgraph=True)(x)
    finally:
        for site in sites:
            _resident._WORK.pop(site.token.data_ptr(), None)
    visits = [p for p in pieces if p.is_splitting_graph]
    assert len(visits) == len(sites)
    for piece in visits:
        ops = [n.target for n in piece.graph.graph.nodes if n.op == "call_function"]
        assert ops == [torch.ops.tl_vllm.visit]
    # Unedited, the graph computes the model; each piece saw its site's value.
    with torch.no_grad():
        stream = [x]
        for layer in model.model.layers:
            stream.append(stream[-1] + layer(stream[-1]))
        want = model.model.norm(stream[-1])
    torch.testing.assert_close(got, want)
    for k, values in seen.items():
        [value] = values
        torch.testing.assert_close(value, want if k == len(sites) - 1 else stream[k])
