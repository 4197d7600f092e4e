"""``tl capture`` through a real vLLM engine: the store equals run_with_cache of its contexts,
and the hf driver's activations on the same tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from _tlv_support import ENGINE_OPTIONS, rounding_ratio  # noqa: E402

from tl_core import RemoteBridge, TransformerBridge  # noqa: E402
from tl_core.capture import CaptureConfig, CaptureStore, capture  # noqa: E402

HOOKS = ("blocks.0.hook_resid_post", "blocks.1.hook_resid_post")


@pytest.fixture(scope="module")
def engine(checkpoint: Any) -> Iterator[tuple[Path, RemoteBridge]]:
    folder = checkpoint("llama")
    bridge = RemoteBridge.boot_vllm(folder, dtype="float32", **ENGINE_OPTIONS)
    try:
        yield folder, bridge
    finally:
        bridge.close()


def test_the_store_equals_run_with_cache_on_vllm(
    engine: tuple[Path, RemoteBridge], tmp_path: Path
) -> None:
    folder, bridge = engine
    text = tmp_path / "docs.txt"
    text.write_text(
        "\n".join(f"item {i}: the value is {i * 7} and the next is {i * 7 + 7}" for i in range(40))
        + "\n"
    )
    config = CaptureConfig(
        model=str(folder), driver="vllm", boot_options={"dtype": "float32", **ENGINE_OPTIONS},
        hooks=HOOKS, input=str(text), context_size=48, batch_size=6, shard_contexts=12,
    )  # fmt: skip
    summary = capture(config, tmp_path / "store", progress=False, bridge=bridge)
    assert summary.complete and summary.shards_written >= 2
    store = CaptureStore(tmp_path / "store")
    tokens, contexts = store.read("tokens"), store.read("contexts")
    n_contexts = int(contexts.max()) + 1
    ids = [tokens[contexts == i].tolist() for i in range(n_contexts)]
    local, exact = (
        TransformerBridge.boot_transformers(str(folder), dtype=d)
        for d in (torch.float32, torch.float64)
    )
    for first in range(0, n_contexts, config.batch_size):
        batch = list(range(first, min(first + config.batch_size, n_contexts)))
        _, cache = bridge.run_with_cache(
            [ids[i] for i in batch], names_filter=list(HOOKS), prepend_bos=False
        )
        for b, i in enumerate(batch):
            rows = (contexts == i).nonzero().flatten()
            _, reference = local.run_with_cache(torch.tensor([ids[i]]), names_filter=list(HOOKS))
            _, truth = exact.run_with_cache(torch.tensor([ids[i]]), names_filter=list(HOOKS))
            for hook in HOOKS:
                got = store.read(hook, int(rows[0]), int(rows[-1]) + 1)
                torch.testing.assert_close(got, cache[hook][b, : len(ids[i])], atol=1e-6, rtol=0)
                # The hf driver on the same tokens: the engine serves the same activations.
                assert rounding_ratio(got, reference[hook][0], truth[hook][0], hook) <= 1
