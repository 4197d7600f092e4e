"""Certification on the hf driver: what is served is what the name promises, checked
against plain transformers and plain torch hooks, never against tl's own equations.

Described families certify clean; architectures nobody described are inferred, certified
and then checked here independently (``hidden_states``, layer inputs caught by a forward
pre-hook, eager ``attentions``, the output projection's input, an edit made by a plain
pre-hook); wrong descriptions must fail certification with the equation named.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from tl_core import ConfigError, HookNameError, TransformerBridge, UserError
from tl_core.certification import Certification
from tl_core.cli import main
from tl_driver_hf import build_bridge_from_module
from tl_driver_hf.adapters import _EXTRA, ArchitectureAdapter, find_adapter, register_adapter
from tl_driver_hf.testing import TINY_FAMILIES, tiny_default_model

# Inferred types, chosen to cover the block forms: sequential (granite), parallel with a
# LayerNorm and a "dense" output projection (phi), a mixture of experts (qwen2_moe), sandwich
# norms with a fused gate/up (glm4), fused qkv with multi-query attention and learned
# positions (gpt_bigcode). Value: (attention module in a layer, its output projection, MLP
# module in a layer), written out here, independently of the driver's inference.
INFERRED: dict[str, tuple[str, str, str]] = {
    "granite": ("self_attn", "o_proj", "mlp"),
    "phi": ("self_attn", "dense", "mlp"),
    "qwen2_moe": ("self_attn", "o_proj", "mlp"),
    "glm4": ("self_attn", "o_proj", "mlp"),
    "gpt_bigcode": ("attn", "c_proj", "mlp"),
}


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_folder(model_type)`` -> a saved tiny float32 model of that type (no tokenizer)."""
    root = tmp_path_factory.mktemp("tiny-inferred")
    written: dict[str, Path] = {}

    def get(model_type: str) -> Path:
        if model_type not in written:
            tiny_default_model(model_type).save_pretrained(root / model_type)
            written[model_type] = root / model_type
        return written[model_type]

    return get


@pytest.fixture
def extra_adapter() -> Iterator[Callable[[ArchitectureAdapter], ArchitectureAdapter]]:
    """``extra_adapter(adapter)`` registers it for this test only."""
    added: list[ArchitectureAdapter] = []

    def add(adapter: ArchitectureAdapter) -> ArchitectureAdapter:
        register_adapter(adapter)
        added.append(adapter)
        return adapter

    yield add
    for adapter in added:
        _EXTRA.remove(adapter)


def _described(family: str) -> ArchitectureAdapter:
    adapter = find_adapter(family)
    assert adapter is not None
    return adapter


def _ids(batch: int = 2, n: int = 7) -> torch.Tensor:
    return torch.randint(4, 500, (batch, n), generator=torch.Generator().manual_seed(1))


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The base model's ``ModuleList`` with one child per hidden layer, found without tl."""
    n = model.config.num_hidden_layers
    found = [m for m in model.base_model.children() if isinstance(m, nn.ModuleList) and len(m) == n]
    assert len(found) == 1, (
        f"expected one ModuleList of {n} layers in the base model, found {len(found)}"
    )
    return found[0]


def _close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = 1e-4) -> None:
    """Equal within ``rtol`` of the larger of 1 and ``max |want|`` (as certification compares)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    allowed = rtol * max(1.0, float(want.detach().abs().max()))
    error = float((got.detach().double() - want.detach().double()).abs().max())
    assert error <= allowed, f"{what}: max abs diff {error:.3e} > {allowed:.3e}"


def _first(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, tuple) else value


def _plain_run(
    model: nn.Module, ids: torch.Tensor, attn: str, o_proj: str, mlp: str
) -> dict[Any, Any]:
    """Plain transformers: logits, hidden_states, eager attentions, and by forward hooks each
    layer's input, each output projection's input, each attention and MLP module's output."""
    seen: dict[Any, torch.Tensor] = {}

    def keep(key: Any, value: torch.Tensor) -> None:
        seen.setdefault(key, value.detach().clone())

    handles = []
    for i, layer in enumerate(_decoder_layers(model)):
        attention = layer.get_submodule(attn)
        handles += [
            layer.register_forward_pre_hook(
                lambda m, a, kw, i=i: keep(("in", i), a[0] if a else kw["hidden_states"]),
                with_kwargs=True,
            ),
            attention.get_submodule(o_proj).register_forward_pre_hook(
                lambda m, a, i=i: keep(("z", i), a[0])
            ),
            attention.register_forward_hook(
                lambda m, a, out, i=i: keep(("attn_out", i), _first(out))
            ),
            layer.get_submodule(mlp).register_forward_hook(
                lambda m, a, out, i=i: keep(("mlp_out", i), _first(out))
            ),
        ]
    try:
        with torch.no_grad():
            out = model(
                input_ids=ids, output_hidden_states=True, output_attentions=True, use_cache=False
            )
    finally:
        for handle in handles:
            handle.remove()
    return {
        "logits": out.logits,
        "hidden_states": out.hidden_states,
        "attentions": out.attentions,
        **seen,
    }


# -- described families ----------------------------------------------------------------


def test_a_described_family_certifies_clean_and_serves_only_real_hooks(
    checkpoint: Callable[[str], Path],
) -> None:
    bridge = TransformerBridge.boot_transformers(str(checkpoint("llama")))
    cert = bridge.certification
    assert isinstance(cert, Certification)
    assert not cert.inferred and cert.family == "llama"
    assert cert.failed == (), "\n".join(c.line() for c in cert.failed)
    assert cert.level == "full"
    served = set(bridge.driver.hook_points)
    assert served <= set(cert.served)
    assert {n: cert.statuses[n].status for n in served} == dict.fromkeys(served, "real")
    # At boot a described family gets tl's own equations over its first blocks; on demand,
    # every check, with plain transformers and plain torch hooks as the references.
    assert cert.description["scope"].startswith("quick")
    assert not any(c.equation.startswith("blocks.2.") for c in cert.checks)
    cert = bridge.driver.certify()
    assert cert.failed == (), "\n".join(c.line() for c in cert.failed)
    assert cert.description["scope"].startswith("every check")
    equations = [c.equation for c in cert.checks]
    assert "logits == the engine's own logits" in equations
    assert "blocks.1.hook_in == the engine's hidden_states[1]" in equations
    assert any(e.startswith("an edit at blocks.{i}.attn.hook_z") for e in equations)


def test_certify_false_skips_the_report_but_serves_the_same_hooks(
    checkpoint: Callable[[str], Path],
) -> None:
    certified = TransformerBridge.boot_transformers(str(checkpoint("llama")))
    bridge = TransformerBridge.boot_transformers(str(checkpoint("llama")), certify=False)
    assert bridge.certification is None and bridge.driver.certification is None
    assert list(bridge.driver.hook_points) == list(certified.driver.hook_points)
    report = bridge.driver.certify()  # on demand
    assert isinstance(report, Certification)
    assert report.level == "full" and report.failed == ()
    assert bridge.certification is None, "certify() on demand reports; it does not change the boot"


def test_a_bfloat16_model_still_certifies(checkpoint: Callable[[str], Path]) -> None:
    bridge = TransformerBridge.boot_transformers(str(checkpoint("llama")), dtype="bfloat16")
    cert = bridge.certification
    assert cert is not None and bridge.driver.hf_model.dtype == torch.bfloat16
    assert cert.failed == (), "\n".join(c.line() for c in cert.failed)
    assert cert.level == "full"
    # bf16 comparisons use a bf16 tolerance, not float32's.
    assert all(c.allowed >= 1e-2 for c in cert.checks if c.equation.startswith("logits"))


# -- inferred architectures --------------------------------------------------------------


@pytest.mark.parametrize("model_type", list(INFERRED))
def test_an_inferred_architecture_boots_with_one_warning(
    model_type: str, tiny_folder: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tl_driver_hf"):
        bridge = TransformerBridge.boot_transformers(str(tiny_folder(model_type)))
    cert = bridge.certification
    assert cert is not None and cert.inferred and cert.family == "inferred"
    assert cert.failed == (), "\n".join(c.line() for c in cert.failed)
    assert cert.level == "full"
    warnings = [
        r for r in caplog.records if r.name == "tl_driver_hf" and r.levelno >= logging.WARNING
    ]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "inferred from its modules" in warnings[0].getMessage()
    assert "inferred from the module tree" in cert.format()


@pytest.mark.parametrize("model_type", list(INFERRED))
def test_an_inferred_architecture_matches_plain_transformers(
    model_type: str, tiny_folder: Callable[[str], Path]
) -> None:
    folder = tiny_folder(model_type)
    attn, o_proj, mlp = INFERRED[model_type]
    bridge = TransformerBridge.boot_transformers(str(folder))
    reference = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    ids = _ids()
    plain = _plain_run(reference, ids, attn, o_proj, mlp)
    logits, cache = bridge.run_with_cache(ids)
    _close(logits, plain["logits"], "logits")
    n = reference.config.num_hidden_layers
    assert bridge.cfg.n_layers == n
    for i in range(n):
        _close(
            cache[f"blocks.{i}.hook_in"],
            plain["hidden_states"][i],
            f"blocks.{i}.hook_in vs hidden_states[{i}]",
        )
        _close(
            cache[f"blocks.{i}.hook_in"],
            plain[("in", i)],
            f"blocks.{i}.hook_in vs the layer's input",
        )
        # Attention sites against eager transformers: its attention weights, the output
        # projection's input, the attention module's output (before any sandwich norm).
        _close(
            cache[f"blocks.{i}.attn.hook_pattern"],
            plain["attentions"][i],
            f"blocks.{i}.attn.hook_pattern",
        )
        z = cache[f"blocks.{i}.attn.hook_z"]
        _close(z.flatten(-2), plain[("z", i)], f"blocks.{i}.attn.hook_z vs {o_proj}'s input")
        _close(
            cache[f"blocks.{i}.attn.hook_out"],
            plain[("attn_out", i)],
            f"blocks.{i}.attn.hook_out vs {attn}'s output",
        )
        _close(
            cache[f"blocks.{i}.mlp.hook_out"],
            plain[("mlp_out", i)],
            f"blocks.{i}.mlp.hook_out vs {mlp}'s output",
        )


@pytest.mark.parametrize("model_type", list(INFERRED))
def test_an_add_at_an_inferred_block_input_is_a_plain_pre_hook(
    model_type: str, tiny_folder: Callable[[str], Path]
) -> None:
    folder = tiny_folder(model_type)
    bridge = TransformerBridge.boot_transformers(str(folder))
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = _ids()
    vec = torch.randn(bridge.cfg.d_model, generator=torch.Generator().manual_seed(2))

    def add(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:
            return (args[0] + vec, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] + vec}

    with torch.no_grad():
        before = reference(input_ids=ids, use_cache=False).logits
        handle = _decoder_layers(reference)[1].register_forward_pre_hook(add, with_kwargs=True)
        try:
            want = reference(input_ids=ids, use_cache=False).logits
        finally:
            handle.remove()
    got = bridge(ids, intervene={"blocks.1.hook_in": {"op": "add", "value": vec.tolist()}})
    assert float((want - before).abs().max()) > 1e-2, (
        "the edit must move the logits for the test to mean anything"
    )
    _close(got, want, "logits after an add at blocks.1.hook_in")


def test_an_inferred_mixture_of_experts_routes_as_plain_transformers(
    tiny_folder: Callable[[str], Path],
) -> None:
    folder = tiny_folder("qwen2_moe")
    bridge = TransformerBridge.boot_transformers(str(folder))
    served = set(bridge.driver.hook_points)
    # No single layer of neurons: the per-neuron sites are not served, and say why.
    for suffix in ("hook_pre", "hook_pre_linear", "hook_post"):
        name = f"blocks.0.mlp.{suffix}"
        assert name not in served
        with pytest.raises(HookNameError, match=rf"'{re.escape(name)}'"):
            bridge.run_with_cache(_ids(1), names_filter=[name])
    # Routing sites, where served, hold what the router module returns in plain transformers.
    routing = [
        f"blocks.0.mlp.hook_{s}" for s in ("router_logits", "expert_weights", "expert_indices")
    ]
    if not set(routing) & served:
        return
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    router = _decoder_layers(reference)[0].get_submodule(
        "mlp.gate"
    )  # (logits, top-k weights, top-k indices)
    seen: list[tuple[torch.Tensor, ...]] = []
    handle = router.register_forward_hook(lambda m, a, out: seen.append(out))
    ids = _ids()
    try:
        with torch.no_grad():
            reference(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    logits, top_weights, top_indices = (t.reshape(*ids.shape, -1) for t in seen[0])
    _, cache = bridge.run_with_cache(ids, names_filter=[n for n in routing if n in served])
    if routing[0] in served:
        _close(cache[routing[0]], logits, "hook_router_logits vs the router's logits")
    if routing[2] in served:
        assert torch.equal(cache[routing[2]], top_indices), (
            "hook_expert_indices vs the router's choice"
        )
    if routing[1] in served:
        # b p e: each expert's weight, 0 for experts not chosen.
        dense = torch.zeros_like(logits).scatter(-1, top_indices, top_weights)
        _close(cache[routing[1]], dense, "hook_expert_weights vs the router's top-k weights")


def test_a_shared_expert_is_served_as_plain_hooks_see_it_and_edited_as_they_edit(
    tiny_folder: Callable[[str], Path],
) -> None:
    """Qwen2-MoE's shared expert, its gate and the routed experts' sum hold what plain
    forward hooks on those modules see, and an add at the shared expert's output equals the
    same add by a plain forward hook there."""
    folder = tiny_folder("qwen2_moe")
    bridge = TransformerBridge.boot_transformers(str(folder))
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    mlp = _decoder_layers(reference)[1].get_submodule("mlp")
    modules = {
        "experts.hook_out": (mlp.experts, False),
        "shared_expert.hook_pre": (mlp.shared_expert.gate_proj, False),
        "shared_expert.hook_pre_linear": (mlp.shared_expert.up_proj, False),
        "shared_expert.hook_post": (mlp.shared_expert.down_proj, True),
        "shared_expert.hook_out": (mlp.shared_expert, False),
        "shared_expert.hook_gate": (mlp.shared_expert_gate, False),
    }
    ids = _ids()
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for suffix, (module, on_input) in modules.items():
        if on_input:
            handles.append(
                module.register_forward_pre_hook(
                    lambda m, a, s=suffix: seen.setdefault(s, a[0].clone())
                )
            )
        else:
            handles.append(
                module.register_forward_hook(
                    lambda m, a, out, s=suffix: seen.setdefault(s, out.clone())
                )
            )
    try:
        with torch.no_grad():
            reference(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    names = [f"blocks.1.mlp.{suffix}" for suffix in modules]
    _, cache = bridge.run_with_cache(ids, names_filter=names)
    for suffix in modules:
        _close(cache[f"blocks.1.mlp.{suffix}"], seen[suffix].reshape(*ids.shape, -1), suffix)
    assert bridge.certification.statuses["blocks.1.mlp.shared_expert.hook_out"].status == "real"

    vector = torch.linspace(-1.0, 1.0, 64)
    edited = bridge(
        ids,
        intervene={"blocks.1.mlp.shared_expert.hook_out": {"op": "add", "value": vector.tolist()}},
    )
    handle = mlp.shared_expert.register_forward_hook(lambda m, a, out: out + vector)
    try:
        with torch.no_grad():
            want = reference(input_ids=ids, use_cache=False).logits
    finally:
        handle.remove()
    assert float((want - bridge(ids)).abs().max()) > 1e-2, (
        "the edit must move the logits for the test to mean anything"
    )
    _close(edited, want, "logits after an add at the shared expert's output")


def test_a_norm_that_keeps_its_epsilon_in_code_is_measured_and_served(
    tiny_folder: Callable[[str], Path],
) -> None:
    """OLMo's LayerNorm has no weight and no epsilon attribute (1e-5 is written in its
    forward): the driver measures the epsilon and serves the norms' scale and pre-weight
    value, equal to a LayerNorm computed here with the epsilon read from transformers'
    source."""
    bridge = TransformerBridge.boot_transformers(str(tiny_folder("olmo")), certify=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_folder("olmo")).eval()
    ids = _ids()
    names = [
        "blocks.1.ln2.hook_in",
        "blocks.1.ln2.hook_scale",
        "blocks.1.ln2.hook_normalized",
        "ln_final.hook_normalized",
        "ln_final.hook_in",
    ]
    _, cache = bridge.run_with_cache(ids, names_filter=names)
    for prefix in ("blocks.1.ln2", "ln_final"):
        x = cache[f"{prefix}.hook_in"].double()
        want = torch.nn.functional.layer_norm(x, x.shape[-1:], eps=1e-5)
        _close(cache[f"{prefix}.hook_normalized"], want, f"{prefix}.hook_normalized")
    x = cache["blocks.1.ln2.hook_in"].double()
    _close(
        cache["blocks.1.ln2.hook_scale"],
        (x.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt(),
        "ln2.hook_scale",
    )
    with torch.no_grad():
        normed = model.model.layers[1].post_attention_layernorm(cache["blocks.1.ln2.hook_in"])
    _close(cache["blocks.1.ln2.hook_normalized"], normed, "the module's own output")


def test_certify_false_is_refused_for_an_inferred_architecture(
    tiny_folder: Callable[[str], Path],
) -> None:
    with pytest.raises(
        UserError, match=r"certify=False turns certification off for described families only"
    ):
        TransformerBridge.boot_transformers(str(tiny_folder("granite")), certify=False)


# -- state-space layers ---------------------------------------------------------------


def _assert_residual_only(bridge: TransformerBridge, folder: Path) -> None:
    """Residual level, nothing inside a block served, and the residual stream is right."""
    cert = bridge.certification
    assert cert is not None and cert.inferred and cert.level == "residual"
    served = set(bridge.driver.hook_points)
    inside = sorted(n for n in served if n.startswith("blocks.") and n.count(".") > 2)
    assert inside == [], f"no attention/MLP/norm site of a block may be served: {inside}"
    assert {f"blocks.{i}.hook_in" for i in range(bridge.cfg.n_layers)} <= served
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    layers = _decoder_layers(reference)
    inputs: dict[int, torch.Tensor] = {}

    def keep(i: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        inputs.setdefault(i, (args[0] if args else kwargs["hidden_states"]).clone())

    handles = [
        layer.register_forward_pre_hook(lambda m, a, kw, i=i: keep(i, a, kw), with_kwargs=True)
        for i, layer in enumerate(layers)
    ]
    ids = _ids()
    try:
        with torch.no_grad():
            want = reference(input_ids=ids, use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
    logits, cache = bridge.run_with_cache(ids)
    _close(logits, want, "logits")
    for i in range(len(layers)):
        _close(cache[f"blocks.{i}.hook_in"], inputs[i], f"blocks.{i}.hook_in vs the layer's input")


def test_a_hybrid_state_space_model_is_served_at_the_residual_level(
    tiny_folder: Callable[[str], Path],
) -> None:
    # Two Jamba layers are both Mamba layers (attention comes every 8th layer from the 4th).
    folder = tiny_folder("jamba")
    bridge = TransformerBridge.boot_transformers(str(folder))
    _assert_residual_only(bridge, folder)
    cert = bridge.certification
    assert cert is not None
    for name in ("blocks.0.attn.hook_pattern", "blocks.0.attn.hook_out", "blocks.0.mlp.hook_out"):
        assert cert.statuses[name].status in ("structurally_absent", "uncertified")
        with pytest.raises(HookNameError, match=re.escape(bridge.driver.absent_reasons[name])):
            bridge.run_with_cache(_ids(1), names_filter=[name])


def test_mamba_serves_its_mixer_as_plain_hooks_see_it(tiny_folder: Callable[[str], Path]) -> None:
    folder = tiny_folder("mamba")
    bridge = TransformerBridge.boot_transformers(str(folder))
    cert, arch = bridge.certification, bridge.architecture
    assert cert is not None and cert.inferred and arch is not None and arch.block == "mixer"
    served = set(bridge.driver.hook_points)
    inside = {n.split(".", 2)[2] for n in served if n.startswith("blocks.") and n.count(".") > 2}
    assert inside == {"mixer.hook_in", "mixer.hook_out"} | {
        f"ln1.hook_{s}" for s in ("in", "scale", "normalized", "out")
    }
    assert "ok   blocks.1.hook_out == blocks.1.hook_in + blocks.1.mixer.hook_out" in cert.format(
        verbose=True
    )
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    seen: dict[tuple[str, int], torch.Tensor] = {}

    def keep(key: tuple[str, int], value: torch.Tensor) -> None:
        seen.setdefault(key, value.detach().clone())

    handles = []
    for i, layer in enumerate(_decoder_layers(reference)):
        handles += [
            layer.mixer.register_forward_pre_hook(lambda m, a, kw, i=i: keep(("in", i), a[0] if a else kw["hidden_states"]), with_kwargs=True),
            layer.mixer.register_forward_hook(lambda m, a, out, i=i: keep(("out", i), _first(out))),
        ]  # fmt: skip
    try:
        with torch.no_grad():
            reference(input_ids=_ids(), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    _, cache = bridge.run_with_cache(_ids(), names_filter=lambda n: ".mixer." in n)
    for i in range(bridge.cfg.n_layers):
        _close(cache[f"blocks.{i}.mixer.hook_in"], seen["in", i], f"mixer {i} input")
        _close(cache[f"blocks.{i}.mixer.hook_out"], seen["out", i], f"mixer {i} output")
    # An edit of the mixer's output is a plain forward hook adding to it.
    delta = torch.randn(bridge.cfg.d_model, generator=torch.Generator().manual_seed(2))
    handle = _decoder_layers(reference)[0].mixer.register_forward_hook(
        lambda m, a, out: _first(out) + delta
    )
    try:
        with torch.no_grad():
            want = reference(input_ids=_ids(), use_cache=False).logits
    finally:
        handle.remove()
    got = bridge.forward(
        _ids(), intervene={"blocks.0.mixer.hook_out": {"op": "add", "value": delta.tolist()}}
    )
    _close(got, want, "logits with the mixer edit")


def test_a_description_naming_the_norm_as_the_mixer_fails_the_block_equation(
    tiny_folder: Callable[[str], Path],
) -> None:
    from tl_driver_hf._driver import HFDriver

    good = TransformerBridge.boot_transformers(str(tiny_folder("mamba"))).driver
    wrong = dataclasses.replace(good.adapter, mixer=good.adapter.ln1)
    report = HFDriver(good.hf_model, wrong, good.tokenizer, info=good.info).certify()
    status = report.statuses["blocks.0.mixer.hook_out"]
    assert status.status == "uncertified", status
    assert "blocks.0.hook_out == blocks.0.hook_in + blocks.0.mixer.hook_out" in status.reason


class _Trials:
    """Boot trials whose outcomes are given: tl's attention raises, the model's own does not
    reproduce the residual stream, the residual stream alone holds."""

    def __init__(self) -> None:
        self.candidate_hooks = ["blocks.0.hook_in", "blocks.0.attn.hook_out"]
        self.tried: list[tuple[bool, Any]] = []

    def certify_serving(self, names: Any, *, hooked_attention: bool, **_: Any) -> Any:
        self.tried.append((hooked_attention, names))
        if hooked_attention:
            raise RuntimeError("a family's extra input")
        if names is None:
            wrong = SimpleNamespace(
                equation="blocks.0.hook_in == the engine's hidden_states[0]",
                on_residual=True,
                line=lambda: "FAIL blocks.0.hook_in == the engine's hidden_states[0]",
            )
            return SimpleNamespace(residual_holds=False, failed=(wrong,))
        return SimpleNamespace(residual_holds=True, failed=())


def test_an_inferred_model_served_with_less_says_why_the_fuller_trials_failed() -> None:
    """The boot tries tl's attention, then the model's, then the residual stream alone; the
    decision keeps, for the boot log, why each fuller configuration was passed over."""
    from tl_driver_hf._certification._boot_certification import BootFacts, _first_certifiable

    trials = _Trials()
    facts = BootFacts("m", "ToyForMaskedLM", "inferred", "model.layers", inferred=True)
    decision = _first_certifiable(trials, facts)  # type: ignore[arg-type]
    assert [hooked for hooked, _ in trials.tried] == [True, False, False]
    assert decision.served == ["blocks.0.hook_in"] and not decision.hooked_attention
    assert decision.passed_over == [
        "every hook with tl's attention: RuntimeError: a family's extra input",
        "with the model's own attention: FAIL blocks.0.hook_in == the engine's hidden_states[0]",
    ]


# -- wrong descriptions must fail certification --------------------------------------------


def test_attention_and_mlp_swapped_are_not_served(
    checkpoint: Callable[[str], Path],
    extra_adapter: Callable[[ArchitectureAdapter], ArchitectureAdapter],
) -> None:
    # Attention's module is the MLP (its down projection as the "output projection"), the
    # MLP's module is attention.
    swapped = dataclasses.replace(
        _described("llama"), attn="mlp", q=None, k=None, v=None, qkv=None, o="down_proj",
        mlp="self_attn", gate=None, up=None, down=None,
        description=dataclasses.replace(
            _described("llama").description, positions="none", mlp_variant="dense"
        ),
    )  # fmt: skip
    extra_adapter(swapped)
    bridge = TransformerBridge.boot_transformers(str(checkpoint("llama")))
    cert = bridge.certification
    assert cert is not None and cert.failed and cert.level == "residual"
    served = set(bridge.driver.hook_points)
    for i in range(bridge.cfg.n_layers):
        for site in ("attn.hook_in", "attn.hook_out", "mlp.hook_in", "mlp.hook_out", "ln2.hook_in"):
            assert f"blocks.{i}.{site}" not in served
    # The residual stream itself holds, so it is still served.
    assert {"blocks.0.hook_in", "blocks.1.hook_out", "unembed.hook_out"} <= served
    equation = "blocks.0.ln2.hook_in == blocks.0.hook_in + blocks.0.attn.hook_out"
    assert (
        bridge.driver.absent_reasons["blocks.0.attn.hook_out"] == f"uncertified: failed: {equation}"
    )
    with pytest.raises(
        HookNameError,
        match=r"cannot fire 'blocks\.0\.attn\.hook_out'.*failed: " + re.escape(equation),
    ):
        bridge.run_with_cache(_ids(1), names_filter=["blocks.0.attn.hook_out"])
    with pytest.raises(HookNameError, match=re.escape(equation)):
        bridge(_ids(1), intervene={"blocks.0.attn.hook_out": {"op": "suppress"}})


def _without_sandwich_norms() -> ArchitectureAdapter:
    """Gemma 2's adapter, described as having no norm after its sublayers (wrong)."""
    gemma2 = _described("gemma2")
    description = dataclasses.replace(
        gemma2.description, norm_after_attn=False, norm_after_mlp=False
    )
    return dataclasses.replace(gemma2, ln1_post=None, ln2_post=None, description=description)


def test_sandwich_norms_left_out_fail_the_block_equations(
    checkpoint: Callable[[str], Path],
    extra_adapter: Callable[[ArchitectureAdapter], ArchitectureAdapter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    extra_adapter(_without_sandwich_norms())
    with caplog.at_level(logging.WARNING, logger="tl_driver_hf"):
        bridge = TransformerBridge.boot_transformers(str(checkpoint("gemma2")))
    reasons = bridge.driver.absent_reasons
    assert reasons["blocks.0.attn.hook_out"] == (
        "uncertified: failed: blocks.0.ln2.hook_in == blocks.0.hook_in + blocks.0.attn.hook_out"
    )
    assert reasons["blocks.0.mlp.hook_out"] == (
        "uncertified: failed: blocks.0.hook_out == blocks.0.ln2.hook_in + blocks.0.mlp.hook_out"
    )
    assert "blocks.0.attn.hook_out" not in bridge.driver.hook_points
    assert any("failed certification and are not served" in r.getMessage() for r in caplog.records)


def test_a_wrong_layer_list_is_refused_naming_the_residual_stream(
    checkpoint: Callable[[str], Path],
    extra_adapter: Callable[[ArchitectureAdapter], ArchitectureAdapter],
) -> None:
    folder = checkpoint("llama")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    # transformers installs its hidden_states recorders on the first call, walking every
    # path to a layer: run once before the second path exists, or each layer records twice.
    with torch.no_grad():
        model(input_ids=_ids(1), output_hidden_states=True)
    model.model.reversed_layers = nn.ModuleList(list(model.model.layers)[::-1])
    extra_adapter(dataclasses.replace(_described("llama"), layers="model.reversed_layers"))
    with pytest.raises(ConfigError, match=r"residual stream fails certification") as raised:
        build_bridge_from_module(model, tokenizer=str(folder))
    # The boot of a described family checks tl's own capture: the chain breaks where the
    # wrong list hands one layer's output to a layer that does not read it.
    assert "FAIL blocks.0.hook_out == blocks.1.hook_in" in str(raised.value)


# -- the engine-independent description ---------------------------------------------------

#: family -> (block form, norm kind, positions, attention variant, qk-norm, MLP variant),
#: written out from each architecture's paper/reference code, not from the adapters.
DESCRIBED_FORMS: dict[str, tuple[str, str, str, str, str, str]] = {
    "gpt2": ("sequential", "layernorm", "learned", "mha", "none", "dense"),
    "gptj": ("parallel_shared_norm", "layernorm", "rotary", "mha", "none", "dense"),
    "gpt_neox": ("parallel", "layernorm", "rotary", "mha", "none", "dense"),
    "bloom": ("sequential", "layernorm", "alibi", "mha", "none", "dense"),
    "falcon": ("parallel_shared_norm", "layernorm", "rotary", "mqa", "none", "dense"),
    "llama": ("sequential", "rms", "rotary", "gqa", "none", "gated"),
    "qwen3": ("sequential", "rms", "rotary", "gqa", "per_head", "gated"),
    "gemma2": ("sandwich", "rms_plus_one", "rotary", "gqa", "none", "gated"),
    "olmo2": ("post_norm", "rms_weight_first", "rotary", "gqa", "across_heads", "gated"),
    "mixtral": ("sequential", "rms", "rotary", "gqa", "none", "moe"),
}


@pytest.mark.parametrize("family", list(DESCRIBED_FORMS))
def test_each_block_form_is_described_as_its_architecture_is(
    family: str, checkpoint: Callable[[str], Path]
) -> None:
    bridge = TransformerBridge.boot_transformers(str(checkpoint(family)))
    arch = bridge.architecture
    assert arch is not None
    assert arch.attention is not None and arch.mlp is not None
    got = (
        arch.block,
        arch.norm.kind,
        arch.positions,
        arch.attention.variant,
        arch.attention.qk_norm,
        arch.mlp.variant,
    )
    assert got == DESCRIBED_FORMS[family]
    assert arch.n_layers == bridge.cfg.n_layers and arch.attention.n_heads == bridge.cfg.n_heads
    assert arch.embed_norm == (family == "bloom")
    assert arch.embed_scaled == (family == "gemma2")
    # The report shows the description, and holds the same object.
    report = bridge.certification
    assert report is not None and report.architecture == arch
    assert f"block: {arch.block.replace('_', ' ')} (" in report.format()


def test_config_facts_reach_the_description(checkpoint: Callable[[str], Path]) -> None:
    gemma2 = TransformerBridge.boot_transformers(str(checkpoint("gemma2")))
    config = gemma2.driver.hf_model.config
    arch = gemma2.architecture
    assert arch is not None and arch.attention is not None
    assert arch.attention.softcap == config.attn_logit_softcapping
    assert arch.logit_softcap == config.final_logit_softcapping
    assert arch.norm.eps == config.rms_norm_eps
    sliding = tuple(i for i, kind in enumerate(config.layer_types) if kind == "sliding_attention")
    assert (
        arch.attention.window == config.sliding_window and arch.attention.windowed_layers == sliding
    )
    neox = TransformerBridge.boot_transformers(str(checkpoint("gpt_neox"))).architecture
    assert neox is not None and neox.rotary_fraction == neox_fraction(checkpoint("gpt_neox"))


def neox_fraction(folder: Path) -> float:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("partial_rotary_factor", getattr(config, "rotary_pct", 1.0)))


#: Hand-written families that inference alone serves less well, with what it misses (from
#: the module tree alone: rotary inside the attention module, a per-head fused qkv,
#: attention computed inside the module, post-LN switches, embedding norms). Every other
#: family's row is redundant for serving: inference finds the same description and
#: certifies the same hooks (the row still carries hub ids, known checkpoints and
#: TransformerLens compatibility facts).
NEEDS_ROW: dict[str, str] = {
    "gpt_neo": "attention computed inside the module: no q/k/pattern sites",
    "gptj": "rotary applied inside the module: taken for no positions",
    "gpt_neox": "per-head fused qkv: no q/k/v sites",
    "opt": "projections inline in the layer: residual level only",
    "bloom": "embedding norm and ALiBi inside the module: residual level only",
    "falcon": "attention computed inside the module: no q/k/pattern sites",
    "olmo2": "the weight-first RMS rule equals the plain one in float32, so inference names it 'rms'",
}


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_inference_reproduces_each_hand_written_row_or_is_listed(
    family: str, checkpoint: Callable[[str], Path]
) -> None:
    from tl_driver_hf._driver import HFDriver
    from tl_driver_hf._options import BootOptions

    folder = str(checkpoint(family))
    described = TransformerBridge.boot_transformers(folder).driver
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    inferred = HFDriver._assemble(
        model, None, described.tokenizer, BootOptions(model_name=folder), folder
    )
    same = described.architecture.differences(inferred.architecture) == [] and set(
        described.hook_points
    ) == set(inferred.hook_points)
    if family in NEEDS_ROW:
        assert not same, f"inference now serves {family} as its row does: drop it from NEEDS_ROW"
        assert set(inferred.hook_points) <= set(described.hook_points)  # less, never other
    else:
        assert described.architecture.differences(inferred.architecture) == []
        assert set(described.hook_points) == set(inferred.hook_points)


def test_an_inferred_architecture_is_described_by_what_inference_found(
    tiny_folder: Callable[[str], Path],
) -> None:
    from transformers import AutoConfig

    moe = TransformerBridge.boot_transformers(str(tiny_folder("qwen2_moe"))).architecture
    config = AutoConfig.from_pretrained(tiny_folder("qwen2_moe"))
    assert moe is not None and moe.mlp is not None
    assert (moe.block, moe.mlp.variant, moe.mlp.n_experts, moe.mlp.experts_per_token) == (
        "sequential", "moe", config.num_experts, config.num_experts_per_tok,
    )  # fmt: skip
    assert (moe.mlp.d_mlp, moe.mlp.d_shared_expert) == (
        config.moe_intermediate_size,
        config.shared_expert_intermediate_size,
    )
    phi = TransformerBridge.boot_transformers(str(tiny_folder("phi"))).architecture
    assert phi is not None and phi.block == "parallel_shared_norm" and phi.norm.kind == "layernorm"
    bigcode = TransformerBridge.boot_transformers(str(tiny_folder("gpt_bigcode"))).architecture
    assert bigcode is not None and bigcode.attention is not None
    assert (bigcode.positions, bigcode.attention.variant) == ("learned", "mqa")


def test_state_space_and_hybrid_models_are_described_by_their_block_form(
    tiny_folder: Callable[[str], Path],
) -> None:
    hybrid = TransformerBridge.boot_transformers(str(tiny_folder("jamba"))).architecture
    assert hybrid is not None
    assert (hybrid.block, hybrid.attention, hybrid.mlp) == ("opaque", None, None)
    assert "attention" not in hybrid.facts() and hybrid.facts()["block"].startswith("opaque (")
    mamba = TransformerBridge.boot_transformers(str(tiny_folder("mamba"))).architecture
    assert mamba is not None and (mamba.block, mamba.attention, mamba.mlp) == ("mixer", None, None)
    # Measured on its modules: the norms' rule and the final norm; not read: the positions.
    assert (mamba.norm.kind, mamba.final_norm, mamba.positions) == ("rms", True, "unknown")


def test_bart_s_decoder_is_described_by_what_tl_established(tmp_path: Path) -> None:
    # BART's decoder as a causal LM: post-LN LayerNorm blocks with learned positions. It was
    # once described with RMS norms, no positions and no final norm, none of which tl had
    # established; then read from outside only, every such fact "unknown". Now its blocks
    # are read inside and their norms measured; its position table takes the token ids and
    # offsets its own positions, which tl does not read, so positions stay "unknown".
    from transformers import BartConfig, BartForCausalLM

    config = BartConfig(
        vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_position_embeddings=64, architectures=["BartForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(0)
    BartForCausalLM(config).eval().save_pretrained(tmp_path)
    bridge = TransformerBridge.boot_transformers(str(tmp_path))
    layer = bridge.driver.hf_model.model.decoder.layers[0]
    assert isinstance(layer.self_attn_layer_norm, nn.LayerNorm)  # transformers: not RMS
    arch = bridge.architecture
    assert arch is not None and arch.block == "post_residual_norm"
    assert (arch.norm.kind, arch.positions, arch.final_norm) == ("layernorm", "unknown", False)
    assert (bridge.cfg.normalization_type, bridge.cfg.positional_embedding_type) == (
        "LN", "unknown"
    )  # fmt: skip
    assert not any(n.startswith("pos_embed.") for n in bridge.driver.hook_points)
    cert = bridge.certification
    assert cert is not None and cert.level == "full" and not cert.failed


# -- tl certify ---------------------------------------------------------------------------


def test_cli_certify_reports_a_described_folder(
    checkpoint: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["certify", str(checkpoint("llama"))]) == 0
    out = capsys.readouterr().out
    assert "architecture: described (llama); served at level 'full'" in out
    assert "  block: sequential (" in out and "  attention: gqa, " in out
    assert "FAIL" not in out


def test_cli_certify_reports_an_inferred_folder(
    tiny_folder: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["certify", str(tiny_folder("granite")), "-v"]) == 0
    out = capsys.readouterr().out
    assert "architecture: inferred from the module tree; served at level 'full'" in out
    assert "ok   blocks.0.hook_in == the engine's hidden_states[0]" in out  # -v lists passed checks


def test_cli_certify_exits_1_when_a_check_fails(
    checkpoint: Callable[[str], Path],
    extra_adapter: Callable[[ArchitectureAdapter], ArchitectureAdapter],
    capsys: pytest.CaptureFixture[str],
) -> None:
    extra_adapter(_without_sandwich_norms())
    assert main(["certify", str(checkpoint("gemma2"))]) == 1
    out = capsys.readouterr().out
    # The boot refused those sites; the report names the equation as their reason.
    assert "failed: blocks.0.ln2.hook_in == blocks.0.hook_in + blocks.0.attn.hook_out" in out


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_described_family_passes_every_check(
    family: str, checkpoint: Callable[[str], Path]
) -> None:
    """On demand every check runs (plain transformers as the reference, edits against plain
    torch hooks, weights): each hand-written description holds on its tiny checkpoint."""
    bridge = TransformerBridge.boot_transformers(str(checkpoint(family)))
    report = bridge.driver.certify()
    assert report.failed == (), "\n".join(c.line() for c in report.failed)
    assert all(w.status == "real" for w in report.weights.values())
