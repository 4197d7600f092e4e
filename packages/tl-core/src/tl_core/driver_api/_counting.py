"""Count the validation and compilation work one call does, for tests that a request is
validated, planned and compiled once."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

from tl_core.driver_api import _batching, _layers
from tl_core.hooks._namespace import HookNamespace
from tl_core.specs import _affine, _plan

__all__ = ["validation_calls"]


@contextmanager
def validation_calls() -> Iterator[Counter[str]]:
    """Count name resolutions, paddings, layer checks, spec plans and spec compilations
    inside the ``with`` block.

    The counter's keys: ``"lookup:<name as given>"`` for each ``HookNamespace.lookup``,
    ``"pad_batch"``, ``"block_index"``, ``"build_plan"`` (a whole ``intervene=`` checked)
    and ``"compile_specs"`` (one list of specs composed into an affine edit). Every module
    that imported one of those functions by name is patched too, so a copy of the call
    anywhere is counted. Meant for driver tests: one ``run_with_cache`` should resolve each
    name once, pad once, check its stop layer once, plan once and compile each hook's specs
    once, however many layers it passes through.
    """
    counts: Counter[str] = Counter()
    lookup = HookNamespace.lookup

    def counted_lookup(self: HookNamespace, name: str, **kwargs: Any) -> str:
        counts[f"lookup:{name}"] += 1
        return lookup(self, name, **kwargs)

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(HookNamespace, "lookup", counted_lookup))
        originals = (
            _batching.pad_batch,
            _layers.block_index,
            _plan.build_plan,
            _affine.compile_specs,
        )
        for original in originals:
            wrapper = _counting(original, counts)
            for module in list(sys.modules.values()):
                # The module's own namespace, not getattr: lazy modules (transformers')
                # would import their submodules on a missing name.
                if getattr(module, "__dict__", {}).get(original.__name__) is original:
                    stack.enter_context(mock.patch.object(module, original.__name__, wrapper))
        yield counts


def _counting(function: Callable[..., Any], counts: Counter[str]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[function.__name__] += 1
        return function(*args, **kwargs)

    return counted
