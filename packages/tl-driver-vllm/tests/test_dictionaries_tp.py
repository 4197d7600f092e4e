"""Tensor parallelism 2: the vllm driver runs a dictionary whole on both ranks (replicated)
and equals the hf driver; a head- or neuron-level site is refused at TP > 1."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from _tlv_support import ENGINE_OPTIONS  # noqa: E402

from tl_core import RemoteBridge, TransformerBridge, UnsupportedFeatureError  # noqa: E402
from tl_core.sae import random_dictionary  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LENGTHS = [9, 70, 3, 17]
TOL = {"rtol": 1e-4, "atol": 1e-4}


def test_tensor_parallel_2_runs_the_dictionary_on_both_ranks(
    checkpoint: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm.envs

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    # Two workers on a one-NUMA-node machine: vLLM's automatic thread binding refuses.
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # An in-process engine booted earlier in this process froze vLLM's environment reads.
    vllm.envs.disable_envs_cache()
    folder = checkpoint("llama")
    hf = TransformerBridge.boot_transformers(str(folder), dtype=torch.float32)
    d = random_dictionary(
        hf.cfg.d_model, 4 * hf.cfg.d_model, seed=5, scale=0.2, architecture="jumprelu"
    )
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, hf.cfg.d_vocab, (n,), generator=gen).tolist() for n in LENGTHS]
    acts = "blocks.1.hook_out.hook_sae_acts_post"
    per_prompt: list[Any] = [
        {acts: {"op": "add", "value": 3.0, "features": [1, 2]}},
        None,
        None,
        {acts: {"op": "suppress", "features": 9, "pos": -1}},
    ]
    vllm = RemoteBridge.boot_vllm(folder, dtype="float32", tensor_parallel_size=2, **ENGINE_OPTIONS)
    try:
        assert sorted(w["tp_rank"] for w in vllm.driver.workers) == [0, 1]
        with pytest.raises(UnsupportedFeatureError, match="cannot run under tensor parallelism"):
            vllm.add_sae(
                random_dictionary(hf.cfg.d_mlp, 64, seed=1), hook_name="blocks.0.mlp.hook_post"
            )
        results = []
        for bridge in (hf, vllm):
            spliced = bridge.add_sae(d, hook_name="blocks.1.hook_out")
            try:
                results.append(
                    bridge.run_with_cache(prompts, names_filter=[acts], intervene=per_prompt)
                )
            finally:
                spliced.remove()
    finally:
        vllm.close()
    (hf_logits, hf_cache), (vllm_logits, vllm_cache) = results
    for b, n in enumerate(LENGTHS):
        torch.testing.assert_close(vllm_logits[b, :n], hf_logits[b, :n], **TOL)
        torch.testing.assert_close(vllm_cache[acts][b, :n], hf_cache[acts][b, :n], **TOL)
