"""Engine lifecycle: shut vLLM down and leave no processes or socket files behind."""

from __future__ import annotations

import contextlib
import gc
import os
import stat
from typing import Any

__all__ = ["children", "shutdown", "socket_files"]


def socket_files() -> set[str]:
    """IPC socket files in vLLM's RPC folder (the multiprocess engine leaves its own behind)."""
    import vllm.envs

    base = vllm.envs.VLLM_RPC_BASE_PATH
    try:
        with os.scandir(base) as entries:
            return {e.path for e in entries if stat.S_ISSOCK(e.stat(follow_symlinks=False).st_mode)}
    except OSError:
        return set()


_STDLIB_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def children() -> set[int]:
    """Child processes, without the stdlib's multiprocessing helpers (they live on)."""
    import psutil  # a vLLM dependency

    pids = set()
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if not any(h in " ".join(child.cmdline()) for h in _STDLIB_HELPERS):
                pids.add(child.pid)
    return pids


def _reap(pids: set[int], timeout: float = 30.0) -> None:
    """Wait for the engine processes this driver started; kill those that outlive ``timeout``.

    vLLM's shutdown can leave its engine process unreaped (a zombie) or, when it gives up
    waiting, still running; only the processes that appeared while booting are touched.
    """
    import psutil

    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5.0)


def shutdown(llm: Any, sockets: set[str], processes: set[int]) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        del llm
        gc.collect()
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
        _reap(processes)
        for path in sockets:
            with contextlib.suppress(OSError):
                os.unlink(path)
