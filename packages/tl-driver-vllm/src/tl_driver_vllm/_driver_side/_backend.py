"""vLLM's Transformers backend, seen from the process that boots the engine.

To run an architecture it has no model of its own for (GPT-NeoX, OLMo 2), vLLM builds
transformers' own decoder class and decorates that class for ``torch.compile``: it adds a
base class and replaces ``__init__`` and ``__call__`` on the transformers class itself, for
the whole process. With the engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) every
later ``from_pretrained`` of that architecture in the same process then fails (its
``__init__`` asks for a vLLM config), and models built before fail at their first call: the
hf driver and the vllm driver could not run one model side by side. ``classes_kept``
restores the class once the engine is built. vLLM's own instance keeps working: without
the decorated ``__call__`` it runs its eager ``forward`` through ``nn.Module.__call__``,
also in a compiled engine (whose runs with hooks take the eager forward there anyway).

A compiled engine's instance also registered a process-wide dynamo bytecode hook that
calls methods of the decorating base class; with the class restored, the hook would fail
every later ``torch.compile`` in the process (another engine's included), so
``classes_kept`` removes it too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["classes_kept"]


def _decoder_class(config: Any) -> type | None:
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    try:
        cls = MODEL_MAPPING[type(config)]
    except KeyError:
        return None
    return cls if isinstance(cls, type) else None


@contextmanager
def classes_kept(config: Any) -> Iterator[None]:
    """Undo, on exit, any change to the transformers class of ``config``'s decoder.

    Args:
        config: The checkpoint's ``transformers`` config.
    """
    cls = _decoder_class(config)
    if cls is None:
        yield
        return
    bases, saved = cls.__bases__, dict(vars(cls))
    try:
        yield
    finally:
        if cls.__bases__ != bases:
            cls.__bases__ = bases
        for key in set(vars(cls)) - set(saved):
            delattr(cls, key)
        for key, value in saved.items():
            if vars(cls).get(key) is not value:
                setattr(cls, key, value)
        _drop_bytecode_hooks(cls)


def _drop_bytecode_hooks(cls: type) -> None:
    """Remove dynamo bytecode hooks bound to instances of ``cls`` (see the module doc)."""
    from torch._dynamo import convert_frame

    hooks = getattr(convert_frame, "_bytecode_hooks", None)
    if not isinstance(hooks, dict):
        return
    for key, hook in list(hooks.items()):
        if isinstance(getattr(hook, "__self__", None), cls):
            del hooks[key]
