"""One ``ForwardRequest`` per call: validated once, trusted by the driver, same as the keywords."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from tl_core import (
    DriverContractError,
    RemoteBridge,
    TransformerBridge,
    UnsupportedFeatureError,
    UserError,
)
from tl_core.driver_api import (
    ForwardRequest,
    RequestForward,
    build_request,
    pad_batch,
    validation_calls,
)
from tl_core.driver_api._request import checked_token_types

_SPEC = {"blocks.0.mlp.hook_post": {"op": "scale", "factor": 0.5}}
_NAMES = ["blocks.0.hook_resid_post", "hook_embed", "blocks.1.attn.hook_pattern"]


@pytest.fixture(scope="module")
def bridge() -> TransformerBridge:
    return TransformerBridge.boot_native("gpt2", n_layers=3)


def _assert_validated_once(counts: Any, names: list[str]) -> None:
    lookups = {
        key.removeprefix("lookup:"): n for key, n in counts.items() if key.startswith("lookup:")
    }
    assert lookups == dict.fromkeys(names, 1), counts
    assert counts["pad_batch"] == 1, counts
    assert counts["block_index"] == 1, counts
    # One plan; the one spec list (the same for every prompt) composed once.
    assert (counts["build_plan"], counts["compile_specs"]) == (1, 1), counts


def test_run_with_cache_resolves_pads_and_checks_the_stop_layer_once(
    bridge: TransformerBridge,
) -> None:
    with validation_calls() as counts:
        bridge.run_with_cache(
            ["a ragged batch", "b"], names_filter=_NAMES, intervene=_SPEC, stop_at_layer=-1
        )
    _assert_validated_once(counts, [*_NAMES, *_SPEC])


def test_the_counter_sees_a_second_validation(bridge: TransformerBridge) -> None:
    # The guard of the test above: a driver that re-resolved and re-padded would be caught.
    with validation_calls() as counts:
        bridge.driver.forward([[1, 2, 3]], capture=["hook_embed"], intervene=_SPEC, stop_at_layer=1)
        bridge.driver.forward([[1, 2, 3]], capture=["hook_embed"], max_new_tokens=0)
    assert counts["lookup:hook_embed"] == 2
    assert counts["pad_batch"] == 2
    assert counts["build_plan"] == 2 and counts["compile_specs"] == 1


def test_remote_bridge_validates_once_too() -> None:
    with RemoteBridge(TransformerBridge.boot_native("llama", n_layers=2).driver) as remote:
        with validation_calls() as counts:
            remote.run_with_cache(
                "hi there", names_filter=_NAMES[:2], intervene=_SPEC, stop_at_layer=1
            )
    # The remote bridge reads the residual stream at its stop layer from one more hook.
    assert counts.pop("lookup:blocks.1.hook_in") == 1
    _assert_validated_once(counts, [*_NAMES[:2], *_SPEC])


def test_the_keyword_form_gives_what_the_request_gives(bridge: TransformerBridge) -> None:
    driver = bridge.driver
    request = build_request(
        driver,
        [[5, 6, 7, 8], [9, 10]],
        capture=["blocks.1.hook_out"],
        intervene=_SPEC,
        max_new_tokens=0,
    )
    assert request.capture == ("blocks.1.hook_out",)
    assert request.batch.rows() == [[5, 6, 7, 8], [9, 10]]
    by_keywords = driver.forward(
        [[5, 6, 7, 8], [9, 10]], capture=["blocks.1.hook_out"], intervene=_SPEC, max_new_tokens=0
    )
    by_request = driver.run(request)
    torch.testing.assert_close(by_request.logits, by_keywords.logits, rtol=0, atol=0)
    torch.testing.assert_close(
        by_request.captured["blocks.1.hook_out"], by_keywords.captured["blocks.1.hook_out"]
    )


def test_a_driver_with_only_the_keyword_forward_is_refused_with_the_way_to_run() -> None:
    # Drivers run one ForwardRequest; the keyword forward of earlier releases alone no
    # longer keeps the contract, and the message says what run takes.
    from tl_core.driver_api import validate_driver

    class KeywordOnly:
        def forward(self, input_ids: Any, **kwargs: Any) -> Any:
            raise AssertionError("never reached")

        def close(self) -> None:
            pass

        def supports(self, feature: str) -> bool:
            return False

    with pytest.raises(DriverContractError, match=r"method 'run' is missing.*ForwardRequest"):
        validate_driver(KeywordOnly(), name="old")


def test_last_logits_are_each_prompts_last_position(bridge: TransformerBridge) -> None:
    rows = [[3, 4, 5, 6], [7, 8]]
    full = bridge.driver.forward(rows, max_new_tokens=0).logits
    last = bridge.driver.forward(rows, max_new_tokens=0, return_logits="last").logits
    assert last.shape == (2, 1, full.shape[-1])
    torch.testing.assert_close(last[:, 0], torch.stack([full[0, 3], full[1, 1]]))
    assert bridge.driver.forward(rows, max_new_tokens=0, return_logits=False).logits is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beam_width": 2}, r"unknown forward options \['beam_width'\]"),
        ({"return_logits": "first"}, "return_logits must be True"),
        ({"max_new_tokens": -1}, "max_new_tokens must be an int >= 0"),
        ({"stop_at_eos": "yes"}, "stop_at_eos must be True or False"),
        ({"top_k": 0, "do_sample": True}, "top_k must be an int >= 1"),
        ({"seed": 1.5}, "seed must be an int"),
        ({"start_at_layer": 1}, "start_at_layer needs residual"),
        (
            {"stop_at_layer": 1, "start_at_layer": 2, "residual": torch.zeros(1, 3, 64)},
            "start must not exceed stop",
        ),
        ({"stop_at_layer": 1, "max_new_tokens": 3}, "cannot be combined with generation"),
        ({"stop_at_layer": 9}, "stop_at_layer=9 is out of range"),
    ],
)
def test_bad_keywords_are_refused_before_the_model_runs(
    bridge: TransformerBridge, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(UserError, match=message):
        build_request(bridge.driver, [[1, 2, 3]], **kwargs)


def test_a_remote_style_driver_refuses_local_options(bridge: TransformerBridge) -> None:
    class Remote(RequestForward):
        """Takes only the common keywords, as a serving engine's driver does."""

        name = "remote"
        namespace = bridge.driver.namespace
        info = bridge.driver.info
        tokenizer = bridge.driver.tokenizer

        def supports(self, feature: str) -> bool:
            return False

        def run(self, request: ForwardRequest) -> Any:
            raise AssertionError("refused before running")

    with pytest.raises(UserError, match="capture_device: partial forwards and capture_device"):
        Remote().forward([[1, 2]], capture_device="cpu")
    with pytest.raises(UserError, match="declarative specs only"):
        Remote().forward([[1, 2]], intervene={"hook_embed": lambda x, hook: x})


def test_requests_are_immutable(bridge: TransformerBridge) -> None:
    request = build_request(bridge.driver, [[1, 2]])
    assert isinstance(request, ForwardRequest)
    with pytest.raises(AttributeError):
        request.capture = ("embed.hook_out",)  # type: ignore[misc]


def test_bridges_and_the_keyword_form_both_go_through_run() -> None:
    from tl_core.native import NativeDriver

    class Faulty(NativeDriver):
        """A wrapper driver (as the parity fault drivers are): it changes what run returns."""

        def run(self, request: ForwardRequest) -> Any:
            result = super().run(request)
            return type(result)(result.logits * 0, result.captured, None, None, result.lengths)

    driver = Faulty.boot("gpt2", n_layers=1)
    assert bool((TransformerBridge(driver)([[1, 2, 3]]) == 0).all())
    assert bool((driver.forward([[1, 2, 3]], max_new_tokens=0).logits == 0).all())


_ROWS = st.lists(st.lists(st.integers(0, 258), min_size=1, max_size=9), min_size=1, max_size=4)
_CAPTURE = st.lists(
    st.sampled_from(
        ["hook_embed", "embed.hook_out", "blocks.0.hook_resid_post", "blocks.1.mlp.hook_post"]
    ),
    max_size=4,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rows=_ROWS, capture=_CAPTURE, logits=st.sampled_from([True, False, "last"]))
def test_the_keyword_form_of_any_request_builds_the_same_request(
    bridge: TransformerBridge, rows: list[list[int]], capture: list[str], logits: Any
) -> None:
    request = build_request(
        bridge.driver, rows, capture=capture, max_new_tokens=0, return_logits=logits
    )
    assert request.lengths == tuple(len(r) for r in rows)
    assert request.batch.rows() == rows
    assert len(set(request.capture)) == len(request.capture)  # each name once, canonical
    keywords = {"return_logits": {"all": True, "none": False, "last": "last"}[request.logits]}
    again = build_request(
        bridge.driver, request.batch.rows(), capture=request.capture, max_new_tokens=0, **keywords
    )
    assert (again.capture, again.logits, again.lengths) == (
        request.capture,
        request.logits,
        request.lengths,
    )
    assert torch.equal(again.batch.ids, request.batch.ids)
    result = bridge.driver.run(request)
    assert set(result.captured) == set(request.capture)
    if request.logits == "none":
        assert result.logits is None
    else:
        width = 1 if request.logits == "last" else max(request.lengths)
        assert result.logits is not None and result.logits.shape[:2] == (len(rows), width)


class _Segmented:
    """A driver stand-in that takes segment ids (an encoder's)."""

    name = "segmented"

    def supports(self, feature: str) -> bool:
        return feature == "token_type_ids"


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4), data=st.data())
def test_segment_ids_per_prompt_are_padded_like_the_prompts(lengths: list[int], data: Any) -> None:
    batch = pad_batch([[1] * n for n in lengths], pad_id=0)
    rows = [data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)) for n in lengths]
    types = checked_token_types(_Segmented(), rows, batch)
    assert types.shape == batch.ids.shape and types.dtype == torch.long
    for b, row in enumerate(rows):
        assert types[b, : len(row)].tolist() == row
        assert not types[b, len(row) :].any()
    assert torch.equal(checked_token_types(_Segmented(), types, batch), types)


def test_segment_ids_are_refused_where_the_driver_takes_none(bridge: TransformerBridge) -> None:
    with pytest.raises(UnsupportedFeatureError, match="'native' takes no token_type_ids"):
        build_request(bridge.driver, [[1, 2, 3]], token_type_ids=[[0, 0, 1]])
    with pytest.raises(UnsupportedFeatureError, match="takes no token_type_ids"):
        bridge([[1, 2, 3]], token_type_ids=[[0, 0, 1]])


def test_segment_ids_cannot_ride_along_a_generation() -> None:
    class Encoder(_Segmented):
        namespace = TransformerBridge.boot_native("gpt2", n_layers=1).driver.namespace

    batch = pad_batch([[1, 2, 3]], pad_id=0)
    from tl_core.driver_api import planned_request

    with pytest.raises(UserError, match="cannot be combined with generation"):
        planned_request(Encoder(), batch, token_type_ids=[[0, 0, 1]], max_new_tokens=4)
