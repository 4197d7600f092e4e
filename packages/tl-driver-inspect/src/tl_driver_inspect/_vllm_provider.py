"""``tl_bridge_vllm/<model>``: tl's ``vllm`` driver, concurrent samples batched."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from tl_core import DriverNotFoundError
from tl_core.driver_api import run_keywords
from tl_driver_inspect._batcher import Batcher
from tl_driver_inspect._provider import TLProvider, _first_row

__all__ = ["INSTALL_LINE", "TLBridgeVLLMAPI"]

INSTALL_LINE = "pip install tl-driver-vllm"


class TLBridgeVLLMAPI(TLProvider):
    """``tl_bridge_vllm/<model>``: a vLLM engine through tl's ``vllm`` driver.

    ``model_args`` are ``RemoteBridge.boot_vllm`` options (``dtype``, ``max_model_len``,
    ``kv_cache_memory_bytes``, ...). Samples generating at the same time go to the engine
    as one batch, each with its own specs; captures are split per prompt by the driver.
    The bridge (a ``RemoteBridge``) is ``self.bridge``; ``batcher.calls`` counts engine
    calls.
    """

    driver_name = "vllm"

    def _boot(self, model: str, options: dict[str, Any]) -> Any:
        try:
            import tl_driver_vllm  # noqa: F401
        except ImportError as error:
            raise DriverNotFoundError(
                f"model 'tl_bridge_vllm/{model}' needs tl's vLLM driver, which is not installed "
                f"({error}); install it with `{INSTALL_LINE}` (or `pip install "
                "tl-driver-inspect[vllm]`), or use 'tl_bridge/<model>' for the hf driver"
            ) from None
        bridge = super()._boot(model, options)
        self.batcher = Batcher(self._run_batch, self.lock)
        return bridge

    def _run_batch(self, key: Hashable, payloads: Sequence[Any]) -> list[Any]:
        kind = key[0]  # type: ignore[index]
        rows = [list(p[0]) for p in payloads]
        specs = [p[1] for p in payloads]
        intervene = specs if any(s for s in specs) else None
        driver = self.bridge.driver
        with torch.no_grad():
            return self._call(driver, kind, key, rows, intervene)

    def _call(
        self, driver: Any, kind: str, key: Any, rows: list[list[int]], intervene: Any
    ) -> list[Any]:
        if kind == "generate":
            _, max_new, sampling = key
            result = run_keywords(
                driver,
                rows,
                intervene=intervene,
                max_new_tokens=max_new,
                return_logits=False,
                **dict(sampling),
            )
            assert result.new_tokens is not None  # max_new >= 1: every driver returns them
            return [[int(i) for i in row] for row in result.new_tokens.tolist()]
        _, capture, want_logits = key
        result = run_keywords(
            driver,
            rows,
            capture=list(capture),
            intervene=intervene,
            max_new_tokens=0,
            return_logits=want_logits,
        )
        return [
            _first_row(result, i, len(row), self.namespace, want_logits)
            for i, row in enumerate(rows)
        ]

    def _generate_blocking(
        self, prompt: list[int], specs: Any, max_new: int, sampling: dict[str, Any]
    ) -> list[int]:
        key = ("generate", max_new, tuple(sorted(sampling.items())))
        return self.batcher.submit(key, (prompt, specs))  # type: ignore[no-any-return]

    def _forward_blocking(
        self, ids: list[int], capture: Sequence[str], specs: Any, want_logits: bool
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        key = ("forward", tuple(capture), want_logits)
        return self.batcher.submit(key, (ids, specs))  # type: ignore[no-any-return]
