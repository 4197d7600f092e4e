"""RemoteBridge over the fake remote driver: replay through hooks, read-only, specs."""

from __future__ import annotations

import importlib.metadata as metadata

import pytest
import torch

from tl_core import (
    HookNameError,
    RemoteBridge,
    RemoteHookMutationError,
    SpecError,
    TransformerBridge,
    UnsupportedFeatureError,
)

try:
    metadata.version("tl-fake-driver")
except metadata.PackageNotFoundError:
    pytest.skip("the fake remote driver is installed by `nox -s tests`", allow_module_level=True)


@pytest.fixture(scope="module")
def remote() -> RemoteBridge:
    return RemoteBridge.boot("llama", driver="fake", n_layers=2, seed=4)


@pytest.fixture(scope="module")
def local() -> TransformerBridge:
    return TransformerBridge.boot_native("llama", n_layers=2, seed=4)


def test_cache_matches_the_local_model(remote: RemoteBridge, local: TransformerBridge) -> None:
    prompts = ["remote capture", "ab"]
    logits, cache = remote.run_with_cache(prompts, names_filter=lambda n: n.endswith("hook_out"))
    local_logits, local_cache = local.run_with_cache(prompts, names_filter=lambda n: n.endswith("hook_out"))
    torch.testing.assert_close(logits, local_logits)
    assert set(cache) == set(local_cache)
    assert cache.lengths == local_cache.lengths


def test_read_only_hooks_fire_on_replay(remote: RemoteBridge) -> None:
    seen: dict[str, tuple[int, ...]] = {}
    def record(x: torch.Tensor, hook: object) -> None:
        seen[hook.name] = tuple(x.shape)  # type: ignore[attr-defined]

    remote.run_with_hooks("replay", fwd_hooks=[("blocks.1.hook_resid_post", record)])
    assert seen == {"blocks.1.hook_out": (1, 7, remote.cfg.d_model)}


def test_a_hook_that_changes_a_value_raises_and_points_to_intervene(remote: RemoteBridge) -> None:
    with pytest.raises(RemoteHookMutationError, match="intervene="):
        remote.run_with_hooks("x", fwd_hooks=[("blocks.0.hook_out", lambda x, hook: x * 2)])
    with pytest.raises(RemoteHookMutationError, match=r"blocks.0.hook_out"):
        remote.run_with_hooks("x", fwd_hooks=[("blocks.0.hook_out", lambda x, hook: x.mul_(0))])
    assert not any(p.has_hooks for p in remote.hook_dict.values())


def test_specs_run_in_the_engine(remote: RemoteBridge, local: TransformerBridge) -> None:
    spec = {"blocks.0.mlp.hook_out": {"op": "scale", "factor": 0.0, "pos": [1, 2]}}
    torch.testing.assert_close(remote("specs", intervene=spec), local("specs", intervene=spec))
    with pytest.raises(SpecError, match=r"declarative specs only|callable"):
        remote("specs", intervene={"blocks.0.hook_out": lambda x, hook: x})


def test_unservable_hooks_and_gradients_are_refused(remote: RemoteBridge) -> None:
    with pytest.raises(HookNameError, match="fused attention"):
        remote.run_with_cache("x", names_filter="blocks.0.attn.hook_pattern")
    with pytest.raises(UnsupportedFeatureError, match="no gradients"):
        remote.run_with_hooks("x", bwd_hooks=[("blocks.0.hook_out", lambda g, hook: None)])


def test_generate_and_loss(remote: RemoteBridge, local: TransformerBridge) -> None:
    steer = {"blocks.0.hook_out": {"op": "add", "value": 1.0}}
    assert torch.equal(
        remote.generate("go", max_new_tokens=4, intervene=steer, return_type="tokens"),
        local.generate("go", max_new_tokens=4, intervene=steer, return_type="tokens", stop_at_eos=True),
    )
    torch.testing.assert_close(remote.loss("loss works"), local.loss("loss works"))


def test_close_releases_the_driver() -> None:
    with RemoteBridge.boot("gpt2", driver="fake", n_layers=1) as bridge:
        driver = bridge.driver
    assert driver.closed


def test_spec_on_an_unfireable_hook_names_it_and_the_reason(remote: RemoteBridge) -> None:
    with pytest.raises(HookNameError, match=r"blocks\.1\.attn\.hook_pattern.*fused attention"):
        remote("x", intervene={"blocks.1.attn.hook_pattern": {"op": "suppress"}})


def test_subcommand_plugins_extend_the_tl_command(capsys: pytest.CaptureFixture[str]) -> None:
    from tl_core.cli import main

    assert main(["fake-hello", "--name", "world"]) == 0
    assert capsys.readouterr().out.strip() == "hello world from the fake driver"
