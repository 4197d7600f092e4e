"""The ``if __name__ == "__main__":`` guard, checked before vLLM starts a process.

vLLM's multiprocess mode starts its engine core (and tensor- or pipeline-parallel
workers) with the ``spawn`` start method on the CPU build, and whenever CUDA is already
initialised. A spawned child re-imports the parent's main script; if the script boots the
engine at its top level, the child boots one too while it is still bootstrapping, Python
refuses ("An attempt has been made to start a new process before the current process has
finished its bootstrapping phase"), and the parent only reports that the engine core
failed to start. This module sees that situation in the parent, before anything is
spawned, from the call stack and the script's own source.
"""

from __future__ import annotations

import ast
import multiprocessing
import os
import sys
from dataclasses import dataclass
from types import FrameType, ModuleType

from tl_core import ConfigError

__all__ = [
    "UnguardedBoot",
    "check_main_guard",
    "spawned_child_importing_main",
    "unguarded_boot",
    "will_spawn",
]

_MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


@dataclass(frozen=True)
class UnguardedBoot:
    """Where the main script boots the engine outside a ``__main__`` guard.

    Attributes:
        path: The script.
        line: The top-level line of the script that leads to the boot.
    """

    path: str
    line: int


def _is_main_test(test: ast.expr) -> bool:
    """Whether an ``if`` test compares ``__name__`` with ``"__main__"`` (anywhere in it)."""
    for node in ast.walk(test):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
            operands = [node.left, *node.comparators]
            has_name = any(isinstance(o, ast.Name) and o.id == "__name__" for o in operands)
            has_main = any(isinstance(o, ast.Constant) and o.value == "__main__" for o in operands)
            if has_name and has_main:
                return True
    return False


def _module_frame(main: ModuleType, frame: FrameType | None) -> FrameType | None:
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            return frame
        frame = frame.f_back
    return None


def unguarded_boot(frame: FrameType | None = None) -> UnguardedBoot | None:
    """The main script's top-level line that reached this call outside a ``__main__`` guard.

    Args:
        frame: Where to start walking the stack (default: the caller's frame).

    Returns:
        ``None`` when the call does not come from the main script's top-level code, when
        that code is inside an ``if __name__ == "__main__":`` block, or when the script's
        source cannot be read (interactive sessions, ``python -c``, frozen apps: a spawned
        child re-runs nothing there).
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not isinstance(path, str):
        return None
    found = _module_frame(main, frame if frame is not None else sys._getframe(1))
    if found is None:
        return None
    line = found.f_lineno
    try:
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), filename=path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    for statement in tree.body:
        end = statement.end_lineno or statement.lineno
        if not statement.lineno <= line <= end:
            continue
        if isinstance(statement, ast.If) and _is_main_test(statement.test):
            body_end = statement.body[-1].end_lineno or statement.body[-1].lineno
            if statement.body[0].lineno <= line <= body_end:
                return None
        return UnguardedBoot(path, line)
    return None


def spawned_child_importing_main() -> bool:
    """Whether this process is a spawned child still re-importing its parent's main script."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def will_spawn(*, is_cpu: bool) -> bool:
    """Whether vLLM will start its processes with ``spawn`` (which re-imports the script).

    The CPU build always spawns; the CUDA build forks unless told otherwise or CUDA is
    already initialised in this process.
    """
    if is_cpu or os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "spawn":
        return True
    import torch

    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def multiprocess_engine() -> bool:
    """Whether vLLM will run its engine core in a separate process (its default)."""
    try:
        return bool(int(os.environ.get(_MP_ENV, "1") or "1"))  # vLLM's own parsing
    except ValueError:
        return True


def multiprocess_explicit() -> bool:
    """Whether the user set the engine-core mode themselves."""
    return os.environ.get(_MP_ENV, "") != ""


def check_main_guard(*, is_cpu: bool, workers: int, frame: FrameType | None) -> str | None:
    """Make sure the processes vLLM is about to spawn will not re-run the boot.

    When the main script boots the engine at its top level and vLLM would spawn only its
    engine core (one worker), the engine runs in this process instead: nothing is
    spawned, the script works as written, and the returned warning says how to get the
    separate engine process back. When workers must be spawned (tensor or pipeline
    parallelism), or the user asked for the separate engine process explicitly, there
    is no such way out: a ``ConfigError`` says what to change, before anything starts.

    Args:
        is_cpu: Whether this is vLLM's CPU build (which always spawns).
        workers: Tensor- times pipeline-parallel size.
        frame: The frame to walk the stack from (the boot call's).

    Returns:
        A warning to log when the engine was moved in-process, else ``None``.

    Raises:
        ConfigError: The boot would fail in a spawned child, with the fix.
    """
    if spawned_child_importing_main():
        raise ConfigError(
            "boot_vllm() is running in a child process that vLLM spawned while the child "
            "re-imports the main script: the script boots the engine at import time. Put "
            'the code that boots the engine under `if __name__ == "__main__":`'
        )
    spawns_core = multiprocess_engine()
    if not (spawns_core or workers > 1) or not will_spawn(is_cpu=is_cpu):
        return None
    place = unguarded_boot(frame)
    if place is None:
        return None
    where = f"{place.path}, line {place.line}"
    fix = f'put the code that boots the engine under `if __name__ == "__main__":` in {place.path}'
    if workers == 1 and not multiprocess_explicit():
        # One process suffices: vLLM's in-process engine needs no spawned child at all.
        os.environ[_MP_ENV] = "0"
        return (
            f"vllm driver: {where} boots vLLM at the script's top level, outside an "
            '`if __name__ == "__main__":` guard; a spawned engine process would re-run the '
            f"script and fail, so the engine runs in this process ({_MP_ENV}=0 for this "
            f"process). To run vLLM's separate engine process, {fix}"
        )
    reason = (
        f"tensor/pipeline parallelism starts {workers} worker processes"
        if workers > 1
        else f"{_MP_ENV}={os.environ.get(_MP_ENV)!r} asks for a separate engine process"
    )
    raise ConfigError(
        f"boot_vllm() would fail: {reason}, which vLLM starts with the 'spawn' method; a "
        f"spawned process re-imports the main script, and {where} boots the engine at "
        f"its top level, so each child would boot another engine and die with Python's "
        f"'bootstrapping phase' error. Fix: {fix}. Nothing was started."
    )
