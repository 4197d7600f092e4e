"""Attribution patching on the native driver, against exact patches and finite differences.

The references here never go through ``attribution_patch``'s machinery: exact patches are
plain forward hooks that write clean values into the corrupt run, gradients come from
``HookPoint`` backward hooks or ``torch.autograd`` on the model's own modules, and writer
outputs are rebuilt from the model's weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tl_core import TransformerBridge, UnsupportedFeatureError, UserError
from tl_core.analysis import AttributionResult, attribution_patch, logit_diff, logit_diff_metric

CORRECT, INCORRECT = 7, 11


def _toy(**overrides: Any) -> TransformerBridge:
    """A float64 model linear in every last-block site: no norms, the last MLP's input zeroed."""
    bridge = TransformerBridge.boot_native(
        normalization_type=None, init_mode="xavier_normal", **overrides
    )
    bridge.model.to(torch.float64)
    with torch.no_grad():
        bridge.model.blocks[-1].mlp.W_in.zero_()
    return bridge


def _normed() -> TransformerBridge:
    bridge = TransformerBridge.boot_native(init_mode="xavier_normal")
    bridge.model.to(torch.float64)
    return bridge


def _pairs(seed: int = 0, batch: int = 3, length: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, 259, (batch, length), generator=gen)
    corrupt = clean.clone()
    corrupt[:, 2] = (clean[:, 2] + 1 + torch.randint(0, 200, (batch,), generator=gen)) % 259
    corrupt[:, 4] = (clean[:, 4] + 3) % 259
    return clean, corrupt


METRIC = logit_diff_metric(CORRECT, INCORRECT)


def _metric_with(
    bridge: TransformerBridge, ids: torch.Tensor, hooks: list[tuple[str, Callable[..., Any]]]
) -> torch.Tensor:
    with torch.no_grad():
        logits = bridge.run_with_hooks(ids, fwd_hooks=hooks)
    return METRIC(logits)


def _cache(bridge: TransformerBridge, ids: torch.Tensor) -> Any:
    with torch.no_grad():
        return bridge.run_with_cache(ids)[1]


def _set(value: torch.Tensor) -> Callable[..., torch.Tensor]:
    return lambda x, hook: value.clone()


def _add(delta: torch.Tensor) -> Callable[..., torch.Tensor]:
    return lambda x, hook: x + delta


# -- nodes ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "site",
    [
        "blocks.1.attn.hook_z",
        "blocks.1.mlp.hook_out",
        "blocks.1.hook_out",
        "blocks.1.attn.hook_out",
    ],
)
def test_node_scores_equal_the_exact_patch_where_the_model_is_linear_in_the_site(site: str) -> None:
    bridge = _toy()
    clean, corrupt = _pairs()
    result = attribution_patch(bridge, clean, corrupt, METRIC, sites=[site])
    clean_value = _cache(bridge, clean)[site]
    base = _metric_with(bridge, corrupt, [])
    patched = _metric_with(bridge, corrupt, [(site, _set(clean_value))])
    per_pair = result.nodes_per_pair[site]
    torch.testing.assert_close(per_pair.flatten(1).sum(1), patched - base, rtol=1e-9, atol=1e-12)
    # One node alone: a single position (and head) patched.
    position = 4
    corrupt_value = _cache(bridge, corrupt)[site]
    one = corrupt_value.clone()
    if site.endswith("hook_z"):
        one[:, position, 2] = clean_value[:, position, 2]
        expected = result.nodes[site][position, 2]
    else:
        one[:, position] = clean_value[:, position]
        expected = result.nodes[site][position]
    effect = (_metric_with(bridge, corrupt, [(site, _set(one))]) - base).mean()
    torch.testing.assert_close(expected, effect, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "site",
    [
        "blocks.0.hook_in",
        "blocks.0.attn.hook_z",
        "blocks.1.ln2.hook_in",
        "blocks.0.mlp.hook_out",
        "blocks.1.attn.hook_pattern",
    ],
)
def test_node_scores_match_finite_differences_on_a_normed_model(site: str) -> None:
    bridge = _normed()
    clean, corrupt = _pairs(1)
    result = attribution_patch(bridge, clean, corrupt, METRIC, sites=[site])
    a_clean, a_corrupt = _cache(bridge, clean)[site], _cache(bridge, corrupt)[site]
    eps = 1e-5
    step = eps * (a_clean - a_corrupt)
    up = _metric_with(bridge, corrupt, [(site, _set(a_corrupt + step))])
    down = _metric_with(bridge, corrupt, [(site, _set(a_corrupt - step))])
    directional = (up - down) / (2 * eps)
    torch.testing.assert_close(
        result.nodes_per_pair[site].flatten(1).sum(1), directional, rtol=1e-6, atol=1e-9
    )


def test_the_head_result_scores_like_its_z() -> None:
    bridge = TransformerBridge.boot_native(use_attn_result=True, init_mode="xavier_normal")
    clean, corrupt = _pairs(2)
    result = attribution_patch(bridge, clean, corrupt, METRIC)
    assert "blocks.0.attn.hook_result" in result.nodes
    for layer in range(2):
        z = result.nodes[f"blocks.{layer}.attn.hook_z"]
        torch.testing.assert_close(
            result.nodes[f"blocks.{layer}.attn.hook_result"], z, rtol=1e-4, atol=1e-6
        )
    assert result.node_axes["blocks.0.attn.hook_z"] == "p h"
    assert result.node_axes["blocks.0.hook_in"] == "p"


def test_default_sites_cover_residual_attention_and_mlp_nodes() -> None:
    bridge = TransformerBridge.boot_native()
    clean, corrupt = _pairs()
    result = attribution_patch(bridge, clean, corrupt, METRIC)
    expected = [
        f"blocks.{i}.{s}"
        for i in range(2)
        for s in ("hook_in", "attn.hook_z", "attn.hook_out", "mlp.hook_out")
    ]
    assert list(result.nodes) == expected
    top = result.top_nodes(5)
    assert [abs(n.score) for n in top] == sorted((abs(n.score) for n in top), reverse=True)
    assert abs(top[0].score) == max(float(t.abs().max()) for t in result.nodes.values())
    head = next(n for n in result.top_nodes(100) if n.head is not None)
    assert head.label == f"L{head.site.split('.')[1]}H{head.head} attn.hook_z @{head.position}"
    assert result.edges is None
    with pytest.raises(UserError, match="no edge scores"):
        result.top_edges()


def test_ragged_pairs_score_like_each_pair_alone() -> None:
    bridge = _normed()
    clean, corrupt = _pairs(3, batch=2, length=6)
    rows_clean = [clean[0].tolist(), clean[1, :4].tolist()]
    rows_corrupt = [corrupt[0].tolist(), corrupt[1, :4].tolist()]
    positions = [5, 3]
    metric = logit_diff_metric(CORRECT, INCORRECT, positions)
    together = attribution_patch(bridge, rows_clean, rows_corrupt, metric, granularity="both")
    for i in range(2):
        alone = attribution_patch(
            bridge,
            [rows_clean[i]],
            [rows_corrupt[i]],
            logit_diff_metric(CORRECT, INCORRECT, positions[i]),
            granularity="both",
        )
        for site, scores in alone.nodes.items():
            n = scores.shape[0]
            torch.testing.assert_close(
                together.nodes_per_pair[site][i, :n], scores, rtol=1e-8, atol=1e-10
            )
            assert not together.nodes_per_pair[site][i, n:].any()
        assert alone.edges is not None and together.edges_per_pair is not None
        torch.testing.assert_close(together.edges_per_pair[i], alone.edges, rtol=1e-8, atol=1e-10)


# -- edges ----------------------------------------------------------------------------


def _writer_delta(bridge: TransformerBridge, clean: Any, corrupt: Any, writer: str) -> torch.Tensor:
    """A writer's clean-minus-corrupt output, rebuilt from the model's own weights."""
    if writer == "embed":
        return clean["blocks.0.hook_in"] - corrupt["blocks.0.hook_in"]
    layer, rest = writer[1:].split("H") if "H" in writer else (writer[1:-3], None)
    if rest is None:
        site = f"blocks.{layer}.mlp.hook_out"
        return clean[site] - corrupt[site]
    site, head = f"blocks.{layer}.attn.hook_z", int(rest)
    w_o = bridge.model.blocks[int(layer)].attn.W_O[head]
    return (clean[site][:, :, head] - corrupt[site][:, :, head]) @ w_o


@pytest.mark.parametrize(
    ("writer", "reader"),
    [
        ("L0MLP", "logits"),
        ("L1H2", "logits"),
        ("embed", "logits"),
        ("L0H1", "L1H3.v"),
        ("L0MLP", "L1H0.v"),
        ("embed", "L1H2.v"),
    ],
)
def test_a_single_edge_patch_equals_its_score_on_the_linear_toy(writer: str, reader: str) -> None:
    bridge = _toy()
    clean_ids, corrupt_ids = _pairs(4)
    result = attribution_patch(bridge, clean_ids, corrupt_ids, METRIC, granularity="edge")
    delta = _writer_delta(bridge, _cache(bridge, clean_ids), _cache(bridge, corrupt_ids), writer)
    base = _metric_with(bridge, corrupt_ids, [])
    if reader == "logits":
        effect = _metric_with(bridge, corrupt_ids, [("blocks.1.hook_out", _add(delta))])
    else:
        head = int(reader.split("H")[1].split(".")[0])
        one_head = torch.zeros(*delta.shape[:2], 4, delta.shape[-1], dtype=delta.dtype)
        one_head[:, :, head] = delta
        bridge.set_use_split_qkv_input(True)
        try:
            effect = _metric_with(
                bridge, corrupt_ids, [("blocks.1.attn.hook_v_input", _add(one_head))]
            )
        finally:
            bridge.set_use_split_qkv_input(False)
    torch.testing.assert_close(
        torch.tensor(result.edge(writer, reader), dtype=torch.float64),
        (effect - base).mean(),
        rtol=1e-8,
        atol=1e-12,
    )


def test_single_edge_patches_agree_in_sign_with_the_top_edges_of_a_normed_model() -> None:
    bridge = _normed()
    clean_ids, corrupt_ids = _pairs(5)
    result = attribution_patch(bridge, clean_ids, corrupt_ids, METRIC, granularity="edge")
    clean, corrupt = _cache(bridge, clean_ids), _cache(bridge, corrupt_ids)
    base = _metric_with(bridge, corrupt_ids, [])
    checked = 0
    for edge in result.top_edges(6):
        delta = _writer_delta(bridge, clean, corrupt, edge.writer)
        if edge.reader == "logits":
            effect = _metric_with(bridge, corrupt_ids, [("blocks.1.hook_out", _add(delta))])
        elif edge.reader.endswith("MLP"):
            layer = edge.reader[1:-3]
            # Into the MLP only: add at resid_mid, take it back out of the skip path.
            effect = _metric_with(
                bridge,
                corrupt_ids,
                [
                    (f"blocks.{layer}.ln2.hook_in", _add(delta)),
                    (f"blocks.{layer}.hook_out", _add(-delta)),
                ],
            )
        else:
            layer, head = edge.reader[1:].split(".")[0].split("H")
            kind = edge.reader[-1]
            one_head = torch.zeros(*delta.shape[:2], 4, delta.shape[-1], dtype=delta.dtype)
            one_head[:, :, int(head)] = delta
            bridge.set_use_split_qkv_input(True)
            try:
                effect = _metric_with(
                    bridge,
                    corrupt_ids,
                    [(f"blocks.{layer}.attn.hook_{kind}_input", _add(one_head))],
                )
            finally:
                bridge.set_use_split_qkv_input(False)
        actual = float((effect - base).mean())
        assert actual * edge.score > 0, (edge, actual)
        checked += 1
    assert checked == 6


def _reader_gradient(
    bridge: TransformerBridge, ids: torch.Tensor, reader: str
) -> tuple[str, torch.Tensor]:
    """(the reader's input site, d metric / d input), by backward hooks and autograd."""
    grads: dict[str, torch.Tensor] = {}

    def keep(name: str) -> Callable[..., None]:
        def hook(grad: torch.Tensor, hook: Any) -> None:
            grads[name] = grad

        return hook

    if reader == "logits":
        site = "blocks.1.hook_out"
    elif reader.endswith("MLP"):
        site = f"blocks.{reader[1:-3]}.ln2.hook_in"
    else:
        site = f"blocks.{reader[1:].split('H')[0]}.attn.hook_{reader[-1]}_input"
    watched = (
        "blocks.1.mlp.hook_in"
        if reader == "L1MLP"
        else "blocks.0.mlp.hook_in"
        if reader.endswith("MLP")
        else site
    )
    bridge.set_use_split_qkv_input(True)
    try:
        with bridge.hooks(bwd_hooks=[(watched, keep(watched))]):
            METRIC(bridge(ids)).sum().backward()
    finally:
        bridge.set_use_split_qkv_input(False)
        bridge.model.zero_grad()
    grad = grads[watched]
    if reader.endswith("MLP"):
        # Pull the MLP input's gradient back through ln2 with autograd: its residual input.
        ln2 = bridge.model.blocks[int(reader[1:-3])].ln2
        x = _cache(bridge, ids)[site].clone().requires_grad_(True)
        (grad_x,) = torch.autograd.grad(ln2(x), x, grad)
        return site, grad_x
    if reader != "logits":
        head = int(reader[1:].split("H")[1].split(".")[0])
        return "blocks." + reader[1:].split("H")[0] + ".hook_in", grad[:, :, head]
    return site, grad


@pytest.mark.parametrize("reader", ["logits", "L1MLP", "L0MLP", "L1H2.q", "L1H0.k", "L0H3.v"])
def test_a_readers_incoming_edges_sum_to_its_input_delta_against_its_gradient(reader: str) -> None:
    bridge = _normed()
    clean_ids, corrupt_ids = _pairs(6)
    result = attribution_patch(bridge, clean_ids, corrupt_ids, METRIC, granularity="edge")
    assert result.edges_per_pair is not None
    site, grad = _reader_gradient(bridge, corrupt_ids, reader)
    delta = _cache(bridge, clean_ids)[site] - _cache(bridge, corrupt_ids)[site]
    expected = (delta * grad).sum(dim=(1, 2))
    incoming = result.edges_per_pair[:, :, result.readers.index(reader)].sum(1)
    torch.testing.assert_close(incoming, expected, rtol=1e-7, atol=1e-10)


def test_perturbing_one_writer_changes_only_its_own_edges() -> None:
    bridge = _normed()
    clean_ids, corrupt_ids = _pairs(7)
    clean = _cache(bridge, clean_ids)
    sites = {name: clean[name] for name in clean}
    before = attribution_patch(
        bridge, clean_ids, corrupt_ids, METRIC, granularity="edge", clean_cache=sites
    )
    sites["blocks.0.mlp.hook_out"] = sites["blocks.0.mlp.hook_out"] * 1.5 + 0.1
    after = attribution_patch(
        bridge, clean_ids, corrupt_ids, METRIC, granularity="edge", clean_cache=sites
    )
    assert before.edges is not None and after.edges is not None and before.edge_mask is not None
    changed = (before.edges != after.edges).any(dim=1)
    row = before.writers.index("L0MLP")
    assert changed[row]
    assert not changed[torch.arange(len(changed)) != row].any()
    # And only towards readers it can reach.
    assert ((before.edges[row] != after.edges[row]) <= before.edge_mask[row]).all()


def test_the_graph_lets_writers_reach_only_later_readers() -> None:
    bridge = TransformerBridge.boot_native("llama", n_layers=2)
    clean, corrupt = _pairs(8)
    result = attribution_patch(bridge, clean, corrupt, METRIC, granularity="both")
    n_heads, kv = bridge.cfg.n_heads, bridge.cfg.kv_heads
    assert kv < n_heads
    assert result.writers[:2] == ["embed", "L0H0"] and f"L0KV{kv - 1}.v" in result.readers
    assert len(result.readers) == 2 * (n_heads + 2 * kv + 1) + 1
    assert result.edge_mask is not None
    mask = result.edge_mask
    assert mask[
        result.writers.index("L0H1"), result.readers.index("L0MLP")
    ]  # same block, sequential
    assert not mask[result.writers.index("L0MLP"), result.readers.index("L0MLP")]
    assert not mask[result.writers.index("L1H0"), result.readers.index("L0H0.q")]
    assert mask[:, result.readers.index("logits")].all()
    assert not bridge.driver.split_qkv_input
    edges = result.top_edges(4)
    assert all(mask[result.writers.index(e.writer), result.readers.index(e.reader)] for e in edges)
    assert edges[0].label == f"{edges[0].writer} -> {edges[0].reader}"


# -- errors and restoration -----------------------------------------------------------


def test_split_inputs_are_restored_when_the_metric_raises() -> None:
    bridge = TransformerBridge.boot_native()
    clean, corrupt = _pairs()
    reference = bridge(corrupt)

    def broken(logits: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("metric failed")

    with pytest.raises(RuntimeError, match="metric failed"):
        attribution_patch(bridge, clean, corrupt, broken, granularity="edge")
    assert not bridge.driver.split_qkv_input
    assert "blocks.0.attn.hook_q_input" not in bridge.hook_dict
    assert all(not p.has_hooks for p in bridge.hook_dict.values())
    assert all(p.requires_grad for p in bridge.model.parameters())
    assert torch.equal(bridge(corrupt), reference)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"clean": [[1, 2, 3]], "corrupt": [[1, 2]]}, "same length"),
        ({"clean": [[1, 2, 3]], "corrupt": [[1, 2, 3], [4, 5, 6]]}, "pairs"),
        ({"granularity": "heads"}, "granularity"),
        ({"sites": ["blocks.0.hook_bogus"]}, "hook_bogus"),
        ({"metric": lambda logits: logits[:, -1]}, "one value per pair"),
        ({"metric": lambda logits: logits.detach()[:, -1, 0]}, "detached"),
        ({"clean_cache": {}}, "clean_cache lacks"),
    ],
)
def test_bad_input_is_refused_with_the_reason(kwargs: dict[str, Any], match: str) -> None:
    bridge = TransformerBridge.boot_native()
    clean, corrupt = _pairs()
    args: dict[str, Any] = {"clean": clean, "corrupt": corrupt, "metric": METRIC, **kwargs}
    with pytest.raises(Exception, match=match):
        attribution_patch(
            bridge, args.pop("clean"), args.pop("corrupt"), args.pop("metric"), **args
        )


def test_a_driver_without_gradients_is_refused_before_running() -> None:
    class NoGradients:
        name = "remote"

        def supports(self, feature: str) -> bool:
            return False

    class Remote:
        driver = NoGradients()

    with pytest.raises(UnsupportedFeatureError, match="needs gradients"):
        attribution_patch(Remote(), "a", "b", METRIC)


def test_logit_diff_reads_each_prompt_at_its_own_position() -> None:
    logits = torch.arange(2 * 3 * 5, dtype=torch.float32).reshape(2, 3, 5)
    got = logit_diff(logits, [4, 0], [1, 2], positions=[2, 0])
    assert got.tolist() == [logits[0, 2, 4] - logits[0, 2, 1], logits[1, 0, 0] - logits[1, 0, 2]]
    with pytest.raises(UserError, match="one per prompt"):
        logit_diff(logits, [1, 2, 3], 0)


def test_summary_and_repr_are_readable() -> None:
    bridge = TransformerBridge.boot_native()
    clean, corrupt = _pairs()
    result = attribution_patch(bridge, clean, corrupt, METRIC, granularity="both")
    assert isinstance(result, AttributionResult)
    text = result.summary(3)
    assert "top nodes:" in text and "top edges:" in text and "->" in text
    assert (
        repr(result)
        == f"AttributionResult(sites=8, edges={len(result.writers)} writers x {len(result.readers)} readers)"
    )


# -- non-finite metrics, empty sites (issue 47) ----------------------------------------


def _poisoned(bad: float, *, per_pair: bool = True, at: int = 0) -> Callable[..., torch.Tensor]:
    """``METRIC`` with ``bad`` (NaN, inf) at pair ``at`` (or summed to a scalar)."""

    def poisoned_metric(logits: torch.Tensor) -> torch.Tensor:
        value = METRIC(logits)
        poison = torch.zeros_like(value)
        poison[at] = bad
        value = value + poison
        return value if per_pair else value.sum()

    return poisoned_metric


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("granularity", ["node", "edge"])
@pytest.mark.parametrize("per_pair", [True, False], ids=["per-pair", "scalar"])
def test_a_metric_that_is_not_finite_is_refused_naming_it(
    bad: float, granularity: str, per_pair: bool
) -> None:
    bridge = TransformerBridge.boot_native()
    clean, corrupt = _pairs()
    with pytest.raises(UserError, match=rf"metric 'poisoned_metric' returned .*{bad}.*not finite"):
        attribution_patch(
            bridge,
            clean,
            corrupt,
            _poisoned(bad, per_pair=per_pair, at=1),
            granularity=granularity,  # type: ignore[arg-type]
        )
    assert all(not p.has_hooks for p in bridge.hook_dict.values())


def test_a_metric_that_is_not_finite_on_the_clean_run_only_is_refused() -> None:
    bridge = TransformerBridge.boot_native()
    clean, corrupt = _pairs()
    calls: list[int] = []

    def late_nan(logits: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        value = METRIC(logits)
        return value * float("nan") if len(calls) > 1 else value

    with pytest.raises(UserError, match=r"'late_nan' returned \[nan.* on the clean run"):
        attribution_patch(bridge, clean, corrupt, late_nan)


def test_a_metric_with_an_infinite_slope_is_refused_naming_the_site() -> None:
    bridge = TransformerBridge.boot_native()
    clean, corrupt = _pairs()

    def root(logits: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(METRIC(logits) * 0)  # 0 everywhere; d sqrt(u)/du at 0 is inf

    with pytest.raises(UserError, match=r"gradient of metric 'root' at 'blocks\.\d\..*not finite"):
        attribution_patch(bridge, clean, corrupt, root)


def test_a_non_finite_clean_cache_is_refused_naming_the_site() -> None:
    bridge = TransformerBridge.boot_native()
    clean, corrupt = _pairs()
    cache = dict(_cache(bridge, clean).items())
    cache["blocks.1.mlp.hook_out"] = cache["blocks.1.mlp.hook_out"].clone()
    cache["blocks.1.mlp.hook_out"][0, 3, 5] = float("nan")
    with pytest.raises(UserError, match=r"clean_cache\['blocks\.1\.mlp\.hook_out'\] is not finite"):
        attribution_patch(bridge, clean, corrupt, METRIC, clean_cache=cache)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_rankings_refuse_scores_that_are_not_finite(bad: float) -> None:
    scores = torch.tensor([0.5, bad, -2.0])
    result = AttributionResult(
        nodes={"blocks.0.hook_in": scores}, node_axes={"blocks.0.hook_in": "p"}
    )
    with pytest.raises(
        UserError, match=r"top_nodes: 1 node score\(s\) are not finite.*L0 hook_in @1"
    ):
        result.top_nodes(2)
    result.writers, result.readers = ["embed", "L0H0"], ["L0H0.q", "logits"]
    result.edges = torch.tensor([[0.1, bad], [0.0, 0.3]])
    result.edge_mask = torch.ones(2, 2, dtype=torch.bool)
    with pytest.raises(UserError, match="top_edges: some edge scores are not finite"):
        result.top_edges(2)


def test_an_empty_site_list_is_refused_as_such() -> None:
    bridge = TransformerBridge.boot_native()
    clean, corrupt = _pairs()
    with pytest.raises(UserError, match="sites is empty, so there is no node to score"):
        attribution_patch(bridge, clean, corrupt, METRIC, sites=[])


@pytest.mark.parametrize(
    ("metric", "match"),
    [
        (lambda logits: (METRIC(logits) * 100).long(), "returned a torch.int64 tensor"),
        (lambda logits: [1.0, 2.0, 3.0], "returned list"),
    ],
)
def test_a_metric_of_the_wrong_kind_is_refused_naming_it(metric: Any, match: str) -> None:
    bridge = TransformerBridge.boot_native()
    clean, corrupt = _pairs()
    with pytest.raises(UserError, match=rf"metric '<lambda>' {match}"):
        attribution_patch(bridge, clean, corrupt, metric)


# -- ragged pairs without positions (issue 47) ----------------------------------------


def _ragged(seed: int = 5) -> tuple[list[list[int]], list[list[int]]]:
    """Pairs of 6 and 3 tokens, differing at one position each."""
    gen = torch.Generator().manual_seed(seed)
    clean = [torch.randint(0, 259, (n,), generator=gen).tolist() for n in (6, 3)]
    corrupt = [row.copy() for row in clean]
    corrupt[0][2] = (corrupt[0][2] + 17) % 259
    corrupt[1][1] = (corrupt[1][1] + 29) % 259
    return clean, corrupt


def _last_token_diff(bridge: TransformerBridge, row: list[int]) -> float:
    """The logit difference at the last token of one prompt run alone (no padding)."""
    with torch.no_grad():
        logits = bridge([row])[0, -1]
    return float(logits[CORRECT] - logits[INCORRECT])


def test_logit_diff_metric_reads_each_ragged_prompt_at_its_own_last_token() -> None:
    bridge = _normed()
    clean, corrupt = _ragged()
    result = attribution_patch(bridge, clean, corrupt, METRIC, granularity="both")
    assert result.metric_clean is not None and result.metric_corrupt is not None
    want_clean = [_last_token_diff(bridge, row) for row in clean]
    want_corrupt = [_last_token_diff(bridge, row) for row in corrupt]
    torch.testing.assert_close(result.metric_clean.tolist(), want_clean, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(result.metric_corrupt.tolist(), want_corrupt, rtol=1e-9, atol=1e-10)
    # Every pair scores as it does alone, where its last token is the row's last column.
    for i in range(2):
        alone = attribution_patch(bridge, [clean[i]], [corrupt[i]], METRIC, granularity="both")
        for site, scores in alone.nodes.items():
            n = scores.shape[0]
            torch.testing.assert_close(
                result.nodes_per_pair[site][i, :n], scores, rtol=1e-8, atol=1e-10
            )
        assert alone.edges is not None and result.edges_per_pair is not None
        torch.testing.assert_close(result.edges_per_pair[i], alone.edges, rtol=1e-8, atol=1e-10)


def test_negative_positions_count_from_each_prompts_own_end() -> None:
    bridge = _normed()
    clean, corrupt = _ragged()
    result = attribution_patch(bridge, clean, corrupt, logit_diff_metric(CORRECT, INCORRECT, -2))
    assert result.metric_corrupt is not None
    with torch.no_grad():
        want = [float(bridge([r])[0, -2, CORRECT] - bridge([r])[0, -2, INCORRECT]) for r in corrupt]
    torch.testing.assert_close(result.metric_corrupt.tolist(), want, rtol=1e-9, atol=1e-10)
    with pytest.raises(UserError, match="position 4 is out of range for prompt 1, which has 3"):
        attribution_patch(bridge, clean, corrupt, logit_diff_metric(CORRECT, INCORRECT, 4))


def test_a_metric_that_reads_padding_is_refused_naming_the_pairs() -> None:
    bridge = _normed()
    clean, corrupt = _ragged()

    def last_column(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, -1, CORRECT] - logits[:, -1, INCORRECT]

    with pytest.raises(UserError, match=r"'last_column' reads padded positions.*pair\(s\) \[1\]"):
        attribution_patch(bridge, clean, corrupt, last_column, granularity="both")


def test_a_custom_metric_with_a_lengths_keyword_gets_each_pairs_length() -> None:
    bridge = _normed()
    clean, corrupt = _ragged()
    seen: list[tuple[int, ...]] = []

    def own_last(logits: torch.Tensor, *, lengths: tuple[int, ...]) -> torch.Tensor:
        seen.append(lengths)
        return logit_diff(logits, CORRECT, INCORRECT, lengths=lengths)

    result = attribution_patch(bridge, clean, corrupt, own_last)
    assert seen == [(6, 3), (6, 3)]
    assert result.metric_corrupt is not None
    want = [_last_token_diff(bridge, row) for row in corrupt]
    torch.testing.assert_close(result.metric_corrupt.tolist(), want, rtol=1e-9, atol=1e-10)
