"""``RemoteBridge.boot_inspect``: the ``inspect`` driver over the providers' tl drivers.

The driver must serve what the provider's engine serves, name for name and value for
value: every hook it claims is compared with the hf driver booted on the same tiny
checkpoint (a ragged batch, with and without specs, tolerance 1e-5), and the contract
checks of tl-core (``check_driver``) run on it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("INSPECT_EVAL_CTL_SERVER", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("inspect_ai")
testing = pytest.importorskip("tl_driver_hf.testing")

from tl_core import (  # noqa: E402
    ConfigError,
    RemoteBridge,
    RemoteHookMutationError,
    TransformerBridge,
    UnsupportedFeatureError,
    UserError,
    boot,
)
from tl_core.driver_api import check_driver, validate_driver  # noqa: E402

TOL = 1e-5
LENGTHS = (7, 12, 3)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return testing.write_tiny_checkpoint("llama", tmp_path_factory.mktemp("inspect-llama") / "m")


@pytest.fixture(scope="module")
def bridges(folder: Path) -> Iterator[tuple[RemoteBridge, TransformerBridge]]:
    remote = RemoteBridge.boot_inspect(folder)
    local = TransformerBridge.boot_transformers(str(folder))
    try:
        yield remote, local
    finally:
        remote.close()


def _rows(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


def _compare(got: Any, want: Any, label: str, namespace: Any) -> None:
    assert got.lengths == want.lengths, label
    worst: list[tuple[float, str]] = []
    for name, tensor in want.captured.items():
        other = got.captured[name]
        assert other.shape == tensor.shape, (
            f"{label}: {name} shape {tuple(other.shape)} != {tuple(tensor.shape)}"
        )
        layout = namespace.layout(name)
        for b, n in enumerate(want.lengths):  # padding carries no meaning
            a, r = other[b].float(), tensor[b].float()
            if layout == "b h q k":
                a, r = a[:, :n, :n], r[:, :n, :n]
            elif layout.split()[1:2] == ["p"]:
                a, r = a[:n], r[:n]
            gap = torch.where(a == r, torch.zeros_like(a), (a - r).abs())  # equal -inf masks
            worst.append((float(gap.max()), f"{name}[{b}]"))
    bad = [(d, n) for d, n in worst if not d <= TOL]
    assert not bad, (
        f"{label}: hooks differ from the hf driver beyond {TOL}: {sorted(bad, reverse=True)[:5]}"
    )
    assert len(worst) == len(want.captured) * len(want.lengths)
    for b, n in enumerate(want.lengths):
        assert torch.allclose(got.logits[b, :n], want.logits[b, :n], atol=TOL, rtol=0), (
            f"{label}: logits[{b}]"
        )


def test_the_driver_keeps_the_contract(bridges: Any) -> None:
    remote, _ = bridges
    driver = remote.driver
    validate_driver(driver, name="inspect")
    check_driver(driver)
    assert driver.name == "inspect" and remote.kind == "remote"
    assert driver.provider == "tl_bridge"
    assert driver.namespace.driver == "inspect"


def test_remote_features_mirror_the_vllm_driver(bridges: Any) -> None:
    driver = bridges[0].driver
    have = {f for f in ("generation", "batching", "position_interventions") if driver.supports(f)}
    assert have == {"generation", "batching", "position_interventions"}
    for feature in (
        "gradients",
        "parameters",
        "state_dict",
        "weight_access",
        "intervention_callbacks",
    ):
        assert driver.supports(feature) is False, feature


def test_every_served_hook_equals_the_hf_driver_ragged(bridges: Any) -> None:
    remote, local = bridges
    driver = remote.driver
    served = list(driver.namespace.ordered)
    assert set(served) <= set(local.driver.namespace.served)
    assert {"embed.hook_out", "blocks.1.hook_out", "blocks.0.attn.hook_pattern"} <= set(served)
    rows = _rows(driver.info.d_vocab)
    got = driver.forward(rows, capture=served, max_new_tokens=0)
    want = local.driver.forward(rows, capture=served, max_new_tokens=0)
    _compare(got, want, "no spec", driver.namespace)


def test_every_served_hook_equals_the_hf_driver_with_specs(bridges: Any) -> None:
    remote, local = bridges
    driver = remote.driver
    d = driver.info.d_model
    served = list(driver.namespace.ordered)
    steer = torch.linspace(-1, 1, d).tolist()
    specs = {
        "blocks.0.hook_resid_post": {"op": "add", "value": steer},  # an alias
        "blocks.1.attn.hook_z": [{"op": "scale", "factor": 0.5, "pos": [0, 1]}],
        "blocks.1.mlp.hook_out": {"op": "suppress", "pos": 2},
    }
    rows = _rows(driver.info.d_vocab)
    got = driver.forward(rows, capture=served, intervene=specs, max_new_tokens=0)
    want = local.driver.forward(rows, capture=served, intervene=specs, max_new_tokens=0)
    _compare(got, want, "with specs", driver.namespace)
    plain = driver.forward(rows, capture=["blocks.1.hook_out"], max_new_tokens=0)
    assert not torch.allclose(
        plain.captured["blocks.1.hook_out"], got.captured["blocks.1.hook_out"]
    )
    per_prompt = [specs, None, {"blocks.1.hook_out": {"op": "scale", "factor": 2.0}}]
    got = driver.forward(rows, capture=served, intervene=per_prompt, max_new_tokens=0)
    want = local.driver.forward(rows, capture=served, intervene=per_prompt, max_new_tokens=0)
    _compare(got, want, "per-prompt specs", driver.namespace)


def test_run_with_cache_and_generate_match_the_hf_bridge(bridges: Any) -> None:
    remote, local = bridges
    prompts = ["The capital of France is", "Hi"]
    spec = {"blocks.0.mlp.hook_out": {"op": "scale", "factor": 0.0}}
    for intervene in (None, spec):
        logits, cache = remote.run_with_cache(
            prompts, names_filter=lambda n: n.endswith("hook_out"), intervene=intervene
        )
        ref_logits, ref_cache = local.run_with_cache(
            prompts, names_filter=lambda n: n.endswith("hook_out"), intervene=intervene
        )
        assert cache.lengths == ref_cache.lengths
        assert sorted(cache.keys()) == sorted(ref_cache.keys())
        for name in sorted(ref_cache.keys()):
            assert torch.allclose(cache[name], ref_cache[name], atol=TOL), name
        assert torch.allclose(logits, ref_logits, atol=TOL)
    out = remote.generate(
        "The capital of France is", max_new_tokens=4, do_sample=False, intervene=spec
    )
    ref = local.generate(
        "The capital of France is", max_new_tokens=4, do_sample=False, intervene=spec
    )
    assert out == ref


def test_remote_refusals(bridges: Any) -> None:
    remote, _ = bridges
    driver = remote.driver
    rows = _rows(driver.info.d_vocab)

    def double(x: Any, hook: Any) -> Any:
        return x * 2

    with pytest.raises(UserError, match=r"callable|Python"):
        driver.forward(rows, intervene={"blocks.0.hook_out": double}, max_new_tokens=0)
    with pytest.raises(UserError, match=r"unknown forward options.*start_at_layer"):
        driver.forward(rows, start_at_layer=1, max_new_tokens=0)
    with pytest.raises(RemoteHookMutationError, match="intervene="):
        remote.run_with_hooks("Hello", fwd_hooks=[("blocks.0.hook_out", double)])
    with pytest.raises(UnsupportedFeatureError):
        remote("Hello", start_at_layer=1, residual=torch.zeros(1, 2, driver.info.d_model))
    seen: list[tuple[int, ...]] = []
    remote.run_with_hooks(
        "Hello", fwd_hooks=[("blocks.0.hook_out", lambda x, hook: seen.append(tuple(x.shape)))]
    )
    assert seen and seen[0][-1] == driver.info.d_model


def test_unknown_provider_lists_the_known_ones(folder: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        RemoteBridge.boot_inspect(folder, provider="tl_brige")
    message = str(caught.value)
    assert (
        "'tl_bridge'" in message
        and "'tl_bridge_vllm'" in message
        and "Did you mean 'tl_bridge'" in message
    )
    with pytest.raises(ConfigError, match="tl_bridge_vllm"):
        boot(folder, driver="inspect", provider="hf")


def test_boot_through_discovery_and_close_twice(folder: Path) -> None:
    bridge = boot(folder, driver="inspect")
    assert isinstance(bridge, RemoteBridge)
    assert bridge.cfg.n_layers == 2
    bridge.close()
    bridge.close()
    with pytest.raises(UserError, match="closed"):
        bridge.driver.forward([[1, 2, 3]], max_new_tokens=0)


def test_boot_from_a_built_inspect_model_shares_its_engine(bridges: Any) -> None:
    model = bridges[0].driver.inspect_model  # an inspect Model, as evals take it
    bridge = RemoteBridge.boot_inspect(model)
    assert bridge.driver.inner is _provider_driver(model)
    assert bridge.driver.provider == "tl_bridge"
    bridge.close()  # not ours: the model's engine stays up
    assert _provider_driver(model).forward([[1, 2, 3]], max_new_tokens=0).lengths == (3,)
    with pytest.raises(UserError, match="get_model"):
        RemoteBridge.boot_inspect(model, dtype="float32")


def test_absolute_paths_take_the_double_slash(folder: Path) -> None:
    assert os.path.isabs(folder)
    bridge = RemoteBridge.boot_inspect(str(folder))
    try:
        assert str(bridge.driver.inspect_model) == f"tl_bridge/{folder}"
        assert f"tl_bridge//{str(folder).lstrip('/')}" == str(bridge.driver.inspect_model)
    finally:
        bridge.close()


def _provider_driver(model: Any) -> Any:
    api = model.api
    bridge = getattr(api, "bridge", None)
    return bridge.driver if bridge is not None else api.driver
