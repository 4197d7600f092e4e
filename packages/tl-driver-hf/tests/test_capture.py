"""``tl capture`` through the hf driver: the store equals run_with_cache of its contexts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tl_core import TransformerBridge
from tl_core.capture import CaptureConfig, CaptureStore, capture

HOOKS = (
    "blocks.0.hook_resid_post",
    "blocks.1.attn.hook_z",
    "blocks.0.mlp.hook_post",
    "ln_final.hook_normalized",
)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_store_equals_run_with_cache_on_hf(
    family: str, checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = checkpoint(family)
    text = tmp_path / "docs.txt"
    text.write_text("\n".join(f"def f{i}(x): return x * {i} + {i * i}" for i in range(30)) + "\n")
    config = CaptureConfig(
        model=str(folder), driver="hf", hooks=HOOKS, input=str(text), context_size=20,
        batch_size=4, shard_contexts=8, pack=False,
    )  # fmt: skip
    summary = capture(config, tmp_path / "store", progress=False)
    assert summary.complete and summary.shards_written >= 2
    store = CaptureStore(tmp_path / "store")
    bridge = TransformerBridge.boot_transformers(str(folder))
    tokens, contexts = store.read("tokens"), store.read("contexts")
    n_contexts = int(contexts.max()) + 1
    assert n_contexts >= 30  # one context per document at least
    rows = [(contexts == i).nonzero().flatten() for i in range(n_contexts)]
    for first in range(0, n_contexts, config.batch_size):
        # The same ragged batch as the capture ran: shards hold whole batches.
        batch = list(range(first, min(first + config.batch_size, n_contexts)))
        ids = [tokens[rows[i]].tolist() for i in batch]
        assert all(row[0] == bridge.tokenizer.bos_token_id for row in ids)
        _, cache = bridge.run_with_cache(ids, names_filter=list(HOOKS), prepend_bos=False)
        for b, i in enumerate(batch):
            for hook in HOOKS:
                got = store.read(hook, int(rows[i][0]), int(rows[i][-1]) + 1)
                want = cache[hook][b, : len(ids[b])]
                torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=f"{hook}, context {i}")
                # Alone (unpadded), the context computes the same up to fp32 reordering.
                if b == len(batch) - 1:
                    _, alone = bridge.run_with_cache(torch.tensor([ids[b]]), names_filter=hook)
                    torch.testing.assert_close(got, alone[hook][0], atol=2e-5, rtol=1e-5)


def test_served_points_are_kept_between_reads_and_follow_every_change(
    bridge_of: Callable[[str], TransformerBridge],
) -> None:
    """The driver's point map is read several times per forward, so it is kept; attaching,
    detaching and re-attaching a dictionary and the per-head switch each give a new one."""
    from tl_core.sae import random_dictionary

    bridge = bridge_of("llama")
    driver = bridge.driver
    assert driver.hook_points is driver.hook_points
    site, hook = (
        "blocks.0.hook_out.hook_sae_acts_post",
        "blocks.0.hook_resid_post",
    )  # canonical, alias
    dictionary = random_dictionary(bridge.cfg.d_model, 8)
    spliced = bridge.add_sae(dictionary, hook_name=hook)
    first = driver.hook_points[site]
    spliced.remove()
    assert site not in driver.hook_points
    spliced = bridge.add_sae(dictionary, hook_name=hook)
    assert site in driver.hook_points and driver.hook_points[site] is not first
    spliced.remove()
    split = "blocks.0.attn.hook_q_input"
    assert split not in driver.hook_points
    bridge.set_use_split_qkv_input(True)
    try:
        assert split in driver.hook_points
    finally:
        bridge.set_use_split_qkv_input(False)
    assert split not in driver.hook_points
