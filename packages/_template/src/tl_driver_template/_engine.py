"""The stand-in engine. Replace this module with the engine your driver wraps.

A serving engine owns its model: the driver cannot change its code, only reach its modules
(``model.layers[i]``) and attach torch hooks for the length of a run. This stand-in is a
tl-core native model driven that way: it runs one prompt at a time and calls ``visit`` at
each residual-stream site, which may return an edited tensor. A real engine batches
prompts into one step; split its tensors per request as ``tl_driver_vllm`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from tl_core.native import NativeDriver

__all__ = ["Visit", "ToyEngine"]

#: ``visit(site, tensor)`` -> the tensor the model continues with; ``site`` is
#: ``"embed"``, ``("block", i)`` (a block's output) or ``"logits"``.
Visit = Callable[[Any, torch.Tensor], torch.Tensor]


class ToyEngine:
    """A tiny model with an engine's interface: load, run prompts, expose modules."""

    def __init__(self, config: Any = None, **options: Any) -> None:
        native = NativeDriver.boot(config, **options)
        self.model: nn.Module = native.module
        self.tokenizer = native.tokenizer
        self.info = native.info

    @torch.no_grad()
    def run(self, prompt: Sequence[int], visit: Visit) -> torch.Tensor:
        """Logits ``[len, vocab]`` of one prompt, calling ``visit`` at every site."""
        with self._hooks(visit):
            logits: torch.Tensor = self.model(torch.tensor([list(prompt)]))
        return visit("logits", logits)[0]

    @contextmanager
    def _hooks(self, visit: Visit) -> Iterator[None]:
        def on(site: Any) -> Callable[..., torch.Tensor]:
            return lambda module, args, output: visit(site, output)

        model: Any = self.model
        modules = [("embed", model.embed)] + [(("block", i), b) for i, b in enumerate(model.blocks)]
        handles = [module.register_forward_hook(on(site)) for site, module in modules]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def close(self) -> None:
        """Release the engine (a real one stops processes and frees memory here)."""
