"""``load_dictionary`` reads a folder exactly when sae-lens's ``SAE.load_from_disk`` does, and
then reconstructs what sae-lens's ``SAE.forward`` returns: folders saved by sae-lens, then
edited as the issue's probe edited them (the architecture key removed, with or without the
version that marks a sae-lens 6 config; an older config's ``activation_fn``; sizes that the
weights contradict). Where sae-lens refuses a folder, tl refuses it with a tl error naming
the file; architectures sae-lens runs and tl does not are named as unsupported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

sae_lens = pytest.importorskip("sae_lens")

from sae_lens import SAE  # noqa: E402
from sae_lens.saes import transcoder as tc  # noqa: E402

from tl_core import TLError, UnsupportedFeatureError  # noqa: E402
from tl_core.sae import from_sae_lens, load_dictionary  # noqa: E402

D_IN = 16


def _module(kind: str) -> Any:
    classes: dict[str, tuple[Any, Any, dict[str, Any]]] = {
        "standard": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig, {}),
        "jumprelu": (sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig, {}),
        "topk": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig, {"k": 5}),
        "transcoder": (tc.Transcoder, tc.TranscoderConfig, {"d_out": 12}),
        "jumprelu_skip_transcoder": (
            tc.JumpReLUSkipTranscoder,
            tc.JumpReLUSkipTranscoderConfig,
            {"d_out": D_IN},
        ),
    }
    cls, cfg_cls, extra = classes[kind]
    if "d_out" in extra:
        extra = {**extra, "apply_b_dec_to_input": False}
    module = cls(cfg_cls(d_in=D_IN, d_sae=3 * D_IN, **extra))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return module


def _edit(cfg: dict[str, Any], how: str) -> dict[str, Any]:
    cfg = json.loads(json.dumps(cfg))
    if how == "no architecture":
        del cfg["architecture"]
    elif how == "no architecture, no version":
        del cfg["architecture"]
        cfg["metadata"].pop("sae_lens_version", None)
        cfg["metadata"].pop("sae_lens_training_version", None)
    elif how == "older topk":
        k = cfg.pop("k", 5)
        del cfg["architecture"]
        cfg["metadata"].pop("sae_lens_version", None)
        cfg["metadata"].pop("sae_lens_training_version", None)
        cfg.update(activation_fn="topk", activation_fn_kwargs={"k": k})
    elif how in ("d_in", "d_sae"):
        cfg[how] += 1
    return cfg


KINDS = ["standard", "jumprelu", "topk", "transcoder", "jumprelu_skip_transcoder"]
EDITS = ["none", "no architecture", "no architecture, no version", "older topk", "d_in", "d_sae"]


@pytest.mark.parametrize("how", EDITS)
@pytest.mark.parametrize("kind", KINDS)
def test_tl_reads_a_folder_when_sae_lens_does_and_as_it_does(
    tmp_path: Path, kind: str, how: str
) -> None:
    module = _module(kind)
    module.save_model(tmp_path)
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    (tmp_path / "cfg.json").write_text(json.dumps(_edit(cfg, how)))
    try:
        reference = SAE.load_from_disk(tmp_path)
    except Exception:  # any refusal by sae-lens is what is compared
        reference = None
    if reference is None:
        with pytest.raises(TLError) as refused:
            load_dictionary(tmp_path)
        assert str(tmp_path / "cfg.json") in str(refused.value) or str(
            tmp_path / "sae_weights.safetensors"
        ) in str(refused.value)
        return
    loaded = load_dictionary(tmp_path)
    x = torch.randn(4, 3, D_IN, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = reference(x)
    torch.testing.assert_close(loaded.reconstruct(x), want, rtol=1e-5, atol=1e-5)


def test_the_issues_jumprelu_folder_is_refused_by_both(tmp_path: Path) -> None:
    """A JumpReLU folder whose cfg.json lacks ``architecture``: tl once read it as a ReLU SAE
    and ignored its threshold."""
    _module("jumprelu").save_model(tmp_path)
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    for how in ("no architecture", "no architecture, no version"):
        (tmp_path / "cfg.json").write_text(json.dumps(_edit(cfg, how)))
        with pytest.raises(Exception):  # noqa: B017 - sae-lens's own refusal
            SAE.load_from_disk(tmp_path)
        with pytest.raises(
            TLError, match=r"names no architecture|holds threshold, which it does not use"
        ):
            load_dictionary(tmp_path)


def test_an_architecture_sae_lens_runs_and_tl_does_not_is_named(tmp_path: Path) -> None:
    from sae_lens.saes.gated_sae import GatedSAE, GatedSAEConfig

    GatedSAE(GatedSAEConfig(d_in=D_IN, d_sae=3 * D_IN)).save_model(tmp_path)
    assert SAE.load_from_disk(tmp_path) is not None
    with pytest.raises(
        UnsupportedFeatureError, match=r"architecture 'gated' is not supported by tl"
    ):
        load_dictionary(tmp_path)
    with pytest.raises(UnsupportedFeatureError, match=r"GatedSAE: architecture 'gated'"):
        from_sae_lens(SAE.load_from_disk(tmp_path))
