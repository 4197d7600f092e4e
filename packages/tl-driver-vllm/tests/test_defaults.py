"""Boot defaults: a KV cache sized for the run on the CPU build, explicit options win."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tl_core import ConfigError, ModelInfo
from tl_driver_vllm._driver_side._memory import AVAILABLE_SHARE, MEMORY_OPTIONS, cpu_kv_cache

GiB = 2**30
#: SmolLM2-135M's sizes: 30 layers, 3 key/value heads of 64, an 8192-token context.
SMOL = ModelInfo(
    n_layers=30,
    d_model=576,
    n_heads=9,
    d_head=64,
    d_mlp=1536,
    d_vocab=49152,
    n_ctx=8192,
    n_key_value_heads=3,
    normalization_type="RMS",
    positional_embedding_type="rotary",
    gated_mlp=True,
    architecture="LlamaForCausalLM",
)
FP32_TOKEN = 2 * 30 * 3 * 64 * 4  # K and V, every layer, every kv head, 4 bytes


def _choose(kwargs: dict[str, Any], available: int = 64 * GiB, **extra: Any) -> Any:
    base = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1, **kwargs}
    return cpu_kv_cache(
        SMOL, base, config_dtype="float32", available=available, environ=extra.get("environ", {})
    )


@pytest.mark.parametrize("key", MEMORY_OPTIONS)
def test_an_explicit_memory_option_wins(key: str) -> None:
    assert _choose({key: 12345, "max_model_len": 256}) is None


def test_the_legacy_environment_setting_wins() -> None:
    assert _choose({"max_model_len": 256}, environ={"VLLM_CPU_KVCACHE_SPACE": "2"}) is None


def test_room_for_every_sequence_when_it_fits() -> None:
    choice = _choose({"max_model_len": 256, "max_num_seqs": 32, "dtype": "float32"})
    assert choice.kwargs["kv_cache_memory_bytes"] == 32 * 256 * FP32_TOKEN
    assert choice.kwargs["max_model_len"] == 256
    for part in (
        "max_num_seqs=32",
        "max_model_len=256",
        "45.0 KiB per token",
        "kv_cache_memory_bytes=",
    ):
        assert part in choice.message, (part, choice.message)


def test_lengths_round_up_to_whole_blocks_and_auto_dtype_is_half_precision() -> None:
    # vLLM's "auto" turns a float32 checkpoint into half precision; CPU blocks hold 128 tokens.
    choice = _choose({"max_model_len": 200, "max_num_seqs": 4})
    assert choice.kwargs["kv_cache_memory_bytes"] == 4 * 256 * FP32_TOKEN // 2


def test_capped_at_a_share_of_available_memory() -> None:
    available = 2 * GiB  # a quarter is 512 MiB: 11 of 32 sequences of 1024 tokens
    choice = _choose({"max_model_len": 1024, "max_num_seqs": 32, "dtype": "float32"}, available)
    size = choice.kwargs["kv_cache_memory_bytes"]
    assert size <= AVAILABLE_SHARE * available
    assert size >= AVAILABLE_SHARE * available - 128 * FP32_TOKEN  # whole blocks only
    assert size % (128 * FP32_TOKEN) == 0
    assert "vLLM queues the rest" in choice.message


def test_the_models_own_context_shrinks_to_what_fits() -> None:
    # 8192 tokens x 45 KiB = 360 MiB per sequence, more than a quarter of 1 GiB.
    choice = _choose({"dtype": "float32"}, available=1 * GiB)
    assert choice.kwargs["max_model_len"] == -1  # vLLM fits the context to the cache
    assert choice.kwargs["kv_cache_memory_bytes"] <= GiB // 4
    assert "shortens max_model_len" in choice.message


def test_an_asked_length_that_cannot_fit_is_refused_before_boot() -> None:
    with pytest.raises(ConfigError, match=r"max_model_len=8192.*kv_cache_memory_bytes"):
        _choose({"max_model_len": 8192, "dtype": "float32"}, available=1 * GiB)


def test_tensor_parallel_ranks_hold_their_share_of_heads() -> None:
    one = _choose({"max_model_len": 256, "max_num_seqs": 8, "dtype": "float32"})
    three = _choose(
        {"max_model_len": 256, "max_num_seqs": 8, "dtype": "float32", "tensor_parallel_size": 3}
    )
    assert three.kwargs["kv_cache_memory_bytes"] * 3 == one.kwargs["kv_cache_memory_bytes"]


# -- a real engine while another process holds memory ------------------------------------


@contextmanager
def _memory_held_elsewhere(nbytes: int) -> Iterator[subprocess.Popen[bytes]]:
    """A child process that writes (so the kernel must back) ``nbytes`` and holds them."""
    code = f"import sys\nheld = b'\\x01' * {nbytes}\nprint('ready', flush=True)\nsys.stdin.read()\n"
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        yield child
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode is not None  # released: the child is gone


@pytest.mark.vllm
@pytest.mark.slow
def test_boots_with_no_memory_option_while_memory_is_held(
    checkpoint: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("vllm")
    psutil = pytest.importorskip("psutil")
    from vllm.platforms import current_platform

    import tl_driver_vllm._driver_side._driver as driver_module
    from tl_core import RemoteBridge

    if not current_platform.is_cpu():
        pytest.skip("the default applies to vLLM's CPU build; GPU builds keep vLLM's")
    folder = checkpoint("llama")
    memory = psutil.virtual_memory()
    # Enough that vLLM's own default (reserve 0.9 of *total* memory, refuse unless that much
    # is available) cannot boot, and at least a tenth of what is available.
    hold = int(max(memory.available - 0.75 * memory.total, 0.1 * memory.available))
    # The driver logs through vLLM's logger, which vLLM reconfigures while booting (and
    # the suite runs at WARNING level): record what the driver logs on a logger of our own.
    logger = logging.Logger("recorded", level=logging.INFO)
    logger.addHandler(caplog.handler)
    monkeypatch.setattr(driver_module, "_LOG", logger)
    try:
        with _memory_held_elsewhere(hold) as child:
            assert psutil.Process(child.pid).memory_info().rss >= 0.9 * hold
            available = psutil.virtual_memory().available
            assert 0.9 * memory.total > available, "vLLM's own default would have booted"
            bridge = RemoteBridge.boot_vllm(str(folder))
            try:
                cache_config = bridge.driver._llm.llm_engine.vllm_config.cache_config
                chosen = int(cache_config.kv_cache_memory_bytes)
                assert 0 < chosen <= AVAILABLE_SHARE * available * 1.05  # available moves a little
                out, cache = bridge.run_with_cache(
                    ["The lighthouse", "a"], names_filter=["blocks.1.hook_out"]
                )
                assert out.shape[:2] == (2, cache.lengths[0]) and bridge.generate(
                    "Once", max_new_tokens=2
                )
            finally:
                bridge.close()
    finally:
        logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if "no memory option given" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert "kv_cache_memory_bytes=" in lines[0] and "VLLM_CPU_KVCACHE_SPACE" in lines[0]
