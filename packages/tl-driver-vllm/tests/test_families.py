"""The vllm driver's rows: module paths only, each against its tl-core description, and the
hf driver needed only for vLLM's Transformers backend (the ``transformers-backend`` extra)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

from tl_core import ConfigError
from tl_core.architecture import family_named
from tl_driver_vllm._driver_side._derive import TRANSFORMERS_BACKEND_INSTALL, serving_layout
from tl_driver_vllm._families import FAMILY_LAYOUTS, disagreements, family_for

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


@pytest.mark.parametrize("architecture", sorted(FAMILY_LAYOUTS))
def test_every_row_names_a_description_its_paths_agree_with(architecture: str) -> None:
    layout, description = family_for(architecture)
    assert architecture in description.architectures
    assert disagreements(layout, description) == []


def test_a_row_that_contradicts_its_description_is_named() -> None:
    layout, gemma2 = family_for("Gemma2ForCausalLM")
    assert disagreements(dataclasses.replace(layout, ln2_post=None), gemma2) == [
        "ln2_post=None but the description says there is one"
    ]
    llama = family_named("llama")
    problems = disagreements(dataclasses.replace(layout, q_norm="q_norm", k_norm="k_norm"), llama)
    assert any(p.startswith("ln1_post='post_attention_layernorm'") for p in problems)
    assert "q_norm='q_norm' but the description says there is none" in problems
    assert disagreements(FAMILY_LAYOUTS["MixtralForCausalLM"], llama) == [
        "router='gate' but the description says there is none",
        "gate_up=None but the description says there is one",
    ]


def test_the_hf_driver_is_an_extra_for_the_transformers_backend_only() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert not any(r.startswith("tl-driver-hf") for r in project["dependencies"])
    extra = project["optional-dependencies"]["transformers-backend"]
    assert any(r.startswith("tl-driver-hf") for r in extra)
    assert "tl-driver-vllm[transformers-backend]" in TRANSFORMERS_BACKEND_INSTALL


def test_without_the_hf_driver_rows_serve_and_the_backend_is_refused_with_the_install_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.setitem(sys.modules, "tl_driver_hf", None)  # `import tl_driver_hf` fails
    llama = transformers.AutoConfig.for_model("llama")
    llama.architectures = ["LlamaForCausalLM"]
    row = serving_layout(llama)
    assert not row.derived and row.family.family == "llama"
    neox = transformers.AutoConfig.for_model("gpt_neox")
    neox.architectures = ["GPTNeoXForCausalLM"]
    with pytest.raises(ConfigError) as refused:
        serving_layout(neox, "transformers")
    assert "needs tl-driver-hf" in str(refused.value)
    assert str(refused.value).endswith(TRANSFORMERS_BACKEND_INSTALL)


def _config(model_type: str, architecture: str) -> Any:
    testing = pytest.importorskip("tl_driver_hf.testing")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(model_type)
    for key, value in testing.VLLM_TINY_SIZES.items():
        if hasattr(config, key):
            setattr(config, key, value)
    config.architectures = [architecture]
    return config


@pytest.mark.parametrize("architecture", sorted(FAMILY_LAYOUTS))
def test_a_row_withholds_what_the_hf_driver_does_not_certify(architecture: str) -> None:
    """A name means the same tensor on both drivers or is served by neither: a row of a
    family the hf driver serves by inference withholds what that inference leaves
    uncertified (among the sites the vllm driver places; it never serves split inputs)."""
    hf = pytest.importorskip("tl_driver_hf")
    from tl_driver_hf.adapters import find_adapter
    from tl_driver_vllm._driver_side._derive import _withheld

    layout, description = family_for(architecture)
    if find_adapter(None, [architecture]) is not None:
        assert dict(layout.withheld) == {}
        return
    config = _config(description.model_types[0], architecture)
    theirs = _withheld(hf.describe_architecture(config))
    placed = {t: why for t, why in theirs.items() if not t.endswith("_input")}
    assert set(layout.withheld) == set(placed), architecture
