"""One name, one tensor: names resolve against the booted model, the same way on vllm and hf.

TransformerLens's ``blocks.{i}.hook_attn_out`` is what attention adds to the residual
stream, which on Gemma 2 is the post-attention norm's output (``ln1_post.hook_out``), not
the attention module's (``attn.hook_out``). An edit, a capture and a cache lookup under
that name must reach the same tensor on the vllm driver as on the hf driver.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from _tlv_support import ENGINE_OPTIONS, check, diff, rounding_ratio  # noqa: E402

from tl_core import RemoteBridge, TransformerBridge  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: Within one engine (an edit against the same engine's clean run).
TOL = 1e-4
POST, MODULE = "blocks.0.ln1_post.hook_out", "blocks.0.attn.hook_out"


@pytest.fixture(scope="module")
def gemma2(checkpoint: Any) -> Iterator[tuple[RemoteBridge, TransformerBridge, TransformerBridge]]:
    """vLLM, the hf driver, and the hf driver in float64 (the exact run)."""
    folder = checkpoint("gemma2")
    remote = RemoteBridge.boot_vllm(folder, dtype="float32", **ENGINE_OPTIONS)
    try:
        hf, exact = (
            TransformerBridge.boot_transformers(str(folder), dtype=d)
            for d in (torch.float32, torch.float64)
        )
        yield remote, hf, exact
    finally:
        remote.close()


def test_hook_attn_out_edits_the_post_norm_output_on_both_drivers(
    gemma2: tuple[RemoteBridge, TransformerBridge, TransformerBridge],
) -> None:
    remote, local, exact = gemma2
    prompts = ["a sandwich norm", "keeps the residual small"]
    spec = {"blocks.0.hook_attn_out": {"op": "scale", "factor": 0.25}}
    report: dict[str, float] = {}
    logits: dict[str, torch.Tensor] = {}
    for label, bridge in (("vllm", remote), ("hf", local)):
        assert bridge.namespace.lookup("blocks.0.hook_attn_out") == POST
        with torch.no_grad():
            _, clean = bridge.run_with_cache(prompts, names_filter=[POST, MODULE])
            logits[label], edited = bridge.run_with_cache(
                prompts, names_filter=["blocks.0.hook_attn_out", MODULE], intervene=spec
            )
        # The edit landed on the norm's output; the attention module's output is untouched.
        report[f"{label}: edited post-norm"] = diff(edited[POST], clean[POST] * 0.25)
        report[f"{label}: attention module"] = diff(edited[MODULE], clean[MODULE])
        # The cache answers to the alias with the same tensor.
        assert edited["blocks.0.hook_attn_out"] is edited[POST]
        assert float((clean[POST] - clean[MODULE]).abs().max()) > 1e-3, "the two sites must differ"
    check(report, TOL, "gemma2 blocks.0.hook_attn_out")
    with torch.no_grad():
        truth = exact(prompts, intervene=spec)
    ratios = {
        f"edited logits of prompt {b}, vllm vs hf": rounding_ratio(
            logits["vllm"][b, :n], logits["hf"][b, :n], truth[b, :n]
        )
        for b, n in enumerate(edited.lengths or ())  # padding positions carry no meaning
    }
    check(ratios, 1.0, "gemma2 blocks.0.hook_attn_out, error / allowed against float64")
