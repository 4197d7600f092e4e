"""Gathering concurrent samples' requests into one engine call.

Each request waits in a worker thread. A short gather window lets the samples that are
generating at the same moment queue up; whichever thread then takes the engine lock runs
every pending request with the same key (same sampling options, same hooks) as one batch
and hands each its own row. Requests that arrive while a batch runs form the next one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Batcher"]


@dataclass(eq=False)
class _Request:
    key: Hashable
    payload: Any
    done: bool = False
    result: Any = None
    error: BaseException | None = None
    ready: threading.Event = field(default_factory=threading.Event)


class Batcher:
    """Run ``run(key, payloads) -> results`` over requests gathered by key.

    Args:
        run: Executes one batch (called under ``lock``); returns one result per payload.
        lock: The engine lock (shared with everything else that touches the engine).
        window_s: How long a new request waits for siblings before taking the lock.
        max_batch: The most requests in one call.
    """

    def __init__(
        self,
        run: Callable[[Hashable, Sequence[Any]], Sequence[Any]],
        lock: threading.RLock,
        *,
        window_s: float = 0.005,
        max_batch: int = 256,
    ) -> None:
        self._run = run
        self._lock = lock
        self._window = window_s
        self._max = max_batch
        self._pending: list[_Request] = []
        self._guard = threading.Lock()
        self.calls = 0  #: engine calls made (for tests and benchmarks)

    def submit(self, key: Hashable, payload: Any) -> Any:
        """Block until ``payload`` has run (batched with others of ``key``); its result."""
        request = _Request(key, payload)
        with self._guard:
            self._pending.append(request)
        time.sleep(self._window)
        while not request.done:
            with self._lock:
                if request.done:
                    break
                with self._guard:
                    group = [r for r in self._pending if r.key == key][: self._max]
                    for r in group:
                        self._pending.remove(r)
                if not group:
                    continue
                try:
                    self.calls += 1
                    results = self._run(key, [r.payload for r in group])
                    for r, result in zip(group, results, strict=True):
                        r.result = result
                except BaseException as error:  # every waiter sees the batch's error
                    for r in group:
                        r.error = error
                for r in group:
                    r.done = True
                    r.ready.set()
        if request.error is not None:
            raise request.error
        return request.result
