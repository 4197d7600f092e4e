"""Worker side: the eager forward inside a compiled engine, switched on for runs with hooks.

With ``enforce_eager=False`` vLLM wraps the model's backbone (``@support_torch_compile``)
and traces it once, at boot, without tl's hooks: hooks added later never run inside the
compiled graph. A run that needs hooks therefore switches the wrapped modules to their
eager ``forward`` (the decorator's own ``do_not_compile`` switch, read at every call) and
back when the run ends; a run without hooks keeps vLLM's compiled graph. Nothing is traced
again either way. The eager forward of a compiled engine computes what an eager engine
computes within float32 rounding: vLLM binds some custom ops (the rotary embedding) to
other implementations when it compiles.
"""

from __future__ import annotations

from torch import nn

__all__ = ["EagerSwitch"]


class EagerSwitch:
    """The modules vLLM compiled, and the switch that runs them eagerly.

    Args:
        model: vLLM's top-level model on this worker.
    """

    def __init__(self, model: nn.Module) -> None:
        self.compiled = [m for m in model.modules() if getattr(m, "do_not_compile", True) is False]
        self.eager = False

    def __bool__(self) -> bool:
        return bool(self.compiled)

    def set(self, eager: bool) -> None:
        """Run the eager forward (``True``) or the compiled graph (``False``) from now on."""
        for module in self.compiled:
            module.do_not_compile = eager  # type: ignore[assignment]
        self.eager = eager
