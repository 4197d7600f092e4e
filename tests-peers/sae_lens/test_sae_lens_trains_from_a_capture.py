"""sae-lens trains from a tl capture: collected on a vLLM engine, exported, read unchanged.

``tl capture`` runs a real vLLM engine over a local ``datasets`` folder of documents,
``export_sae_lens`` writes sae-lens's cached-activations format, and sae-lens trains with
``use_cached_activations=True``. Every batch sae-lens reads is compared with the store's
rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
sae_lens = pytest.importorskip("sae_lens")
datasets = pytest.importorskip("datasets")
pytest.importorskip("vllm")

from tl_core import TransformerBridge  # noqa: E402
from tl_core.capture import CaptureConfig, CaptureStore, capture, export_sae_lens  # noqa: E402
from tl_driver_hf.testing import write_tiny_checkpoint  # noqa: E402

HOOK = "blocks.0.hook_resid_post"
CONTEXT = 16


def _documents(folder: Path) -> Path:
    texts = [
        f"record {i}: {' '.join(str(i * j % 97) for j in range(3 + i % 11))}" for i in range(120)
    ]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(folder))
    return folder


def test_sae_lens_trains_from_an_exported_vllm_capture(
    tmp_path: Path, engine_options: dict[str, Any]
) -> None:
    from sae_lens import (
        LanguageModelSAERunnerConfig,
        LanguageModelSAETrainingRunner,
        LoggingConfig,
        StandardTrainingSAEConfig,
    )
    from sae_lens.training.activations_store import ActivationsStore

    model = write_tiny_checkpoint("llama", tmp_path / "llama")
    config = CaptureConfig(
        model=str(model), driver="vllm", boot_options={"dtype": "float32", **engine_options},
        hooks=(HOOK,), input=str(_documents(tmp_path / "documents")), context_size=CONTEXT,
        batch_size=8, shard_contexts=16,
    )  # fmt: skip
    assert capture(config, tmp_path / "store", progress=False).complete
    store = CaptureStore(tmp_path / "store")
    export = export_sae_lens(store, tmp_path / "cached")
    assert export.columns == {"blocks.0.hook_out": HOOK} and export.context_size == CONTEXT
    d_model = export.d_in[HOOK]
    # The store holds what the hf driver computes on the same contexts.
    local = TransformerBridge.boot_transformers(str(model))
    first = store.read("tokens", 0, CONTEXT)[None].long()
    _, cache = local.run_with_cache(first, names_filter=[HOOK])
    torch.testing.assert_close(store.read(HOOK, 0, CONTEXT), cache[HOOK][0], atol=1e-4, rtol=1e-4)

    read: list[torch.Tensor] = []
    original = ActivationsStore._load_raw_llm_batch_from_cached

    def spy(self: Any, raise_on_epoch_end: bool) -> Any:
        acts, token_ids = original(self, raise_on_epoch_end)
        read.append(acts.detach().clone())
        return acts, token_ids

    cfg = LanguageModelSAERunnerConfig(
        sae=StandardTrainingSAEConfig(d_in=d_model, d_sae=4 * d_model, l1_coefficient=1e-3),
        model_name="tiny-llama", hook_name=HOOK, dataset_path="local", is_dataset_tokenized=True,
        streaming=False, context_size=CONTEXT, prepend_bos=False, use_cached_activations=True,
        cached_activations_path=str(export.path), training_tokens=4096, train_batch_size_tokens=64,
        n_batches_in_buffer=4, store_batch_size_prompts=4, n_batches_for_norm_estimate=2, lr=1e-3,
        device="cpu", seed=0, n_eval_batches=0, logger=LoggingConfig(log_to_wandb=False),
        n_checkpoints=0, checkpoint_path=None, output_path=str(tmp_path / "sae"), verbose=False,
    )  # fmt: skip
    dummy = datasets.Dataset.from_dict({"input_ids": [[5] * CONTEXT] * 8})
    ActivationsStore._load_raw_llm_batch_from_cached = spy  # type: ignore[method-assign]
    try:
        runner = LanguageModelSAETrainingRunner(cfg, override_dataset=dummy, override_model=local)
        before = runner.sae.W_dec.detach().clone()
        sae = runner.run()
    finally:
        ActivationsStore._load_raw_llm_batch_from_cached = original  # type: ignore[method-assign]
    assert not torch.equal(before, sae.W_dec.detach()), "the SAE did not train"
    assert read, "sae-lens read no cached activations"
    # sae-lens reads store_batch_size_prompts contexts at a time, in order, from the start
    # again once fewer remain.
    at, per_read = 0, cfg.store_batch_size_prompts
    for i, batch in enumerate(read):
        at = 0 if at > export.contexts - per_read else at
        want = store.read(HOOK, at * CONTEXT, (at + per_read) * CONTEXT)
        torch.testing.assert_close(batch.float(), want, atol=0, rtol=0, msg=f"read {i}")
        at += per_read
    assert len(read) > export.contexts // per_read, "sae-lens did not read the whole export"
