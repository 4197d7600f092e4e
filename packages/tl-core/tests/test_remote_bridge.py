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
    UserError,
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
    local_logits, local_cache = local.run_with_cache(
        prompts, names_filter=lambda n: n.endswith("hook_out")
    )
    torch.testing.assert_close(logits, local_logits)
    assert set(cache) == set(local_cache) & remote.namespace.served
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
    plain, edited = remote("specs"), remote("specs", intervene=spec)
    torch.testing.assert_close(edited, local("specs", intervene=spec))
    # The edit reached the engine: positions 1 and 2 moved, position 0 did not.
    assert (edited[0, 1:3] - plain[0, 1:3]).abs().max() > 1e-3
    torch.testing.assert_close(edited[0, 0], plain[0, 0])
    _, cache = remote.run_with_cache("specs", intervene=spec, names_filter="blocks.0.hook_mlp_out")
    assert torch.equal(
        cache["blocks.0.mlp.hook_out"][0, 1:3],
        torch.zeros_like(cache["blocks.0.mlp.hook_out"][0, 1:3]),
    )
    with pytest.raises(SpecError, match=r"declarative specs only|callable"):
        remote("specs", intervene={"blocks.0.hook_out": lambda x, hook: x})


def test_unservable_hooks_and_gradients_are_refused(remote: RemoteBridge) -> None:
    with pytest.raises(HookNameError, match="fused attention"):
        remote.run_with_cache("x", names_filter="blocks.0.attn.hook_pattern")
    with pytest.raises(UnsupportedFeatureError, match="no gradients"):
        remote.run_with_hooks("x", bwd_hooks=[("blocks.0.hook_out", lambda g, hook: None)])


def test_generate_and_loss(remote: RemoteBridge, local: TransformerBridge) -> None:
    # A steering vector strong enough to take over the random model's next tokens.
    steer = {"blocks.1.hook_out": {"op": "add", "value": (local.W_U[:, 65] * 40).tolist()}}
    steered = remote.generate("go", max_new_tokens=4, intervene=steer, return_type="tokens")
    assert torch.equal(
        steered, local.generate("go", max_new_tokens=4, intervene=steer, return_type="tokens")
    )
    assert not torch.equal(steered, remote.generate("go", max_new_tokens=4, return_type="tokens"))
    assert steered[0].tolist() == [65, 65, 65, 65]
    # The same keywords as the local bridge: sampling is seeded, and specs steer a loss.
    sampled = [
        remote.generate("go", 5, do_sample=True, temperature=2.0, seed=s, return_type="tokens")
        for s in (1, 1, 2)
    ]
    assert torch.equal(sampled[0], sampled[1]) and torch.equal(
        sampled[0],
        local.generate("go", 5, do_sample=True, temperature=2.0, seed=1, return_type="tokens"),
    )
    torch.testing.assert_close(remote.loss("loss works"), local.loss("loss works"))
    torch.testing.assert_close(
        remote.loss("loss works", intervene=steer, prepend_bos=False),
        local.loss("loss works", intervene=steer, prepend_bos=False),
    )
    assert abs(float(remote.loss("loss works", intervene=steer) - remote.loss("loss works"))) > 1e-2


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


def test_both_bridges_share_one_surface() -> None:
    for method in ("forward", "loss", "run_with_cache", "generate", "run_with_hooks", "to_tokens"):
        assert getattr(RemoteBridge, method) is getattr(TransformerBridge, method), method


def test_stop_at_layer_returns_the_residual_and_caches_only_what_ran(
    remote: RemoteBridge, local: TransformerBridge
) -> None:
    for stop in (1, -1, 2):
        torch.testing.assert_close(
            remote("stop", stop_at_layer=stop), local("stop", stop_at_layer=stop)
        )
    resid, cache = remote.run_with_cache("stop", stop_at_layer=1)
    _, local_cache = local.run_with_cache("stop", stop_at_layer=1)
    assert set(cache) == set(local_cache) & remote.namespace.served
    assert "blocks.0.hook_out" in cache and not any(
        n.startswith(("blocks.1.", "ln_final")) for n in cache
    )
    torch.testing.assert_close(resid, cache["blocks.0.hook_out"])
    # Hooks after the stop do not fire, as on a local driver.
    seen: list[str] = []
    remote.run_with_hooks(
        "stop",
        fwd_hooks=[(lambda n: n.endswith("hook_out"), lambda x, hook: seen.append(hook.name))],
        stop_at_layer=1,
    )
    assert seen and all(not n.startswith(("blocks.1.", "unembed")) for n in seen)


def test_what_an_engine_cannot_do_is_refused_before_it_runs(remote: RemoteBridge) -> None:
    with pytest.raises(UnsupportedFeatureError, match="residual stream"):
        remote(None, start_at_layer=1, residual=torch.zeros(1, 3, remote.cfg.d_model))
    with pytest.raises(UnsupportedFeatureError, match="no gradients"):
        remote.run_with_cache("x", incl_bwd=True)
    assert remote.cfg.device == torch.device("cpu") and remote.device.type == "cpu"
    assert remote.to_tokens("abc", move_to_device=False, truncate=True).shape == (1, 4)


def test_booting_with_the_wrong_bridge_starts_nothing() -> None:
    with pytest.raises(UserError, match=r"driver 'fake' is a remote driver.*RemoteBridge\.boot"):
        TransformerBridge.boot("llama", driver="fake")
    with pytest.raises(
        UserError, match=r"driver 'native' is a local driver.*TransformerBridge\.boot"
    ):
        RemoteBridge.boot("llama", driver="native")
