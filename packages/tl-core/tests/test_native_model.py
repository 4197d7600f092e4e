"""Tests of the native transformer: hooks against a hand-written reference, paths, padding."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tl_core._errors import ConfigError, UnsupportedFeatureError, UserError
from tl_core.hooks._hook_point import HookPoint
from tl_core.native._config import NativeConfig
from tl_core.native._model import NativeTransformer, TransformerBlock

STYLES = ("gpt2", "llama")


def make_config(style: str, **overrides: Any) -> NativeConfig:
    if style == "gpt2":
        return NativeConfig.gpt2_style(**overrides)
    return NativeConfig.llama_style(**overrides)


def make_model(style: str, **overrides: Any) -> NativeTransformer:
    # xavier_normal weights are large enough to give peaked attention patterns, so
    # masking or rotary mistakes show up well above the tolerances used here.
    overrides.setdefault("init_mode", "xavier_normal")
    return NativeTransformer(make_config(style, **overrides))


def block(model: NativeTransformer, index: int) -> TransformerBlock:
    found = model.blocks[index]
    assert isinstance(found, TransformerBlock)
    return found


def random_ids(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 259, (batch, seq), generator=gen)


def capture_all(
    model: NativeTransformer, run: Callable[[], torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    captured: dict[str, torch.Tensor] = {}

    def save(tensor: torch.Tensor, *, hook: HookPoint) -> None:
        captured[hook.name] = tensor.detach().clone()

    handles = [hp.add_hook(save) for hp in model.hook_points.values()]
    try:
        with torch.no_grad():
            logits = run()
    finally:
        for handle in handles:
            handle.remove()
    return logits, captured


# A forward pass written from the formulas, reading only the model's weights.


def _reference_norm(
    acts: dict[str, torch.Tensor],
    prefix: str,
    x: torch.Tensor,
    cfg: NativeConfig,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    acts[f"{prefix}.hook_in"] = x
    if cfg.normalization_type == "LN":
        centered = x - x.mean(dim=-1, keepdim=True)
        scale = torch.sqrt(x.var(dim=-1, unbiased=False, keepdim=True) + cfg.eps)
    else:
        centered = x
        scale = torch.sqrt((x * x).mean(dim=-1, keepdim=True) + cfg.eps)
    normalized = centered / scale
    out = normalized * weight + (0.0 if bias is None else bias)
    acts[f"{prefix}.hook_scale"] = scale
    acts[f"{prefix}.hook_normalized"] = normalized
    acts[f"{prefix}.hook_out"] = out
    return out


def _reference_angles(pos: torch.Tensor, cfg: NativeConfig) -> torch.Tensor:
    half = cfg.d_head // 2
    freqs = cfg.rotary_base ** (-torch.arange(half, dtype=torch.float64) * 2 / cfg.d_head)
    return pos.to(torch.float64)[:, :, None] * freqs  # b p half


def _reference_rotary(x: torch.Tensor, pos: torch.Tensor, cfg: NativeConfig) -> torch.Tensor:
    half = cfg.d_head // 2
    angle = _reference_angles(pos, cfg)[:, :, None, :]  # b p 1 half
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def _reference_act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "gelu":
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    if name == "gelu_new":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    if name == "relu":
        return x.clamp(min=0)
    return x * torch.sigmoid(x)


def reference_forward(
    model: NativeTransformer, ids: torch.Tensor, mask: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    cfg = model.cfg
    acts: dict[str, torch.Tensor] = {}
    batch, seq = ids.shape
    if mask is None:
        keys = torch.ones(batch, seq, dtype=torch.bool)
        pos = torch.arange(seq).expand(batch, seq)
    else:
        keys = mask.bool()
        pos = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    allowed = torch.tril(torch.ones(seq, seq, dtype=torch.bool)) & keys[:, None, None, :]
    group_of_head = torch.arange(cfg.n_heads) // (cfg.n_heads // cfg.kv_heads)

    x = model.W_E[ids]
    acts["embed.hook_in"] = ids
    acts["embed.hook_out"] = x
    if cfg.positional_embedding_type == "standard":
        acts["pos_embed.hook_in"] = pos
        acts["pos_embed.hook_out"] = model.W_pos[pos]
        x = x + model.W_pos[pos]
    W_Q, W_K, W_V, W_O = model.W_Q, model.W_K, model.W_V, model.W_O
    b_Q, b_K, b_V, b_O = model.b_Q, model.b_K, model.b_V, model.b_O
    for i in range(cfg.n_layers):
        blk, pre = block(model, i), f"blocks.{i}"
        acts[f"{pre}.hook_in"] = x
        h = _reference_norm(acts, f"{pre}.ln1", x, cfg, blk.ln1.w, blk.ln1.b)
        acts[f"{pre}.attn.hook_in"] = h
        q = torch.einsum("bpd,hde->bphe", h, W_Q[i]) + b_Q[i]
        k = torch.einsum("bpd,hde->bphe", h, W_K[i]) + b_K[i]
        v = torch.einsum("bpd,hde->bphe", h, W_V[i]) + b_V[i]
        acts[f"{pre}.attn.hook_q"], acts[f"{pre}.attn.hook_k"] = q, k
        acts[f"{pre}.attn.hook_v"] = v
        if cfg.positional_embedding_type == "rotary":
            # The table repeats each frequency for both halves of a head (rotate-half).
            angles = _reference_angles(pos, cfg).repeat(1, 1, 2).float()
            acts[f"{pre}.attn.hook_cos"], acts[f"{pre}.attn.hook_sin"] = angles.cos(), angles.sin()
            q, k = _reference_rotary(q, pos, cfg), _reference_rotary(k, pos, cfg)
            acts[f"{pre}.attn.hook_rot_q"], acts[f"{pre}.attn.hook_rot_k"] = q, k
        k_full, v_full = k[:, :, group_of_head], v[:, :, group_of_head]
        scores = torch.einsum("bqhe,bkhe->bhqk", q, k_full) / math.sqrt(cfg.d_head)
        scores = torch.where(allowed, scores, torch.tensor(float("-inf")))
        pattern = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
        z = torch.einsum("bhqk,bkhe->bqhe", pattern, v_full)
        result = torch.einsum("bqhe,hed->bqhd", z, W_O[i])
        attn_out = result.sum(dim=2) + b_O[i]
        acts[f"{pre}.attn.hook_attn_scores"], acts[f"{pre}.attn.hook_pattern"] = scores, pattern
        acts[f"{pre}.attn.hook_z"], acts[f"{pre}.attn.hook_result"] = z, result
        acts[f"{pre}.attn.hook_out"] = attn_out
        x = x + attn_out
        h = _reference_norm(acts, f"{pre}.ln2", x, cfg, blk.ln2.w, blk.ln2.b)
        acts[f"{pre}.mlp.hook_in"] = h
        if cfg.gated_mlp:
            gate = h @ model.W_gate[i]
            up = h @ model.W_in[i] + model.b_in[i]
            acts[f"{pre}.mlp.hook_pre"], acts[f"{pre}.mlp.hook_pre_linear"] = gate, up
            post = _reference_act(cfg.act_fn, gate) * up
        else:
            acts[f"{pre}.mlp.hook_pre"] = h @ model.W_in[i] + model.b_in[i]
            post = _reference_act(cfg.act_fn, acts[f"{pre}.mlp.hook_pre"])
        mlp_out = post @ model.W_out[i] + model.b_out[i]
        acts[f"{pre}.mlp.hook_post"], acts[f"{pre}.mlp.hook_out"] = post, mlp_out
        x = x + mlp_out
        acts[f"{pre}.hook_out"] = x
    h = _reference_norm(acts, "ln_final", x, cfg, model.ln_final.w, model.ln_final.b)
    acts["unembed.hook_out"] = h @ model.W_U + model.b_U
    return acts


def expected_shapes(cfg: NativeConfig, batch: int, seq: int) -> dict[str, tuple[int, ...]]:
    b, p, d, h, hkv = batch, seq, cfg.d_model, cfg.n_heads, cfg.kv_heads
    shapes: dict[str, tuple[int, ...]] = {"embed.hook_in": (b, p), "embed.hook_out": (b, p, d)}
    if cfg.positional_embedding_type == "standard":
        shapes["pos_embed.hook_in"] = (b, p)
        shapes["pos_embed.hook_out"] = (b, p, d)

    def norm(prefix: str) -> None:
        for site in ("hook_in", "hook_normalized", "hook_out"):
            shapes[f"{prefix}.{site}"] = (b, p, d)
        shapes[f"{prefix}.hook_scale"] = (b, p, 1)

    for i in range(cfg.n_layers):
        pre = f"blocks.{i}"
        shapes[f"{pre}.hook_in"] = shapes[f"{pre}.hook_out"] = (b, p, d)
        norm(f"{pre}.ln1")
        norm(f"{pre}.ln2")
        shapes[f"{pre}.attn.hook_in"] = shapes[f"{pre}.attn.hook_out"] = (b, p, d)
        shapes[f"{pre}.attn.hook_q"] = (b, p, h, cfg.d_head)
        shapes[f"{pre}.attn.hook_k"] = shapes[f"{pre}.attn.hook_v"] = (b, p, hkv, cfg.d_head)
        if cfg.positional_embedding_type == "rotary":
            shapes[f"{pre}.attn.hook_cos"] = shapes[f"{pre}.attn.hook_sin"] = (b, p, cfg.d_head)
            shapes[f"{pre}.attn.hook_rot_q"] = (b, p, h, cfg.d_head)
            shapes[f"{pre}.attn.hook_rot_k"] = (b, p, hkv, cfg.d_head)
        shapes[f"{pre}.attn.hook_attn_scores"] = shapes[f"{pre}.attn.hook_pattern"] = (b, h, p, p)
        shapes[f"{pre}.attn.hook_z"] = (b, p, h, cfg.d_head)
        if cfg.use_attn_result:
            shapes[f"{pre}.attn.hook_result"] = (b, p, h, d)
        shapes[f"{pre}.mlp.hook_in"] = shapes[f"{pre}.mlp.hook_out"] = (b, p, d)
        shapes[f"{pre}.mlp.hook_pre"] = shapes[f"{pre}.mlp.hook_post"] = (b, p, cfg.d_mlp)
        if cfg.gated_mlp:
            shapes[f"{pre}.mlp.hook_pre_linear"] = (b, p, cfg.d_mlp)
    norm("ln_final")
    shapes["unembed.hook_out"] = (b, p, cfg.d_vocab)
    return shapes


def left_pad(prompts: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def force_explicit(model: NativeTransformer) -> list[Any]:
    """Attach no-op pattern hooks, which route attention through the explicit path."""
    return [
        model.hook_points[f"blocks.{i}.attn.hook_pattern"].add_hook(lambda t, hook: None)
        for i in range(model.cfg.n_layers)
    ]


# Hook values


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("padded", [False, True])
def test_every_hook_matches_reference(style: str, padded: bool) -> None:
    model = make_model(style, use_attn_result=True)
    ids = random_ids(3, 9)
    mask = None
    if padded:
        mask = torch.ones(3, 9, dtype=torch.long)
        mask[0, :4] = 0  # left padding
        mask[2, 6:] = 0  # right padding
    logits, captured = capture_all(model, lambda: model(ids, attention_mask=mask))
    with torch.no_grad():
        reference = reference_forward(model, ids, mask)
    assert set(captured) == set(reference) == set(model.hook_points)
    for name, expected in reference.items():
        torch.testing.assert_close(captured[name], expected, atol=1e-5, rtol=1e-5, msg=name)
    torch.testing.assert_close(logits, reference["unembed.hook_out"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("use_attn_result", [False, True])
def test_hook_names_and_shapes(style: str, use_attn_result: bool) -> None:
    model = make_model(style, use_attn_result=use_attn_result)
    expected = expected_shapes(model.cfg, 2, 5)
    modules = dict(model.named_modules())
    for name, hook_point in model.hook_points.items():
        assert hook_point.name == name
        assert modules[name] is hook_point
    _, captured = capture_all(model, lambda: model(random_ids(2, 5)))
    assert {name: tuple(t.shape) for name, t in captured.items()} == expected
    assert set(model.hook_points) == set(expected)


# Editing through hooks


@pytest.mark.parametrize("style", STYLES)
def test_edits_propagate(style: str) -> None:
    model = make_model(style)
    ids = random_ids(2, 6)
    with torch.no_grad():
        baseline = model(ids)

    same = model.hook_points["blocks.0.hook_out"].add_hook(lambda t, hook: t)
    with torch.no_grad():
        assert torch.equal(model(ids), baseline)
    same.remove()

    zero = model.hook_points["blocks.0.hook_out"].add_hook(lambda t, hook: torch.zeros_like(t))
    logits, captured = capture_all(model, lambda: model(ids))
    zero.remove()
    assert (logits - baseline).abs().max() > 1e-3
    zeros = torch.zeros_like(captured["blocks.1.hook_in"])
    assert torch.equal(captured["blocks.1.hook_in"], zeros)


@pytest.mark.parametrize("style", STYLES)
def test_resid_mid_edit_changes_the_residual_stream(style: str) -> None:
    model = make_model(style)
    handle = model.hook_points["blocks.0.ln2.hook_in"].add_hook(lambda t, hook: t * 0)
    _, captured = capture_all(model, lambda: model(random_ids(2, 6)))
    handle.remove()
    # With resid_mid zeroed, the block's output is the MLP output alone.
    torch.testing.assert_close(captured["blocks.0.hook_out"], captured["blocks.0.mlp.hook_out"])


@pytest.mark.parametrize("style", STYLES)
def test_pattern_and_q_edits_reach_the_output(style: str) -> None:
    model = make_model(style)
    ids = random_ids(2, 6)
    with torch.no_grad():
        baseline = model(ids)
    handle = model.hook_points["blocks.0.attn.hook_pattern"].add_hook(lambda t, hook: t * 0)
    logits, captured = capture_all(model, lambda: model(ids))
    handle.remove()
    z = captured["blocks.0.attn.hook_z"]
    assert torch.equal(z, torch.zeros_like(z))
    expected_out = model.b_O[0].detach().expand_as(captured["blocks.0.attn.hook_out"])
    torch.testing.assert_close(captured["blocks.0.attn.hook_out"], expected_out)
    assert (logits - baseline).abs().max() > 1e-3

    # hook_q has no score/pattern hook beside it, so this edit runs through SDPA.
    handle = model.hook_points["blocks.1.attn.hook_q"].add_hook(lambda t, hook: t * 3)
    with torch.no_grad():
        edited = model(ids)
    handle.remove()
    assert (edited - baseline).abs().max() > 1e-3


# Fused vs explicit attention


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("padded", [False, True])
def test_sdpa_and_explicit_paths_agree(
    style: str, padded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = make_model(style)
    ids = random_ids(3, 10)
    mask = None
    if padded:
        mask = torch.ones(3, 10, dtype=torch.long)
        mask[1, :6] = 0
        mask[2, 8:] = 0
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    with torch.no_grad():
        fused = model(ids, attention_mask=mask)
    assert len(calls) == model.cfg.n_layers
    handles = force_explicit(model)
    with torch.no_grad():
        explicit = model(ids, attention_mask=mask)
    assert len(calls) == model.cfg.n_layers  # no further SDPA calls
    for handle in handles:
        handle.remove()
    assert not fused.isnan().any()
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)


def test_scores_hook_alone_selects_explicit_path(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model("gpt2")
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    model.hook_points["blocks.0.attn.hook_attn_scores"].add_hook(lambda t, hook: None)
    model.hook_points["blocks.1.attn.hook_z"].add_hook(lambda t, hook: None)
    with torch.no_grad():
        model(random_ids(1, 4))
    assert len(calls) == 1  # block 1 (z hook only) still uses SDPA


# Padding


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_matches_single_prompts(style: str, explicit: bool, side: str) -> None:
    model = make_model(style)
    prompts = [random_ids(1, n, seed=n)[0] for n in (5, 3, 8)]
    if side == "left":
        ids, mask = left_pad(prompts)
    else:
        ids = torch.zeros(3, 8, dtype=torch.long)
        mask = torch.zeros(3, 8, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = prompt
            mask[row, : len(prompt)] = 1
    if explicit:
        force_explicit(model)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask)
        assert not batched.isnan().any()
        for row, prompt in enumerate(prompts):
            single = model(prompt[None])[0]
            real = mask[row].bool()
            torch.testing.assert_close(batched[row, real], single, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("style", STYLES)
def test_explicit_position_ids(style: str) -> None:
    model = make_model(style)
    ids = random_ids(2, 7)
    with torch.no_grad():
        baseline = model(ids)
        torch.testing.assert_close(model(ids, position_ids=torch.arange(7)), baseline)
        shifted = model(ids, position_ids=torch.arange(7) + 5)
    if style == "llama":
        # Rotary attention depends only on relative positions.
        torch.testing.assert_close(shifted, baseline, atol=1e-5, rtol=1e-5)
    else:
        assert (shifted - baseline).abs().max() > 1e-3


# start_at_layer / stop_at_layer


@pytest.mark.parametrize("style", STYLES)
def test_stop_and_start_round_trip(style: str) -> None:
    model = make_model(style)
    ids, mask = left_pad([random_ids(1, 6, seed=3)[0], random_ids(1, 4, seed=4)[0]])
    n_layers = model.cfg.n_layers
    full, captured = capture_all(model, lambda: model(ids, attention_mask=mask))
    with torch.no_grad():
        for k in [*range(n_layers + 1), -1, -n_layers]:
            resid = model(ids, attention_mask=mask, stop_at_layer=k)
            index = k % n_layers if k < 0 else k
            site = f"blocks.{index}.hook_in"
            if index == n_layers:
                site = f"blocks.{n_layers - 1}.hook_out"
            torch.testing.assert_close(resid, captured[site], atol=1e-6, rtol=1e-6)
            out = model(None, attention_mask=mask, start_at_layer=k, residual=resid)
            torch.testing.assert_close(out, full, atol=1e-6, rtol=1e-6)


def test_stop_at_layer_skips_later_blocks() -> None:
    model = make_model("gpt2")
    fired: list[str] = []
    for hp in model.hook_points.values():
        hp.add_hook(lambda t, hook: fired.append(hook.name))
    with torch.no_grad():
        model(random_ids(1, 4), stop_at_layer=1)
    assert "blocks.0.hook_out" in fired
    assert not [name for name in fired if name.startswith(("blocks.1.", "ln_final", "unembed"))]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stop_at_layer": 3}, "out of range"),
        ({"stop_at_layer": -3}, "out of range"),
        ({"start_at_layer": 2, "stop_at_layer": 1, "residual": torch.zeros(1, 4, 64)}, "exceed"),
        ({"start_at_layer": 1}, "needs residual"),
        ({"residual": torch.zeros(1, 4, 64)}, "without start_at_layer"),
        ({"start_at_layer": 1, "residual": torch.zeros(1, 4, 32)}, "residual must have shape"),
        ({"attention_mask": torch.ones(1, 5)}, "attention_mask must have shape"),
        ({"position_ids": torch.arange(4) + 300}, "n_ctx"),
        ({"stop_at_layer": 1.0}, "must be an int"),
    ],
)
def test_forward_argument_errors(kwargs: dict[str, Any], message: str) -> None:
    model = make_model("gpt2")
    with pytest.raises(UserError, match=message):
        model(random_ids(1, 4), **kwargs)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (torch.tensor([1, 2, 3]), "2-D"),
        (torch.tensor([[1.0, 2.0]]), "integers"),
        (torch.tensor([[1, 259]]), "d_vocab"),
        (torch.tensor([[1, -1]]), "d_vocab"),
        (torch.zeros(1, 257, dtype=torch.long), "n_ctx"),
        (None, "input_ids is None"),
    ],
)
def test_input_id_errors(ids: torch.Tensor | None, message: str) -> None:
    model = make_model("gpt2")
    with pytest.raises(UserError, match=message):
        model(ids)


# Gradients


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("explicit", [False, True])
def test_gradients_reach_every_block_output(style: str, explicit: bool) -> None:
    model = make_model(style)
    if explicit:
        force_explicit(model)
    ids, mask = left_pad([random_ids(1, 6, seed=5)[0], random_ids(1, 3, seed=6)[0]])
    values: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}

    def keep(tensor: torch.Tensor, *, hook: HookPoint) -> None:
        values[hook.name] = tensor

    def keep_grad(grad: torch.Tensor, *, hook: HookPoint) -> None:
        grads[hook.name] = grad

    names = [f"blocks.{i}.hook_out" for i in range(model.cfg.n_layers)]
    for name in names:
        model.hook_points[name].add_hook(keep)
        model.hook_points[name].add_hook(keep_grad, dir="bwd")
    logits = model(ids, attention_mask=mask)
    targets = random_ids(ids.shape[0], ids.shape[1], seed=7)
    loss = torch.nn.functional.cross_entropy(logits[mask.bool()], targets[mask.bool()])
    expected = torch.autograd.grad(loss, [values[n] for n in names], retain_graph=True)
    torch.autograd.backward([loss])
    assert set(grads) == set(names)
    for name, want in zip(names, expected, strict=True):
        assert grads[name].abs().max() > 0
        torch.testing.assert_close(grads[name], want)
    for pname, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), pname


# Weights, seeds, readout


def test_same_seed_same_weights_independent_of_global_rng() -> None:
    torch.manual_seed(123)
    first = NativeTransformer(NativeConfig.llama_style(seed=4)).state_dict()
    torch.manual_seed(999)
    torch.rand(10)
    second = NativeTransformer(NativeConfig.llama_style(seed=4)).state_dict()
    other = NativeTransformer(NativeConfig.llama_style(seed=5)).state_dict()
    assert first.keys() == second.keys() == other.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key
    assert not torch.equal(first["embed.W_E"], other["embed.W_E"])
    assert not torch.equal(first["blocks.1.attn.W_Q"], other["blocks.1.attn.W_Q"])


def test_init_modes() -> None:
    gpt2 = NativeTransformer(NativeConfig.gpt2_style())
    assert abs(float(gpt2.W_E.detach().std()) - 0.02) < 0.002
    assert abs(float(gpt2.W_out.detach().std()) - 0.02) < 0.002
    assert torch.equal(gpt2.b_in, torch.zeros_like(gpt2.b_in))
    assert torch.equal(block(gpt2, 0).ln1.w, torch.ones(64))
    assert gpt2.ln_final.b is not None
    assert torch.equal(gpt2.ln_final.b, torch.zeros(64))
    xavier = NativeTransformer(NativeConfig.gpt2_style(init_mode="xavier_normal"))
    want = math.sqrt(2 / (64 + 4 * 16))
    assert abs(float(xavier.W_Q.detach().std()) - want) < 0.1 * want


@pytest.mark.parametrize("style", STYLES)
def test_weight_accessor_shapes(style: str) -> None:
    model = make_model(style)
    cfg = model.cfg
    L, H, Hkv, d, dh, dm, V = (
        cfg.n_layers,
        cfg.n_heads,
        cfg.kv_heads,
        cfg.d_model,
        cfg.d_head,
        cfg.d_mlp,
        cfg.d_vocab,
    )
    shapes = {
        "W_E": (V, d),
        "W_Q": (L, H, d, dh),
        "W_K": (L, Hkv, d, dh),
        "W_V": (L, Hkv, d, dh),
        "W_O": (L, H, dh, d),
        "b_Q": (L, H, dh),
        "b_K": (L, Hkv, dh),
        "b_V": (L, Hkv, dh),
        "b_O": (L, d),
        "W_in": (L, d, dm),
        "W_out": (L, dm, d),
        "b_in": (L, dm),
        "b_out": (L, d),
        "W_U": (d, V),
        "b_U": (V,),
    }
    for name, shape in shapes.items():
        assert tuple(getattr(model, name).shape) == shape, name
    if style == "gpt2":
        assert tuple(model.W_pos.shape) == (cfg.n_ctx, d)
        with pytest.raises(UnsupportedFeatureError, match="gated_mlp"):
            _ = model.W_gate
        assert block(model, 0).attn.b_Q is not None
    else:
        assert tuple(model.W_gate.shape) == (L, d, dm)
        with pytest.raises(UnsupportedFeatureError, match="positional_embedding_type"):
            _ = model.W_pos
        params = [name.rsplit(".", 1)[-1] for name, _ in model.named_parameters()]
        assert not [name for name in params if name.startswith("b")]
        assert torch.equal(model.b_Q, torch.zeros(L, H, dh))
    assert torch.equal(model.W_Q[1], block(model, 1).attn.W_Q)


def test_tied_embeddings() -> None:
    model = NativeTransformer(NativeConfig.gpt2_style(tie_word_embeddings=True))
    assert torch.equal(model.W_U, model.W_E.T)
    assert "unembed.W_U" not in model.state_dict()
    ids = random_ids(1, 4) % 258  # token 258 is absent from the input
    with torch.no_grad():
        before = model(ids)
        model.embed.W_E[258] += torch.linspace(-1, 1, 64)
        after = model(ids)
    # Only token 258's logit moves: the unembedding reads the same rows as the embedding.
    assert torch.equal(after[..., :258], before[..., :258])
    assert (after[..., 258] - before[..., 258]).abs().min() > 1e-3


@pytest.mark.parametrize("style", STYLES)
def test_readout_reproduces_logits(style: str) -> None:
    model = make_model(style)
    ids = random_ids(2, 5)
    readout = model.readout()
    assert readout.normalization_type == model.cfg.normalization_type
    with torch.no_grad():
        resid = model(ids, stop_at_layer=model.cfg.n_layers)
        if readout.normalization_type == "LN":
            resid = resid - resid.mean(-1, keepdim=True)
        normed = resid / torch.sqrt(resid.pow(2).mean(-1, keepdim=True) + readout.eps)
        assert readout.ln_final_weight is not None
        normed = normed * readout.ln_final_weight
        if readout.ln_final_bias is not None:
            normed = normed + readout.ln_final_bias
        logits = normed @ readout.W_U
        if readout.b_U is not None:
            logits = logits + readout.b_U
        torch.testing.assert_close(logits, model(ids), atol=1e-5, rtol=1e-5)
    assert (readout.b_U is None) == (style == "llama")


def test_model_info() -> None:
    llama = NativeTransformer(NativeConfig.llama_style(n_layers=3))
    info = llama.info
    assert (info.n_layers, info.n_heads, info.kv_heads) == (3, 4, 2)
    assert info.normalization_type == "RMS"
    assert info.positional_embedding_type == "rotary"
    assert info.gated_mlp
    assert info.architecture == "native-llama"
    gpt2 = NativeConfig.gpt2_style().to_model_info()
    assert (gpt2.d_vocab, gpt2.kv_heads, gpt2.architecture) == (259, 4, "native-gpt2")


def test_float64_model_runs() -> None:
    model = make_model("llama").double()
    logits = model(random_ids(2, 4))
    assert logits.dtype == torch.float64


# Configuration


def test_config_unknown_key_suggests_nearest() -> None:
    with pytest.raises(ConfigError, match=r"'n_layer'.*Did you mean 'n_layers'"):
        NativeConfig.from_dict({"n_layer": 3})
    with pytest.raises(ConfigError, match=r"'d_modle'.*Did you mean 'd_model'"):
        NativeConfig.llama_style(d_modle=32)
    with pytest.raises(ConfigError, match=r"'zzz'"):
        NativeConfig.coerce({"zzz": 1})


def test_config_coerce_and_round_trip() -> None:
    cfg = NativeConfig.llama_style(n_layers=1)
    assert NativeConfig.coerce(cfg) is cfg
    assert NativeConfig.coerce(cfg.to_dict()) == cfg
    assert NativeConfig.coerce({"d_model": 32}).d_model == 32
    with pytest.raises(ConfigError, match="mapping"):
        NativeConfig.coerce([("d_model", 32)])  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_layers = 3  # type: ignore[misc]
    assert cfg.has_bias is False
    assert NativeConfig().has_bias is True
    assert NativeConfig(use_bias=False).has_bias is False


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"n_layers": 0}, r"'n_layers' must be a positive int, got 0"),
        ({"d_model": 64.0}, r"'d_model' must be a positive int"),
        ({"n_heads": True}, r"'n_heads' must be a positive int"),
        ({"d_vocab": 100}, r"'d_vocab' must be at least 259"),
        ({"n_key_value_heads": 3}, r"multiple of 'n_key_value_heads' \(3\)"),
        ({"n_key_value_heads": 0}, r"'n_key_value_heads' must be a positive int"),
        ({"positional_embedding_type": "rotary", "d_head": 15}, r"'d_head' must be even"),
        ({"act_fn": "gelu2"}, r"'act_fn' must be one of .*Did you mean 'gelu'"),
        ({"normalization_type": "LayerNorm"}, r"'normalization_type' must be one of"),
        ({"positional_embedding_type": "alibi"}, r"'positional_embedding_type'"),
        ({"init_mode": "kaiming"}, r"'init_mode' must be one of"),
        ({"gated_mlp": 1}, r"'gated_mlp' must be a bool"),
        ({"use_attn_result": "yes"}, r"'use_attn_result' must be a bool"),
        ({"use_bias": 0}, r"'use_bias' must be a bool"),
        ({"eps": 0}, r"'eps' must be a positive number"),
        ({"rotary_base": -1.0}, r"'rotary_base' must be a number from 1 to"),
        ({"seed": -1}, r"'seed' must be a non-negative int"),
    ],
)
def test_config_rejects_bad_values(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        NativeConfig.from_dict(overrides)


F32_MAX = 3.4028234663852886e38


BAD_FLOATS = [
    pytest.param(math.nan, "got nan", id="nan"),
    pytest.param(math.inf, "got inf", id="inf"),
    pytest.param(-math.inf, "got -inf", id="-inf"),
    pytest.param(-1.0, "got -1.0", id="negative"),
    pytest.param(0.0, "got 0.0", id="zero"),
    pytest.param(1e39, "got 1e+39", id="overflows-float32"),
    pytest.param(10**400, "got 100000000000...(401 characters)", id="overflows-float64"),
]


@pytest.mark.parametrize(
    ("value", "got"), [*BAD_FLOATS, pytest.param(1e-50, "got 1e-50", id="rounds-to-0")]
)
def test_config_rejects_eps_that_is_not_a_positive_float32(value: float, got: str) -> None:
    with pytest.raises(ConfigError) as info:
        NativeConfig.llama_style(eps=value)
    message = str(info.value)
    assert "NativeConfig field 'eps' must be a positive number" in message
    assert "from 1.4012985e-45 to 3.4028235e+38" in message
    assert got in message


@pytest.mark.parametrize(
    ("value", "got"), [*BAD_FLOATS, pytest.param(0.5, "got 0.5", id="below-1")]
)
def test_config_rejects_rotary_base_outside_1_to_float32_max(value: float, got: str) -> None:
    with pytest.raises(ConfigError) as info:
        NativeConfig.llama_style(rotary_base=value)
    message = str(info.value)
    assert "NativeConfig field 'rotary_base' must be a number from 1 to 3.4028235e+38" in message
    assert got in message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("eps", F32_MAX),
        ("eps", 1.5e-45),
        ("eps", 1),
        ("rotary_base", 1),
        ("rotary_base", F32_MAX),
        ("rotary_base", 500_000),
    ],
)
def test_config_accepts_the_ends_of_the_float_ranges(field: str, value: float) -> None:
    cfg = NativeConfig.llama_style(**{field: value})
    assert getattr(cfg, field) == value
    ids = random_ids(1, 4)
    assert bool(torch.isfinite(NativeTransformer(cfg)(ids)).all())


@pytest.mark.parametrize("seed", [2**64, -1, 1.0, True])
def test_config_rejects_seeds_the_generator_cannot_take(seed: object) -> None:
    with pytest.raises(ConfigError, match=r"'seed' must be a non-negative int below 2\*\*64"):
        NativeConfig.llama_style(seed=seed)
    assert NativeConfig.llama_style(seed=2**64 - 1).seed == 2**64 - 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"eps": math.nan}, r"'eps' must be a positive number.*got nan"),
        ({"eps": math.inf}, r"'eps'.*got inf"),
        ({"rotary_base": -math.inf}, r"'rotary_base'.*got -inf"),
        ({"eps": 1e-9, "dtype": torch.float16}, r"'eps' \(1e-09\) rounds to 0 in torch\.float16"),
        ({"eps": 1e30, "dtype": torch.float16}, r"'eps' \(1e\+30\) overflows torch\.float16"),
        ({"dtype": torch.int64}, r"dtype must be a floating-point torch\.dtype.*got torch\.int64"),
        ({"dtype": "float16"}, r"dtype must be a floating-point torch\.dtype.*got 'float16'"),
    ],
)
def test_boot_native_refuses_bad_numeric_options_before_building(
    options: dict[str, Any], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tl_core import TransformerBridge

    def no_build(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model was built before the options were checked")

    monkeypatch.setattr(NativeTransformer, "__init__", no_build)
    with pytest.raises(ConfigError, match=message):
        TransformerBridge.boot_native("llama", n_layers=2, **options)


def test_boot_native_half_precision_keeps_a_representable_eps() -> None:
    from tl_core import TransformerBridge

    bridge = TransformerBridge.boot_native("llama", n_layers=2, dtype=torch.bfloat16, eps=1e-6)
    logits = bridge("Finite", intervene={"blocks.0.hook_out": {"op": "suppress"}})
    assert logits.dtype == torch.bfloat16 and bool(torch.isfinite(logits).all())


def test_model_rejects_non_config() -> None:
    with pytest.raises(ConfigError, match=r"NativeConfig\.coerce"):
        NativeTransformer({"n_layers": 1})  # type: ignore[arg-type]
