"""Boot options: clear early errors, meta weights, wrapping a loaded model, dtypes, n_ctx."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, BertConfig, BertLMHeadModel

from tl_core import ConfigError, TransformerBridge, UserError, boot
from tl_core.certification import check_rounding
from tl_driver_hf import HFDriver, build_bridge_from_module
from tl_driver_hf._weights._checkpoints import checkpoint_revision
from tl_driver_hf.testing import write_tiny_checkpoint

NOWHERE = "no-such-org/no-such-model"


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"device": "cpu", "device_map": "auto"}, "mutually exclusive"),
        ({"checkpoint_index": 3}, "no training checkpoints"),
        ({"devce": "cpu"}, "did you mean 'device'"),
        ({"offload_folder": "/tmp/x"}, "only applies with device_map"),
        ({"n_devices": 64}, "needs 64 CUDA devices"),
        ({"load_weights": False, "device_map": "auto"}, "meta device"),
        ({"dtype": "int8"}, "not supported"),
        ({"n_ctx": 0}, "n_ctx must be"),
    ],
)
def test_bad_options_fail_before_anything_loads(options: dict[str, object], match: str) -> None:
    # NOWHERE does not exist, locally or on the (disabled) hub: reaching the loader would
    # raise a different error.
    with pytest.raises(UserError, match=match):
        HFDriver.boot(NOWHERE, **options)


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a config or loading weights fails the test: every error must come first."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the config or weights were loaded")

    monkeypatch.setattr("tl_driver_hf._driver.load_config", refuse)
    monkeypatch.setattr("tl_driver_hf._driver.load_model", refuse)
    monkeypatch.setattr("tl_driver_hf._driver.gguf_folder", refuse)


@pytest.mark.parametrize(
    ("where", "match"),
    [
        (
            "absolute",
            r"model_name='{tmp}/missing/model' is a path, but folder '{tmp}/missing/model' does not exist; the nearest folder that exists is '{tmp}'\. Fix the path, or pass a hub id",
        ),
        ("dot", r"model_name='\./missing' is a path, but folder '{tmp}/missing' does not exist"),
        (
            "dotdot",
            r"model_name='\.\./missing' is a path, but folder '{parent}/missing' does not exist",
        ),
        ("home", r"model_name='~/missing' is a path, but folder '{tmp}/missing' does not exist"),
        (
            "pathlike",
            r"model_name='models/missing' is a path, but folder '{tmp}/models/missing' does not exist",
        ),
        (
            "file",
            r"model_name='{tmp}/config.json' is a file, but a model loads from a checkpoint folder .*: pass the folder that holds it, '{tmp}'",
        ),
        (
            "tokenizer",
            r"tokenizer='{tmp}/missing' is a path, but folder '{tmp}/missing' does not exist",
        ),
        (
            "tokenizer-file",
            r"tokenizer='{tmp}/tokenizer.json' is a file, .*tokenizer files.*: pass the folder that holds it, '{tmp}'",
        ),
        (
            "wrapped-tokenizer",
            r"tokenizer='\./missing' is a path, but folder '{tmp}/missing' does not exist",
        ),
    ],
)
def test_bad_paths_are_not_taken_for_hub_ids(
    where: str,
    match: str,
    tmp_path: Path,
    checkpoint: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
    no_loading: None,
) -> None:
    tmp = tmp_path.resolve()
    monkeypatch.chdir(tmp)
    monkeypatch.setenv("HOME", str(tmp))
    (tmp / "config.json").write_text("{}")
    (tmp / "tokenizer.json").write_text("{}")
    folder = str(checkpoint("gpt2"))
    calls: dict[str, tuple[object, dict[str, object]]] = {
        "absolute": (str(tmp / "missing" / "model"), {}),
        "dot": ("./missing", {}),
        "dotdot": ("../missing", {}),
        "home": ("~/missing", {}),
        "pathlike": (Path("models/missing"), {}),
        "file": (str(tmp / "config.json"), {}),
        "tokenizer": (folder, {"tokenizer": str(tmp / "missing")}),
        "tokenizer-file": (folder, {"tokenizer": str(tmp / "tokenizer.json")}),
        "wrapped-tokenizer": (None, {"hf_model": torch.nn.Linear(1, 1), "tokenizer": "./missing"}),
    }
    model_name, options = calls[where]
    pattern = match.format(tmp=re.escape(str(tmp)), parent=re.escape(str(tmp.parent)))
    with pytest.raises(UserError, match=pattern):
        TransformerBridge.boot_transformers(model_name, **options)


def test_paths_expand_the_home_folder_and_hub_ids_stay_hub_ids(
    checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    folder = checkpoint("llama")
    monkeypatch.setenv("HOME", str(folder.parent))
    bridge = TransformerBridge.boot_transformers(
        f"~/{folder.name}", load_weights=False, tokenizer=f"~/{folder.name}"
    )
    assert bridge.driver.hf_model.config.model_type == "llama"
    assert bridge.to_string(bridge.to_tokens("the keeper", prepend_bos=False)[0]) == "the keeper"
    # A missing GGUF file is named as a file, after "~" is expanded.
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(
        UserError,
        match=rf"model_name='~/x.gguf' is a path, but file '{re.escape(str(tmp_path))}/x.gguf' does not exist",
    ):
        HFDriver.boot("~/x.gguf")
    # A hub id is still a hub id: offline, the loader says it cannot be read.
    with pytest.raises(
        UserError, match="cannot read the config of hub id 'no-such-org/no-such-model'"
    ):
        HFDriver.boot(NOWHERE)


_NO_CUDA = r"needs CUDA, but this torch build \({version}\) has no CUDA support\. Use device='cpu', or install a CUDA build of torch"


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"device": "cuda"}, "device='cuda' " + _NO_CUDA),
        ({"device": "cuda:1"}, "device='cuda:1' " + _NO_CUDA),
        ({"device": torch.device("cuda", 0)}, r"device=device\(type='cuda', index=0\) " + _NO_CUDA),
        (
            {"n_devices": 2},
            r"n_devices=2 needs 2 CUDA devices, but this torch build \({version}\) has no CUDA support",
        ),
        ({"device_map": "cuda:0"}, "device_map='cuda:0' " + _NO_CUDA),
        (
            {"device_map": {"model.embed_tokens": 0, "lm_head": "cpu"}},
            r"device_map\['model.embed_tokens'\]=0 puts 'model.embed_tokens' on a CUDA device, but this torch build \({version}\) has no CUDA support",
        ),
        (
            {"device": "mps"},
            r"device='mps' needs MPS \(Apple Metal\), but this torch build \({version}\) has no MPS support\. Use device='cpu'",
        ),
    ],
    ids=[
        "cuda",
        "cuda-index",
        "torch-device",
        "n_devices",
        "device_map-name",
        "device_map-dict",
        "mps",
    ],
)
def test_devices_this_torch_lacks_are_refused_before_weights_load(
    options: dict[str, object],
    match: str,
    checkpoint: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
    no_loading: None,
) -> None:
    # As on a CPU-only build of torch, whatever this machine has.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: False)
    with pytest.raises(ConfigError, match=match.format(version=re.escape(torch.__version__))):
        TransformerBridge.boot_transformers(str(checkpoint("gpt2")), **options)


def test_cuda_that_is_built_but_not_visible_is_told_apart(
    checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, no_loading: None
) -> None:
    path = str(checkpoint("gpt2"))
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        ConfigError,
        match=r"device='cuda' needs CUDA, but torch .* sees no CUDA device .*CUDA_VISIBLE_DEVICES",
    ):
        HFDriver.boot(path, device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(
        ConfigError,
        match=r"device='cuda:3' needs CUDA, but CUDA device 3 does not exist: torch sees 1 \(cuda:0 to cuda:0",
    ):
        HFDriver.boot(path, device="cuda:3")
    with pytest.raises(
        ConfigError, match=r"device_map\['lm_head'\]=2 .*CUDA device 2 does not exist"
    ):
        HFDriver.boot(path, device_map={"transformer": 0, "lm_head": 2})


@pytest.mark.parametrize(
    ("family", "overrides", "match"),
    [
        (
            "gpt2",
            {"n_layerz": 1},
            r"key 'n_layerz' is not a field of the 'gpt2' config.*did you mean 'n_layer'\?",
        ),
        ("llama", {"hidden_sise": 64}, r"key 'hidden_sise' .*did you mean 'hidden_size'\?"),
        ("llama", {"zzzzzzzz": 1}, r"key 'zzzzzzzz' .*see its config.json for the fields"),
        (
            "gpt2",
            {"n_layer": -1},
            r"\['n_layer'\] = -1, but 'n_layer' is a size or count .*now 2.*int >= 1",
        ),
        ("gpt2", {"n_embd": 0}, r"\['n_embd'\] = 0, but 'n_embd' is a size"),
        # Through the config's attribute map (GPT-2 calls it n_layer).
        ("gpt2", {"num_hidden_layers": 0}, r"\['num_hidden_layers'\] = 0"),
        ("llama", {"num_attention_heads": 2.0}, r"\['num_attention_heads'\] = 2.0"),
        ("llama", {"vocab_size": True}, r"\['vocab_size'\] = True"),
    ],
    ids=["typo", "typo-llama", "no-close-field", "negative", "zero", "aliased", "float", "bool"],
)
def test_bad_config_overrides_fail_before_weights_load(
    family: str,
    overrides: dict[str, object],
    match: str,
    checkpoint: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights were loaded")

    monkeypatch.setattr("tl_driver_hf._driver.load_model", no_loading)
    with pytest.raises(ConfigError, match=match):
        HFDriver.boot(str(checkpoint(family)), hf_config_overrides=overrides)


def test_valid_config_overrides_take_effect(checkpoint: Callable[[str], Path]) -> None:
    overrides = {"layer_norm_epsilon": 1e-3, "resid_pdrop": 0.0}
    driver = HFDriver.boot(str(checkpoint("gpt2")), hf_config_overrides=overrides)
    assert driver.hf_model.transformer.h[0].ln_1.eps == 1e-3


def test_an_override_dropping_layers_is_refused(checkpoint: Callable[[str], Path]) -> None:
    """Fewer layers than the weights hold would drop the others: tl boots checkpoints whole."""
    with pytest.raises(ConfigError, match=r"transformer\.h\.1 \(11 weights\).*n_layer=1"):
        HFDriver.boot(str(checkpoint("gpt2")), hf_config_overrides={"num_hidden_layers": 1})


def test_checkpoints_resolve_to_hub_revisions_and_reject_the_rest(
    checkpoint: Callable[[str], Path],
) -> None:
    assert checkpoint_revision("EleutherAI/pythia-70m", 0, None) == "step0"
    assert checkpoint_revision("EleutherAI/pythia-70m", 4, None) == "step8"
    assert checkpoint_revision("EleutherAI/pythia-70m", -1, None) == "step143000"
    assert checkpoint_revision("EleutherAI/pythia-70m", None, 3000) == "step3000"
    assert (
        checkpoint_revision("stanford-crfm/alias-gpt2-small-x21", None, 400000)
        == "checkpoint-400000"
    )
    with pytest.raises(UserError, match="not a published Pythia checkpoint; the nearest"):
        checkpoint_revision("EleutherAI/pythia-70m", None, 1500)
    with pytest.raises(UserError, match="out of range"):
        checkpoint_revision("EleutherAI/pythia-70m", 10_000, None)
    with pytest.raises(UserError, match="exactly one"):
        HFDriver.boot("EleutherAI/pythia-70m", checkpoint_index=1, checkpoint_value=2)
    with pytest.raises(UserError, match="revision"):
        HFDriver.boot("EleutherAI/pythia-70m", checkpoint_index=1, revision="main")
    with pytest.raises(UserError, match="local folder"):
        HFDriver.boot(str(checkpoint("llama")), checkpoint_index=1)


def test_an_encoder_is_refused_as_not_causal(tmp_path: Path) -> None:
    # No adapter describes BERT, so its architecture is inferred; certification then finds
    # that an earlier position's logits depend on a later token, and refuses the model.
    config = BertConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64
    )
    BertLMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"(?s)BertLMHeadModel.*causal"):
        TransformerBridge.boot_transformers(str(tmp_path))


def test_meta_weights_describe_the_model_but_refuse_to_run(
    checkpoint: Callable[[str], Path],
) -> None:
    bridge = TransformerBridge.boot_transformers(str(checkpoint("llama")), load_weights=False)
    assert bridge.W_Q.shape == (2, 4, 128, 32) and bridge.W_Q.is_meta
    assert "blocks.1.attn.hook_rot_q" in bridge.hook_dict
    with pytest.raises(UserError, match="load_weights=False"):
        bridge([[1, 2, 3]])
    with pytest.raises(UserError, match="load_weights=False"):
        bridge.run_with_cache("text")


def test_wrapped_model_is_never_moved_cast_or_changed(checkpoint: Callable[[str], Path]) -> None:
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint("qwen3"), attn_implementation="sdpa"
    ).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {n: p for n, p in model.named_parameters()}
    bridge = build_bridge_from_module(model, tokenizer=str(checkpoint("qwen3")))
    with pytest.raises(UserError, match="wrapped as it is"):
        HFDriver.boot(hf_model=model, dtype="bfloat16")
    with torch.no_grad():
        plain = model(torch.tensor([[1, 40, 50, 60]])).logits
        _, cache = bridge.run_with_cache(
            "The keeper climbed", intervene={"blocks.0.hook_out": {"op": "scale", "factor": 2.0}}
        )
    bridge.loss("gradients too").backward()
    assert cache["blocks.1.attn.hook_pattern"].shape[1] == bridge.cfg.n_heads
    assert model.config._attn_implementation == "sdpa"
    assert all(p is params[n] for n, p in model.named_parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks, module
    with torch.no_grad():
        torch.testing.assert_close(model(torch.tensor([[1, 40, 50, 60]])).logits, plain)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_bfloat16_equals_eager_transformers_with_or_without_hooks(
    family: str, checkpoint: Callable[[str], Path]
) -> None:
    # In half precision attention is always computed eagerly: SDPA would drift by ~0.1.
    path = checkpoint(family)
    bridge = TransformerBridge.boot_transformers(str(path), dtype="bfloat16")
    reference = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    ids = torch.tensor([[1, 40, 50, 60, 70, 80]])
    with torch.no_grad():
        plain = bridge(ids)
        logits, cache = bridge.run_with_cache(ids)
        expected = reference(ids).logits
    torch.testing.assert_close(plain, logits, atol=0.0, rtol=0.0)
    assert logits.dtype == torch.bfloat16 and cache["blocks.0.hook_out"].dtype == torch.bfloat16
    assert cache["blocks.0.ln1.hook_scale"].dtype == torch.float32  # the norm's compute dtype
    torch.testing.assert_close(logits.float(), expected.float(), atol=0.0, rtol=0.0)


def test_float64_runs_mixture_of_experts_as_transformers_does(
    checkpoint: Callable[[str], Path],
) -> None:
    """The exact run parity tests measure float32 against: transformers' default grouped
    expert kernel refuses float64, so the driver selects its per-expert loop, and the result
    is closer to transformers' own float64 run than any float32 run is."""
    path = checkpoint("mixtral")
    bridge = TransformerBridge.boot_transformers(str(path), dtype=torch.float64)
    single = TransformerBridge.boot_transformers(str(path), dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float64, attn_implementation="eager"
    ).eval()
    reference.set_experts_implementation("eager")
    ids = torch.tensor([[1, 40, 50, 60, 70, 80]])
    with torch.no_grad():
        logits = bridge(ids)
        check = check_rounding(logits, single(ids), reference(ids).logits, factor=1.0)
    assert logits.dtype == torch.float64 and check.ok, str(check)


def test_n_ctx_writes_the_config_and_guards_learned_positions(
    checkpoint: Callable[[str], Path],
) -> None:
    small = TransformerBridge.boot_transformers(str(checkpoint("llama")), n_ctx=64)
    assert small.cfg.n_ctx == 64
    assert small.driver.hf_model.config.max_position_embeddings == 64
    with pytest.warns(UserWarning, match="larger than the 256 positions"):
        big = TransformerBridge.boot_transformers(str(checkpoint("llama")), n_ctx=512)
    assert big.cfg.n_ctx == 512
    with pytest.raises(ConfigError, match="learned positions"):
        TransformerBridge.boot_transformers(str(checkpoint("gpt2")), n_ctx=512)
    gpt2 = TransformerBridge.boot_transformers(str(checkpoint("gpt2")), n_ctx=16)
    with pytest.raises(UserError, match="exceeds n_ctx=16"):
        gpt2([list(range(4, 24))])


def test_model_class_and_tokenizer_options(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    path = str(checkpoint("llama"))
    bridge = TransformerBridge.boot_transformers(path, model_class="LlamaForCausalLM")
    assert bridge.to_string(bridge.to_tokens("the keeper", prepend_bos=False)[0]) == "the keeper"
    with pytest.raises(UserError, match="not a class in transformers"):
        TransformerBridge.boot_transformers(path, model_class="NoSuchForCausalLM")
    with pytest.raises(UserError, match=r"tokenizer=.* is a path, but folder .* does not exist"):
        TransformerBridge.boot_transformers(path, tokenizer=str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="cannot load tokenizer"):
        TransformerBridge.boot_transformers(path, tokenizer=str(tmp_path / "empty"))
    # A folder with weights but no tokenizer still runs ids; text fails clearly.
    AutoModelForCausalLM.from_pretrained(path).save_pretrained(tmp_path / "bare")
    bare = TransformerBridge.boot_transformers(str(tmp_path / "bare"))
    assert bare([[1, 5, 6]]).shape == (1, 3, 512)
    with pytest.raises(UserError, match="no tokenizer"):
        bare("text")


def test_boot_goes_through_discovery(checkpoint: Callable[[str], Path]) -> None:
    bridge = boot(str(checkpoint("gpt2")), driver="hf")
    assert isinstance(bridge, TransformerBridge) and bridge.driver.name == "hf"
    assert bridge.cfg.architecture == "GPT2LMHeadModel"


def test_importing_the_package_is_cheap() -> None:
    code = "import sys, tl_driver_hf, tl_driver_hf.adapters; assert 'torch' not in sys.modules and 'transformers' not in sys.modules; print(tl_driver_hf.ENTRY.name)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "hf"


def test_sliding_windows_match_eager(tmp_path: Path) -> None:
    prompts = [[1, *range(10, 30)], [1, *range(40, 52)]]
    for family in ("mistral", "gemma2"):
        path = write_tiny_checkpoint(family, tmp_path / family, overrides={"sliding_window": 4})
        bridge = TransformerBridge.boot_transformers(str(path))
        reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
        with torch.no_grad():
            logits, cache = bridge.run_with_cache(
                prompts, names_filter=["blocks.0.attn.hook_pattern"]
            )
            for row, prompt in enumerate(prompts):
                expected = reference(torch.tensor([prompt])).logits[0]
                torch.testing.assert_close(
                    logits[row, : len(prompt)], expected, atol=1e-5, rtol=1e-5
                )
        pattern = cache["blocks.0.attn.hook_pattern"][0, :, -1]
        assert pattern[:, :-4].abs().max() == 0 and pattern[:, -4:].sum(-1).allclose(torch.ones(1))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert bridge.generate(
                [prompts[1]], max_new_tokens=2, stop_at_eos=False, return_type="tokens"
            ).shape == (1, 2)
