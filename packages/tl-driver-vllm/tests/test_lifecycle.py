"""Engine lifecycle: close() leaves nothing behind; tensor parallelism (multiprocess) keeps parity; bf16."""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
psutil = pytest.importorskip("psutil")

from _tlv_reference import Reference  # noqa: E402
from _tlv_support import ENGINE_OPTIONS, check, prompt_part, reference_served, rounding_ratio  # noqa: E402

from tl_core import RemoteBridge, TransformerBridge, UserError  # noqa: E402
from tl_core.certification import check_rounding  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _engine_processes() -> list[str]:
    # multiprocessing's resource tracker is a stdlib helper that lives as long as this
    # interpreter, whoever started it; it holds no engine state.
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            line = " ".join(child.cmdline())
        except psutil.ZombieProcess:
            line = f"zombie {child.pid}"
        if "resource_tracker" not in line:
            found.append(line)
    return found


def _sockets(folder: Path) -> list[str]:
    return (
        [p.name for p in folder.iterdir() if stat.S_ISSOCK(p.lstat().st_mode)]
        if folder.exists()
        else []
    )


def test_close_in_process_releases_everything(checkpoint: Any, vllm_tmp: Path) -> None:
    bridge = RemoteBridge.boot_vllm(checkpoint("gpt2"), dtype="float32", **ENGINE_OPTIONS)
    assert bridge.driver._raw, "the suite runs the engine in-process"
    assert bridge.generate("The lighthouse", max_new_tokens=3)
    bridge.close()
    bridge.close()  # twice is fine
    with pytest.raises(UserError, match="closed"):
        bridge.driver.forward([[5, 6]])
    assert _engine_processes() == []
    assert _sockets(vllm_tmp / "rpc") == []


def _sharded_specs(driver: Any) -> list[dict[str, Any] | None]:
    """Per-prompt specs on head- and neuron-sharded sites, with pos, vectors and scalars."""
    ns = driver.namespace
    gen = torch.Generator().manual_seed(5)

    def vec(hook: str) -> list[float]:
        return torch.randn(math.prod(ns.feature_shape(hook)), generator=gen).tolist()

    return [
        {
            "blocks.0.attn.hook_q": {
                "op": "add",
                "value": vec("blocks.0.attn.hook_q"),
                "pos": [0, -1],
            },
            "blocks.1.attn.hook_result": {
                "op": "set",
                "value": vec("blocks.1.attn.hook_result"),
                "pos": 2,
            },
            "blocks.0.hook_out": {"op": "add", "value": 0.5, "pos": -1},
        },
        None,
        {
            "blocks.0.attn.hook_rot_k": {
                "op": "set",
                "value": vec("blocks.0.attn.hook_rot_k"),
                "pos": 1,
            },
            "blocks.1.attn.hook_v": {"op": "scale", "factor": 2.0},
            "blocks.1.ln2.hook_in": {"op": "scale", "factor": 0.5},
        },
        {
            "blocks.1.attn.hook_z": {"op": "add", "value": vec("blocks.1.attn.hook_z")},
            "blocks.0.mlp.hook_pre": {"op": "suppress", "pos": [3, 7]},
            "blocks.1.mlp.hook_post": {
                "op": "add",
                "value": vec("blocks.1.mlp.hook_post"),
                "pos": -1,
            },
            "blocks.0.mlp.hook_pre_linear": {"op": "scale", "factor": -1.0},
            "blocks.1.attn.hook_k": {"op": "add", "value": vec("blocks.1.attn.hook_k")},
        },
    ]


def test_tensor_parallel_2_multiprocess(
    checkpoint: Any, vllm_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP=2 on the CPU build: two worker processes; every served hook, head- and
    neuron-sharded ones put together in global order, equals the hf driver's (so TP=1's),
    and specs on sharded sites reach the rank holding each slice. The model has one
    key/value head, so vLLM replicates it on both ranks (query heads and neurons are split);
    the driver takes it once and checks the copies agree."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    # Two workers on a one-NUMA-node machine: vLLM's automatic thread binding refuses.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    folder = checkpoint("llama", num_key_value_heads=1)
    bridge = RemoteBridge.boot_vllm(
        folder, dtype="float32", tensor_parallel_size=2, use_attn_result=True, **ENGINE_OPTIONS
    )
    try:
        driver = bridge.driver
        assert sorted(w["tp_rank"] for w in driver.workers) == [0, 1]
        assert not driver._raw and all(w["pid"] != os.getpid() for w in driver.workers)
        # The boot's certification forward already compared both ranks' replicated values,
        # and every equation holds on the assembled shards.
        assert driver._ranks_checked
        assert bridge.certification is not None and not bridge.certification.failed
        hf, exact = (
            TransformerBridge.boot_transformers(
                str(folder), dtype=dtype, use_attn_result=True
            ).driver
            for dtype in (torch.float32, torch.float64)
        )
        prompts = [[5, 6, 7, 8, 9], list(range(10, 50)), [60, 61], list(range(100, 112))]
        intervene = _sharded_specs(driver)
        capture = sorted(driver.supported_hook_points)
        report: dict[str, float] = {}
        for label, specs in (("plain", None), ("specs", intervene)):
            ours = driver.forward(prompts, capture=capture, intervene=specs, max_new_tokens=0)
            assert driver._ranks_checked
            theirs = hf.forward(prompts, capture=capture, intervene=specs, max_new_tokens=0)
            truth = exact.forward(prompts, capture=capture, intervene=specs, max_new_tokens=0)
            for b, n in enumerate(ours.lengths):
                for k in capture:
                    report[f"{label}:p{b}:{k}"] = rounding_ratio(
                        *(prompt_part(r.captured[k], b, n) for r in (ours, theirs, truth)), k
                    )
                report[f"{label}:p{b}:logits"] = rounding_ratio(
                    ours.logits[b, :n], theirs.logits[b, :n], truth.logits[b, :n]
                )
        assert driver.info.kv_heads == 1
        check(report, 1.0, "TP=2" + ", error / allowed against float64")
        # Generation with sharded edits: the same tokens as the hf driver's.
        steered = driver.forward(prompts, intervene=intervene, max_new_tokens=4, stop_at_eos=False)
        want = hf.forward(prompts, intervene=intervene, max_new_tokens=4, stop_at_eos=False)
        assert steered.new_tokens is not None and want.new_tokens is not None
        assert steered.new_tokens.tolist() == want.new_tokens.tolist()
        # Both ranks' results crossed through the driver's shared-memory folder, now empty.
        shared = driver._shared.folder
        assert shared is not None and os.listdir(shared) == ["probe"]
    finally:
        bridge.close()
    assert _engine_processes() == []
    assert _sockets(vllm_tmp / "rpc") == []
    assert not Path(shared).exists()


#: bfloat16: engine kernels and transformers round at different places, so each is measured
#: against the checkpoint run in float64 (the hf driver), and vLLM's error may be this many
#: times transformers' own bfloat16 error (tl_core.certification.check_rounding), never a fixed
#: share of the largest activation, which counts rounding steps of one machine.
BF16_FACTOR = 8.0


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_bfloat16_within_documented_band(checkpoint: Any, family: str) -> None:
    folder = checkpoint(family, "bfloat16")
    bridge = RemoteBridge.boot_vllm(folder, **ENGINE_OPTIONS)
    try:
        driver = bridge.driver
        assert driver.workers[0]["dtype"] == "torch.bfloat16"
        ref = Reference(folder, dtype=torch.bfloat16)
        exact = TransformerBridge.boot_transformers(str(folder), dtype=torch.float64).driver
        prompts = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 60))]
        capture = reference_served(driver)
        result = driver.forward(prompts, capture=capture, max_new_tokens=0)
        report: dict[str, float] = {}
        differs = False
        for b, ids in enumerate(prompts):
            want, logits = ref.run(ids, capture)
            truth = exact.forward([ids], capture=capture, max_new_tokens=0)
            n = len(ids)
            for k in capture:
                got = result.captured[k][b, :n]
                report[f"p{b}:{k}"] = check_rounding(
                    got, want[k], truth.captured[k][0], factor=BF16_FACTOR
                ).ratio
                differs = differs or not torch.equal(got, want[k])
            report[f"p{b}:logits"] = check_rounding(
                result.logits[b, :n], logits, truth.logits[0], factor=BF16_FACTOR
            ).ratio
        assert result.captured["blocks.1.hook_out"].dtype == torch.bfloat16
        check(report, 1.0, f"{family} bfloat16, error / allowed against float64")
        assert differs  # bf16 engines do round differently: the band is needed
    finally:
        bridge.close()
