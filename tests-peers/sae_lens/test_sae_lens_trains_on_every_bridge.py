"""sae-lens trains a sparse autoencoder on a tl bridge: hf in process, and a vLLM engine.

sae-lens's training runner takes any model with the HookedTransformer surface
(``override_model``): it calls ``run_with_cache(tokens, names_filter=[hook],
stop_at_layer=..., prepend_bos=False)``, reads ``tokenizer`` and the input device
(``W_E.device`` or ``cfg.device``). Both bridges offer that one surface, so the same
training run works on activations served by vLLM. Everything is local: a tiny random
checkpoint and a tokenised ``datasets.Dataset`` built here; no hub, no wandb.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
sae_lens = pytest.importorskip("sae_lens")
datasets = pytest.importorskip("datasets")

from tl_core import RemoteBridge, TransformerBridge  # noqa: E402
from tl_driver_hf.testing import write_tiny_checkpoint  # noqa: E402

HOOK = "blocks.0.hook_resid_post"  # a TransformerLens name; sae-lens stops after block 0
CONTEXT = 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module", params=["hf", "vllm"])
def bridge(
    request: pytest.FixtureRequest, folder: Path, engine_options: dict[str, Any]
) -> Iterator[Any]:
    if request.param == "hf":
        yield TransformerBridge.boot_transformers(str(folder))
        return
    pytest.importorskip("vllm")
    remote = RemoteBridge.boot_vllm(folder, dtype="float32", **engine_options)
    try:
        yield remote
    finally:
        remote.close()


def _dataset(vocab: int, rows: int = 64) -> Any:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (rows, CONTEXT), generator=gen)
    return datasets.Dataset.from_dict({"input_ids": ids.tolist()})


def _config(d_model: int, out: Path) -> Any:
    from sae_lens import LanguageModelSAERunnerConfig, LoggingConfig, StandardTrainingSAEConfig

    return LanguageModelSAERunnerConfig(
        sae=StandardTrainingSAEConfig(d_in=d_model, d_sae=4 * d_model, l1_coefficient=1e-3),
        model_name="tiny-llama",
        hook_name=HOOK,
        dataset_path="local",
        is_dataset_tokenized=True,
        streaming=False,
        context_size=CONTEXT,
        prepend_bos=False,
        training_tokens=2048,
        train_batch_size_tokens=64,
        n_batches_in_buffer=8,  # sae-lens needs n_batches_in_buffer * context >= the batch
        store_batch_size_prompts=8,
        n_batches_for_norm_estimate=2,
        lr=1e-3,
        device="cpu",
        seed=0,
        n_eval_batches=0,
        logger=LoggingConfig(log_to_wandb=False),
        n_checkpoints=0,
        checkpoint_path=None,
        output_path=str(out),
        verbose=False,
    )


def test_sae_lens_trains_on_the_bridge(bridge: Any, tmp_path: Path) -> None:
    from sae_lens import LanguageModelSAETrainingRunner

    calls: list[dict[str, Any]] = []
    run_with_cache = bridge.run_with_cache

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return run_with_cache(*args, **kwargs)

    bridge.run_with_cache = spy
    try:
        runner = LanguageModelSAETrainingRunner(
            _config(bridge.cfg.d_model, tmp_path),
            override_dataset=_dataset(bridge.cfg.d_vocab),
            override_model=bridge,
        )
        before = runner.sae.W_dec.detach().clone()
        sae = runner.run()
    finally:
        del bridge.run_with_cache
    # sae-lens asked for the hook by its TransformerLens name and stopped after block 0.
    assert calls and all(c["names_filter"] == [HOOK] and c["stop_at_layer"] == 1 for c in calls)
    assert not torch.equal(before, sae.W_dec.detach()), "the SAE did not train"
    # What sae-lens trained on is what the bridge serves under that name.
    tokens = torch.tensor(_dataset(bridge.cfg.d_vocab)["input_ids"][:4])
    stored = runner.activations_store.get_activations(tokens)
    _, cache = bridge.run_with_cache(tokens, names_filter=[HOOK], prepend_bos=False)
    torch.testing.assert_close(stored, cache[HOOK], atol=1e-5, rtol=1e-5)
    # The SAE reconstructs those activations better than the zero vector does.
    acts = cache[HOOK].flatten(0, 1)
    error = (sae(acts) - acts).pow(2).sum(-1).mean()
    assert error < acts.pow(2).sum(-1).mean()


def test_vllm_serves_sae_lens_the_hf_drivers_activations(
    folder: Path, engine_options: dict[str, Any]
) -> None:
    pytest.importorskip("vllm")
    tokens = torch.tensor(_dataset(512)["input_ids"][:6])
    local = TransformerBridge.boot_transformers(str(folder))
    _, want = local.run_with_cache(tokens, names_filter=[HOOK], stop_at_layer=1, prepend_bos=False)
    remote = RemoteBridge.boot_vllm(folder, dtype="float32", **engine_options)
    try:
        resid, got = remote.run_with_cache(
            tokens, names_filter=[HOOK], stop_at_layer=1, prepend_bos=False
        )
    finally:
        remote.close()
    torch.testing.assert_close(got[HOOK], want[HOOK], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(resid, want[HOOK], atol=1e-4, rtol=1e-4)
