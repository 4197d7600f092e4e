"""Parity: every served hook, logits, specs and generation against the hf driver, with
the engine compiled (the driver's default on vLLM's CPU build) and equal to an eager engine.

The reference is the project's hf driver, through the same ``Driver.forward`` call (its
sites fix the tensor, layout and convention of every name); greedy generation is checked
against plain transformers with the specs hooked in (``_tlv_reference``), or prompt by
prompt on the hf driver for the families that reference does not map (``_tlv_hf_reference``).
Two engines per family (module scope), float32, a 32-token step so the 70-token prompt is
prefilled in chunks across steps, next to shorter prompts that finish earlier: the default
(compiled) one, checked against the hf driver within the float32 band, and an eager one
(``enforce_eager=True``) the compiled engine must equal within ``COMPILED_RTOL`` in every
comparison. Runs that only read the residual stream and logits and add to the residual
stream stay inside the compiled graph; every other run takes the compiled engine's eager
forward. Mistral and Gemma 3 get a 16-token sliding window (the prompts are longer, so the
window cuts), StableLM qkv biases.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from _tlv_hf_reference import DriverReference  # noqa: E402
from _tlv_reference import Reference  # noqa: E402
from _tlv_support import (  # noqa: E402
    COMPILED_RTOL,
    ENGINE_OPTIONS,
    ENGINE_SIZES,
    RESIDUAL_SITES,
    check,
    compare_modes,
    eager_ratio,
    layer_calls,
    rounding_ratio,
)

from tl_core import RemoteBridge, TransformerBridge  # noqa: E402
from tl_driver_vllm._driver_side._namespace import INPUT_SITES  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: Family -> config overrides of its tiny checkpoint.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": 16},
    "gemma": {},
    "gemma2": {},
    "gemma3": {"sliding_window": 16},
    "gpt2": {},
    "phi3": {},
    "mixtral": {},
    "stablelm": {"use_qkv_bias": True},
    # Block shapes beyond Llama's: parallel blocks with one norm (GPT-J, Falcon-7B) or two
    # (GPT-NeoX), learned positions with an offset (OPT), ALiBi and an embedding norm
    # (BLOOM), no pre-norms and flat QK-norms (OLMo 2); GPT-NeoX and OLMo 2 run on vLLM's
    # Transformers backend.
    "gptj": {},
    "opt": {},
    "bloom": {},
    "falcon": {},
    "gpt_neox": {},
    "olmo2": {},
}
#: Families built from their default transformers configs. Mixtures of experts with rows of
#: their own (Qwen 2/3-MoE, OLMoE, Granite-MoE, gpt-oss); then architectures without a vLLM row: each
#: runs on vLLM's Transformers backend, placed by the hf driver's description (written for
#: GPT-NeoX and OLMo 2 above; inferred and certified for these). Granite, Cohere and GLM-4
#: have vLLM model classes of their own; tl asks vLLM for its backend instead.
DEFAULT_CONFIG_FAMILIES = (
    "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "gpt_oss",
    "phi", "starcoder2", "olmo", "olmo3", "smollm3", "helium", "seed_oss", "ministral", "granite", "cohere", "cohere2",
    "glm4", "exaone4", "gpt_bigcode",
)  # fmt: skip
#: Families whose generation reference is plain transformers hooked by ``_tlv_reference``.
TRANSFORMERS_REFERENCE = frozenset(
    {
        "llama",
        "qwen2",
        "qwen3",
        "mistral",
        "gemma",
        "gemma2",
        "gemma3",
        "gpt2",
        "phi3",
        "mixtral",
        "stablelm",
    }
)
#: Every comparison passes when vLLM's error against the hf driver in float64 is within
#: ``VLLM_FACTOR`` times the float32 hf driver's own (the report holds error / allowed).
WITHIN = 1.0
LENGTHS = [9, 70, 3, 17, 33, 1, 24]


@dataclass
class Engines:
    """One family's checkpoint on vLLM (compiled, and eager) and on the hf driver, in float32
    and float64 (the exact run every float32 result is measured against); all serve
    hook_result."""

    vllm: Any
    eager: Any
    hf: Any
    exact: Any
    ref: Reference | DriverReference
    prompts: list[list[int]]


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module", params=[*sorted(FAMILIES), *DEFAULT_CONFIG_FAMILIES])
def family(
    request: pytest.FixtureRequest, checkpoint: Any, default_checkpoint: Any
) -> Iterator[Engines]:
    if request.param in FAMILIES:
        folder = checkpoint(request.param, **FAMILIES[request.param])
    else:
        folder = default_checkpoint(request.param)
    bridge = RemoteBridge.boot_vllm(folder, dtype="float32", use_attn_result=True, **ENGINE_SIZES)
    eager: RemoteBridge | None = None
    try:
        eager = RemoteBridge.boot_vllm(
            folder, dtype="float32", use_attn_result=True, **ENGINE_OPTIONS
        )
        assert bridge.driver.compiled and not eager.driver.compiled
        _transformers_class_untouched(folder)
        hf = TransformerBridge.boot_transformers(
            str(folder), dtype=torch.float32, use_attn_result=True
        )
        exact = TransformerBridge.boot_transformers(
            str(folder), dtype=torch.float64, use_attn_result=True
        )
        ref = (
            Reference(folder)
            if request.param in TRANSFORMERS_REFERENCE
            else DriverReference(hf.driver)
        )
        yield Engines(
            bridge.driver, eager.driver, hf.driver, exact.driver, ref, _prompts(bridge.cfg.d_vocab)
        )
    finally:
        if eager is not None:
            eager.close()
        bridge.close()


def test_torch_compile_still_works_in_the_process(family: Engines) -> None:
    # A compiled engine registers process-wide dynamo hooks; those of a model on vLLM's
    # Transformers backend outlived the class the driver restores, and failed every later
    # compile in the process (the next family's eager forward among them).
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    assert torch.equal(torch.compile(f, backend="eager")(torch.ones(3)), torch.full((3,), 3.0))


def _transformers_class_untouched(folder: Any) -> None:
    """vLLM's Transformers backend decorates transformers' own class; the driver undoes it."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    cls = MODEL_MAPPING[type(AutoConfig.from_pretrained(folder))]
    assert not any(base.__module__.startswith("vllm") for base in cls.__mro__), cls.__mro__
    assert "__call__" not in vars(cls), f"{cls.__name__}.__call__ was replaced"


def _compare(
    engines: Engines, prompts: list[list[int]], intervene: Any, capture: list[str]
) -> dict[str, float]:
    """Per prompt and hook (and the logits): the compiled engine's error against the float64
    hf driver as a multiple of the allowed ``VLLM_FACTOR`` x the float32 hf driver's error,
    and (``... vs eager``) its difference from the eager engine as a multiple of
    ``COMPILED_RTOL``."""
    drivers = (engines.vllm, engines.eager, engines.hf, engines.exact)
    return compare_modes(drivers, prompts, capture, intervene)


def test_one_description_on_both_drivers(family: Engines) -> None:
    # The vllm driver's row (or the layout it read from the hf driver's description) and the
    # hf driver's adapter describe the same architecture: any drift between the two tables
    # shows here, naming the fact.
    ours, theirs = family.vllm.architecture, family.hf.architecture
    assert ours is not None
    assert theirs.differences(ours) == []
    assert family.vllm.certification is None or family.vllm.certification.architecture == ours


def test_every_served_hook_single_prompt(family: Engines) -> None:
    served = sorted(family.vllm.supported_hook_points)
    assert {"blocks.1.attn.hook_pattern", "blocks.1.attn.hook_z"} <= set(served)
    # Per-head outputs everywhere the hf driver serves them (it certifies no equation for
    # them on an inferred architecture, so neither driver serves them there).
    assert (
        "blocks.1.attn.hook_result" in served
        or "blocks.1.attn.hook_result" not in family.hf.supported_hook_points
    )
    report = _compare(family, family.prompts[:1], None, served)
    check(report, WITHIN, f"{family.vllm.info.architecture} single prompt")


def test_every_served_hook_ragged_batch_with_chunked_prefill(family: Engines) -> None:
    assert max(LENGTHS) > ENGINE_OPTIONS["max_num_batched_tokens"]
    served = sorted(family.vllm.supported_hook_points)
    assert set(served) <= set(family.hf.supported_hook_points)
    report = _compare(family, family.prompts, None, served)
    check(report, WITHIN, f"{family.vllm.info.architecture} ragged batch")


def _per_prompt_specs(d: int, served: frozenset[str]) -> list[dict[str, Any] | None]:
    gen = torch.Generator().manual_seed(7)
    vec = torch.randn(d, generator=gen).tolist()
    rows = torch.randn(2, d, generator=gen).tolist()
    specs: list[dict[str, Any] | None] = [
        {"blocks.0.attn.hook_out": {"op": "suppress", "pos": [1, -1]}},
        {
            "blocks.0.hook_out": {"op": "scale", "factor": 0.5},
            "blocks.1.hook_in": {"op": "add", "value": vec, "pos": 50},  # a later prefill chunk
        },
        # (An inferred parallel block's shared-norm input is not served: then the MLP output.)
        {
            next(n for n in ("blocks.0.ln2.hook_in", "blocks.0.mlp.hook_out") if n in served): {
                "op": "set",
                "value": rows,
                "pos": [0, 2],
            }
        },
        {
            "blocks.1.mlp.hook_out": [
                {"op": "scale", "factor": 2.0},
                {"op": "add", "value": 0.3},
                {"op": "suppress", "pos": -1},
            ]
        },
        None,
        {
            "embed.hook_out": {"op": "add", "value": vec},
            "ln_final.hook_out": {"op": "set", "value": 0.25, "pos": 0},
        },
        {
            "blocks.1.hook_out": {"op": "suppress"},
            "blocks.0.hook_in": {"op": "scale", "factor": -1.0, "pos": [3, 4]},
            "ln_final.hook_in": {"op": "set", "value": vec},
        },
    ]
    extra = specs[3]
    assert extra is not None
    # The sites only some block shapes have (sandwich norms, learned positions, an
    # embedding norm) get edits of their own.
    if "blocks.0.ln1_post.hook_out" in served:
        extra["blocks.0.ln1_post.hook_out"] = {"op": "scale", "factor": 3.0, "pos": [0, 5]}
        extra["blocks.1.ln2_post.hook_in"] = {"op": "add", "value": vec}
    elif "pos_embed.hook_out" in served:
        extra["pos_embed.hook_out"] = {"op": "set", "value": 0.0, "pos": [1, 2]}
    else:
        extra["blocks.1.attn.hook_out"] = {"op": "set", "value": vec, "pos": 10}
    if "embed_ln.hook_out" in served:
        extra["embed_ln.hook_in"] = {"op": "scale", "factor": 2.0, "pos": [0, 1]}
        extra["embed_ln.hook_out"] = {"op": "add", "value": vec, "pos": -1}
    return specs


def test_every_spec_op_per_prompt_in_a_batch(family: Engines) -> None:
    driver, prompts = family.vllm, family.prompts
    specs = _per_prompt_specs(driver.info.d_model, driver.supported_hook_points)
    capture = ["blocks.0.hook_out", "blocks.1.attn.hook_out", "blocks.1.hook_out", "ln_final.hook_normalized",
               "blocks.1.attn.hook_pattern", "blocks.1.ln2.hook_scale"]  # fmt: skip
    capture = [
        n for n in capture if n in driver.supported_hook_points
    ]  # one-norm blocks lack ln2.hook_scale
    report = _compare(family, prompts, specs, capture)
    check(report, WITHIN, f"{driver.info.architecture} per-prompt specs")
    _check_only_specced_prompts_changed(driver, prompts, specs)


def _check_only_specced_prompts_changed(
    driver: Any, prompts: list[list[int]], specs: list[Any]
) -> None:
    plain = driver.forward(prompts, max_new_tokens=0)
    edited = driver.forward(prompts, intervene=specs, max_new_tokens=0)
    changed = [float((plain.logits[b] - edited.logits[b]).abs().max()) for b in range(len(prompts))]
    # The plain run uses the compiled graph, the edited one (head-level sites) the eager
    # forward: the same computation up to the compiled engine's rounding.
    same = [
        COMPILED_RTOL * max(1.0, float(plain.logits[b].abs().max())) for b in range(len(prompts))
    ]
    assert all(c <= tol for c, tol, s in zip(changed, same, specs, strict=True) if not s), (
        f"a prompt without specs changed: {changed}"
    )
    assert all(c > 1e-3 for c, s in zip(changed, specs, strict=True) if s), changed


def test_one_mapping_for_every_prompt(family: Engines) -> None:
    vec = torch.linspace(-1, 1, family.vllm.info.d_model).tolist()
    intervene = {
        "blocks.0.hook_out": {"op": "add", "value": vec},
        "blocks.1.attn.hook_out": {"op": "scale", "factor": 0.0, "pos": -1},
    }
    report = _compare(family, family.prompts, intervene, ["blocks.1.hook_in", "blocks.1.hook_out"])
    check(report, WITHIN, f"{family.vllm.info.architecture} shared specs")


def _site_specs(namespace: Any, seed: int) -> tuple[list[dict[str, Any] | None], list[str]]:
    """Per-prompt specs on every editable head-, neuron- and norm-level site, round robin.

    ``set`` and ``suppress`` list positions, so no later spec hides an earlier one's effect;
    the one-token prompt gets none (the control).
    """
    gen = torch.Generator().manual_seed(seed)
    sites = sorted(
        n for n in namespace.editable
        if n.startswith("blocks.") and n.split(".", 2)[2] not in RESIDUAL_SITES
    )  # fmt: skip
    targets = [b for b, n in enumerate(LENGTHS) if n > 1]
    per: list[dict[str, Any] | None] = [None if n == 1 else {} for n in LENGTHS]
    for k, name in enumerate(sites):
        width = math.prod(namespace.feature_shape(name))
        vec = torch.randn(width, generator=gen).tolist()
        kinds: list[Any] = [
            {"op": "scale", "factor": 1.7},
            {"op": "add", "value": vec, "pos": [0, -1]},
            {"op": "set", "value": vec, "pos": [1]},
            [{"op": "scale", "factor": 0.5}, {"op": "add", "value": 0.3, "pos": 0}],
            {"op": "suppress", "pos": -1},
        ]
        mapping = per[targets[k % len(targets)]]
        assert mapping is not None
        mapping[name] = kinds[k % len(kinds)]
    return per, sites


def test_head_neuron_and_norm_edits_per_prompt(family: Engines) -> None:
    """Every editable site beyond the residual stream, per prompt, with and without pos:
    the edited site itself, what follows it and the logits equal the hf driver's."""
    driver = family.vllm
    specs, sites = _site_specs(driver.namespace, seed=11)
    assert {"blocks.0.attn.hook_q", "blocks.1.attn.hook_z"} <= set(sites)
    capture = [*sites, "blocks.1.hook_out", "blocks.1.attn.hook_pattern"]
    report = _compare(family, family.prompts, specs, capture)
    check(report, WITHIN, f"{driver.info.architecture} head/neuron/norm specs")
    _check_only_specced_prompts_changed(driver, family.prompts, specs)


def test_greedy_generation_with_steering(family: Engines) -> None:
    driver, ref, prompts = family.vllm, family.ref, family.prompts
    chosen = [prompts[0], prompts[3], prompts[1], prompts[2]]
    vec = (torch.linspace(-2, 2, driver.info.d_model)).tolist()
    intervene = [
        {"blocks.0.hook_out": {"op": "add", "value": vec}},
        {
            "blocks.1.mlp.hook_out": {"op": "scale", "factor": 1.5},
            "blocks.0.hook_in": {"op": "suppress", "pos": 0},
        },
        None,
        {"blocks.1.hook_in": [{"op": "add", "value": 0.5}, {"op": "set", "value": vec, "pos": -1}]},
    ]
    result = driver.forward(
        chosen,
        capture=["blocks.1.hook_out"],
        intervene=intervene,
        max_new_tokens=6,
        stop_at_eos=False,
    )
    assert result.new_tokens is not None and result.new_tokens.shape == (4, 6)
    eager = family.eager.forward(
        chosen, capture=["blocks.1.hook_out"], intervene=intervene, max_new_tokens=6,
        stop_at_eos=False,
    )  # fmt: skip
    assert torch.equal(result.new_tokens, eager.new_tokens)
    for b, ids in enumerate(chosen):
        n = len(ids)
        check(
            {
                "capture": eager_ratio(
                    result.captured["blocks.1.hook_out"][b, :n],
                    eager.captured["blocks.1.hook_out"][b, :n],
                ),
                "logits": eager_ratio(result.logits[b, :n], eager.logits[b, :n]),
            },
            1.0,
            f"prompt {b} during generation, compiled against eager",
        )
        want = ref.generate(ids, 6, intervene[b])
        assert result.new_tokens[b].tolist() == want, f"prompt {b}"
        prompt_capture, logits = ref.run(ids, ["blocks.1.hook_out"], intervene[b])
        exact = family.exact.forward(
            [ids], capture=["blocks.1.hook_out"], intervene=intervene[b], max_new_tokens=0
        )
        n = len(ids)
        check(
            {
                "capture": rounding_ratio(
                    result.captured["blocks.1.hook_out"][b, :n],
                    prompt_capture["blocks.1.hook_out"],
                    exact.captured["blocks.1.hook_out"][0],
                    "capture",
                ),
                "logits": rounding_ratio(result.logits[b, :n], logits, exact.logits[0], "logits"),
            },
            WITHIN,
            f"prompt {b} during generation",
        )


def _residual_specs(d: int) -> list[dict[str, Any] | None]:
    gen = torch.Generator().manual_seed(9)
    vec, other = (torch.randn(d, generator=gen).tolist() for _ in range(2))
    return [
        {"blocks.0.hook_out": [{"op": "scale", "factor": 0.5}, {"op": "add", "value": vec}]},
        {
            "blocks.1.hook_in": {"op": "add", "value": other, "pos": [0, 40, -1]},  # a later chunk
            "ln_final.hook_out": {"op": "scale", "factor": 1.5},
        },
        None,
        {
            "blocks.0.hook_in": {"op": "suppress", "pos": [1, 2]},
            "ln_final.hook_in": {"op": "set", "value": vec, "pos": -1},
        },
    ]


def test_residual_stream_runs_stay_inside_the_compiled_graph(family: Engines) -> None:
    """Residual-stream captures, edits per prompt and at positions, logits and steered
    generation run inside the compiled graph (a Python hook on decoder layer 0 runs only in
    the eager forward) where the engine has residual sites; on vLLM's Transformers backend,
    which has none, the namespace says every hook runs eagerly. Either way: equal to the
    eager engine, and to the hf driver within the band."""
    driver, prompts = family.vllm, family.prompts[:4]
    n_layers = driver.info.n_layers
    # Every site's value after its edit (a capture ahead of an edit at the same site, such
    # as blocks.{n-1}.hook_out with ln_final.hook_in edited, runs eagerly).
    capture = [
        *(f"blocks.{i}.hook_in" for i in range(n_layers)),
        "ln_final.hook_in",
        "ln_final.hook_out",
    ]
    resident = all(w["resident"] for w in driver.workers)
    if resident:
        assert set(capture).isdisjoint(driver.namespace.eager_only)
    else:
        assert driver._layout.batched, "a vLLM model class without residual sites"
        engine_side = set(driver.supported_hook_points) - INPUT_SITES
        assert set(driver.namespace.eager_only) == engine_side
    specs = _residual_specs(driver.info.d_model)
    steer: dict[str, Any] = {
        "intervene": specs[:2], "max_new_tokens": 5, "return_logits": False, "stop_at_eos": False,
    }  # fmt: skip
    calls, handle = layer_calls(driver)
    try:
        report = _compare(family, prompts, specs, capture)
        report.update(
            {f"plain:{k}": v for k, v in _compare(family, prompts, None, capture[:1]).items()}
        )
        steered = driver.forward(prompts[:2], **steer)
        assert calls == [] or not resident, "a residual-stream run left the compiled graph"
    finally:
        handle.remove()
    check(report, WITHIN, f"{driver.info.architecture} residual stream, compiled")
    assert torch.equal(steered.new_tokens, family.eager.forward(prompts[:2], **steer).new_tokens)
    for b in range(2):
        want = family.hf.forward(
            prompts[b : b + 1], intervene=specs[b], max_new_tokens=5, return_logits=False,
            stop_at_eos=False,
        )  # fmt: skip
        assert steered.new_tokens[b].tolist() == want.new_tokens[0].tolist(), f"prompt {b}"
