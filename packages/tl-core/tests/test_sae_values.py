"""What a ``SparseDictionary`` accepts: floating-point torch tensors of one dtype with finite
values, settings that fit its architecture, known keywords. Anything else is a tl error
naming the tensor or keyword, raised when the dictionary is built (or attached), never
inside torch at the first forward.

The property suite builds dictionaries of random architectures, widths and dtypes, with
NaN or infinite values placed anywhere: each is refused naming the tensor and index, or
reconstructs what sae-lens's inference math (written out here by hand, in float64) gives.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from tl_core import ConfigError, TransformerBridge, UnsupportedFeatureError, UserError
from tl_core.sae import ARCHITECTURES, SparseDictionary, random_dictionary


def _tensors(d: SparseDictionary) -> dict[str, torch.Tensor]:
    out = {"W_enc": d.W_enc, "b_enc": d.b_enc, "W_dec": d.W_dec, "b_dec": d.b_dec}
    if d.threshold is not None:
        out["threshold"] = d.threshold
    return out


def test_nan_and_infinite_weights_are_refused_naming_the_tensor_and_where() -> None:
    base = _tensors(random_dictionary(8, 16))
    W_enc = base["W_enc"].clone()
    W_enc[2, 5] = float("nan")
    with pytest.raises(
        ConfigError,
        match=re.escape("W_enc holds NaN at 1 of 128 entries (the first at index (2, 5))"),
    ):
        SparseDictionary(**{**base, "W_enc": W_enc})
    b_dec = base["b_dec"].clone()
    b_dec[3] = float("-inf")
    with pytest.raises(
        ConfigError,
        match=r"b_dec holds inf at 1 of 8 entries \(the first at index 3\).*NaN outputs",
    ):
        SparseDictionary(**{**base, "b_dec": b_dec})
    # A conversion that overflows is refused the same way, saying which conversion.
    big = random_dictionary(8, 16, scale=1e6)
    with pytest.raises(
        ConfigError, match=r"converting the dictionary to torch.float16: .*W_enc holds inf"
    ):
        big.to(dtype=torch.float16)


def test_a_nan_dictionary_never_reaches_a_model() -> None:
    bridge = TransformerBridge.boot_native("llama", n_layers=1, seed=0)
    d = random_dictionary(bridge.cfg.d_model, 32, architecture="jumprelu")
    threshold = d.threshold.clone()  # type: ignore[union-attr]
    threshold[7] = float("nan")
    with pytest.raises(
        ConfigError, match=r"threshold holds NaN at 1 of 32 entries \(the first at index 7\)"
    ):
        bridge.add_sae(SparseDictionary(**{**_tensors(d), "threshold": threshold, "architecture": "jumprelu"}),
                       hook_name="blocks.0.hook_out")  # fmt: skip
    assert not bridge.namespace.dictionaries


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.uint8])
def test_integer_weights_are_refused(dtype: torch.dtype) -> None:
    base = _tensors(random_dictionary(8, 16, scale=3.0))
    with pytest.raises(
        ConfigError, match=rf"W_dec has dtype {dtype}, not a floating-point one.*W_dec\.float\(\)"
    ):
        SparseDictionary(**{**base, "W_dec": base["W_dec"].to(dtype)})
    with pytest.raises(
        ConfigError,
        match=r"W_enc has dtype .*; b_enc has dtype .*; W_dec has dtype .*; b_dec has dtype",
    ):
        SparseDictionary(**{k: v.to(dtype) for k, v in base.items()})


def test_mixed_dtypes_are_refused_when_built_not_at_the_first_forward() -> None:
    base = _tensors(random_dictionary(8, 16))
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "different dtypes (W_enc float32, b_enc float32, W_dec float16, b_dec float32)"
        ),
    ):
        SparseDictionary(**{**base, "W_dec": base["W_dec"].half()})
    jump = _tensors(random_dictionary(8, 16, architecture="jumprelu"))
    with pytest.raises(ConfigError, match=r"threshold float64"):
        SparseDictionary(
            **{**jump, "threshold": jump["threshold"].double()}, architecture="jumprelu"
        )


def test_numpy_weights_are_refused_saying_what_is_accepted() -> None:
    base = _tensors(random_dictionary(8, 16))
    with pytest.raises(
        ConfigError, match=r"W_enc is a numpy\.ndarray, not a torch\.Tensor.*torch\.as_tensor"
    ):
        SparseDictionary(**{**base, "W_enc": base["W_enc"].numpy()})
    with pytest.raises(ConfigError, match=r"b_dec is a builtins\.list"):
        SparseDictionary(**{**base, "b_dec": [0.0] * 8})
    # Converted as the message says, the same values build the same dictionary.
    converted = {k: torch.as_tensor(np.asarray(v)) for k, v in base.items()}
    x = torch.randn(3, 8)
    torch.testing.assert_close(
        SparseDictionary(**converted).reconstruct(x), SparseDictionary(**base).reconstruct(x)
    )


def test_misspelled_keywords_name_the_nearest_one() -> None:
    base = _tensors(random_dictionary(8, 16))
    with pytest.raises(
        ConfigError, match=r"unknown keywords 'architcture' \(did you mean 'architecture'\?\)"
    ):
        SparseDictionary(**base, architcture="topk")
    with pytest.raises(ConfigError, match=r"'hook_nmae' \(did you mean 'hook_name'\?\)"):
        random_dictionary(8, 16, hook_nmae="blocks.0.hook_out")
    bridge = TransformerBridge.boot_native("llama", n_layers=1, seed=0)
    d = random_dictionary(bridge.cfg.d_model, 16)
    with pytest.raises(
        ConfigError, match=r"'use_eror_term' \(did you mean 'use_error_term'\?\).*top_k"
    ):
        bridge.add_sae(d, hook_name="blocks.0.hook_out", use_eror_term=True)
    with pytest.raises(ConfigError, match=r"add_sae takes a SparseDictionary, got dict"):
        bridge.add_sae(base, hook_name="blocks.0.hook_out")  # type: ignore[arg-type]
    assert not bridge.namespace.dictionaries


@pytest.mark.parametrize(
    ("settings_", "message"),
    [
        ({"k": 4}, r"k=4 is given but the architecture is 'standard'"),
        ({"architecture": "jumprelu", "k": 4}, r"k=4 is given but the architecture is 'jumprelu'"),
        (
            {"threshold": torch.zeros(16)},
            r"a threshold is given but the architecture is 'standard'",
        ),
        ({"architecture": "topk", "k": 4, "threshold": torch.zeros(16)}, r"architecture is 'topk'"),
        ({"rescale_acts_by_decoder_norm": True}, r"rescale_acts_by_decoder_norm applies to topk"),
        ({"hook_head_index": -1}, r"hook_head_index must be None or a head index"),
    ],
)
def test_settings_that_do_not_fit_the_architecture_are_refused(
    settings_: dict[str, Any], message: str
) -> None:
    base = {k: v for k, v in _tensors(random_dictionary(8, 16)).items()}
    with pytest.raises(ConfigError, match=message):
        SparseDictionary(**{**base, **settings_})


def test_per_head_inputs_refuse_to_strand_a_dictionary_on_ln1() -> None:
    bridge = TransformerBridge.boot_native("llama", n_layers=2, seed=0)
    ids = torch.randint(0, bridge.cfg.d_vocab, (1, 5), generator=torch.Generator().manual_seed(0))
    spliced = bridge.add_sae(
        random_dictionary(bridge.cfg.d_model, 16), hook_name="blocks.1.ln1.hook_out"
    )
    with pytest.raises(
        UserError,
        match=r"per-head q/k/v inputs cannot be turned on while a dictionary is attached at "
        r"'blocks.1.ln1.hook_out'.*would not reach attention; remove the dictionary first",
    ):
        bridge.set_use_split_qkv_input(True)
    # Refused before anything changed: the model still runs with its dictionary.
    assert not bridge.driver.split_qkv_input
    with_sae = bridge(ids)
    spliced.remove()
    with bridge.hooks(
        [("blocks.1.ln1.hook_out", lambda x, *, hook: spliced.dictionary.reconstruct(x))]
    ):
        torch.testing.assert_close(with_sae, bridge(ids))
    bridge.set_use_split_qkv_input(True)
    bridge(ids)
    bridge.set_use_split_qkv_input(False)


def test_a_single_head_dictionary_loads_but_is_not_spliced() -> None:
    bridge = TransformerBridge.boot_native("llama", n_layers=1, seed=0)
    d = random_dictionary(
        bridge.cfg.d_head, 16, hook_name="blocks.0.attn.hook_z", hook_head_index=2
    )
    assert "hook_head_index=2" in repr(d)
    with pytest.raises(
        UnsupportedFeatureError,
        match=r"trained on head 2 of 'blocks.0.attn.hook_z' alone \(sae-lens's hook_head_index=2\)",
    ):
        bridge.add_sae(d)


def _reference(d: SparseDictionary, x: torch.Tensor) -> torch.Tensor:
    """sae-lens's inference forward, written out in float64 from the dictionary's tensors."""
    t = {k: v.double() for k, v in _tensors(d).items()}
    x = x.double()
    h, undo = x, None
    if d.normalize_activations == "constant_norm_rescale":
        coeff = d.d_in**0.5 / x.norm(dim=-1, keepdim=True)
        h, undo = x * coeff, ("scale", coeff)
    elif d.normalize_activations == "layer_norm":
        mu = x.mean(-1, keepdim=True)
        std = (x - mu).std(-1, keepdim=True)
        h, undo = (x - mu) / (std + 1e-5), ("ln", std, mu)
    if d.apply_b_dec_to_input:
        h = h - t["b_dec"]
    pre = h @ t["W_enc"] + t["b_enc"]
    norms = t["W_dec"].norm(dim=-1)
    if d.architecture == "jumprelu":
        acts = pre.relu() * (pre > t["threshold"])
    elif d.architecture == "topk":
        scaled = pre * norms if d.rescale_acts_by_decoder_norm else pre
        values, index = scaled.topk(int(d.k or 0), dim=-1)
        acts = torch.zeros_like(pre).scatter(-1, index, values.relu())
        acts = acts / norms if d.rescale_acts_by_decoder_norm else acts
    else:
        acts = pre.relu()
    out = acts @ t["W_dec"] + t["b_dec"]
    if undo is not None and undo[0] == "scale":
        out = out / undo[1]
    elif undo is not None:
        out = out * undo[1] + undo[2]
    if d.W_skip is not None:
        out = out + x @ d.W_skip.double().T
    return out


_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 1e-1}


@st.composite
def _dictionary_cases(draw: st.DrawFn) -> dict[str, Any]:
    architecture = draw(st.sampled_from(ARCHITECTURES))
    d_in, d_sae = draw(st.integers(1, 12)), draw(st.integers(1, 40))
    transcoder = draw(st.booleans())
    d_out = draw(st.integers(1, 12)) if transcoder else d_in
    options: dict[str, Any] = {"architecture": architecture}
    if architecture == "topk":
        options["k"] = draw(st.integers(1, d_sae))
        options["rescale_acts_by_decoder_norm"] = draw(st.booleans())
    if transcoder:
        options["apply_b_dec_to_input"] = False
    else:
        options["apply_b_dec_to_input"] = draw(st.booleans())
        norms = ["none", "constant_norm_rescale", "layer_norm"][: 3 if d_in > 1 else 2]
        options["normalize_activations"] = draw(st.sampled_from(norms))
    return {
        "d_in": d_in, "d_sae": d_sae, "d_out": d_out, "options": options,
        "skip": transcoder and draw(st.booleans()), "seed": draw(st.integers(0, 2**16)),
        "dtype": draw(st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16])),
        "poison": draw(st.sampled_from([None, "nan", "inf", "-inf"])),
        "where": draw(st.sampled_from(["W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip"])),
        "index": draw(st.integers(0, 10_000)),
    }  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(case=_dictionary_cases())
def test_any_dictionary_is_refused_by_name_or_reconstructs_as_sae_lens(
    case: dict[str, Any],
) -> None:
    clean = random_dictionary(
        case["d_in"], case["d_sae"], d_out=case["d_out"], seed=case["seed"], skip=case["skip"],
        **case["options"],
    ).to(dtype=case["dtype"])  # fmt: skip
    tensors = {**_tensors(clean), **({"W_skip": clean.W_skip} if clean.W_skip is not None else {})}
    settings_ = {k: v for k, v in case["options"].items()}
    target = case["where"]
    if case["poison"] is not None and target in tensors:
        poisoned = tensors[target].clone()
        flat = poisoned.view(-1)
        at = case["index"] % flat.numel()
        flat[at] = float(case["poison"])
        with pytest.raises(
            ConfigError, match=rf"{target} holds (NaN|inf) at 1 of {flat.numel()} entries"
        ):
            SparseDictionary(**{**tensors, target: poisoned}, **settings_)
        return
    d = SparseDictionary(**tensors, **settings_)
    x = torch.randn(5, case["d_in"], generator=torch.Generator().manual_seed(case["seed"])) + 0.5
    got = d.reconstruct(x)
    assert got.dtype == case["dtype"] and bool(torch.isfinite(got).all())
    if (
        case["dtype"] in (torch.float16, torch.bfloat16)
        and case["options"]["architecture"] != "standard"
    ):
        return  # a selection (top k, a threshold) may flip on a half-precision rounding
    tol = _TOLERANCE[case["dtype"]]
    want = _reference(d, x.to(case["dtype"]))
    torch.testing.assert_close(
        got.double(), want, rtol=tol, atol=tol * max(1.0, float(want.abs().max()))
    )
