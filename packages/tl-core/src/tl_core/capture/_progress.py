"""A one-line progress display: tokens captured, tokens/s, shards, share of the input, ETA."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Redraws one status line on a terminal (every ``interval`` s); elsewhere prints a line
    every ``log_interval`` s, so logs of a long job stay readable."""

    def __init__(
        self,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        interval: float = 0.5,
        log_interval: float = 30.0,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty()
        self.interval = interval if self.tty else log_interval
        self.start = time.perf_counter()
        self._last = self.start
        self.tokens = 0
        self.shards = 0
        self.fraction = 0.0
        self._start_fraction: float | None = None

    def update(self, *, tokens: int = 0, shards: int = 0, fraction: float | None = None) -> None:
        """Count captured tokens and written shards; ``fraction`` is the input read so far."""
        self.tokens += tokens
        self.shards += shards
        if fraction is not None:
            if self._start_fraction is None:
                self._start_fraction = fraction  # a resumed run starts part-way in
            self.fraction = fraction
        now = time.perf_counter()
        if self.enabled and now - self._last >= self.interval:
            self._last = now
            self._draw(now)

    def line(self, now: float | None = None) -> str:
        """The current status."""
        elapsed = max((now or time.perf_counter()) - self.start, 1e-9)
        rate = self.tokens / elapsed
        done = self.fraction - (self._start_fraction or 0.0)
        left = 1.0 - self.fraction
        eta = _clock(elapsed * left / done) if done > 0 else "?"
        return (
            f"capture: {self.tokens:,} tokens, {rate:,.0f} tok/s, {self.shards} shards written, "
            f"{self.fraction:.0%} of the input, ETA {eta}"
        )

    def _draw(self, now: float) -> None:
        text = self.line(now)
        if self.tty:
            self.stream.write("\r" + text.ljust(100))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the status line."""
        if self.enabled and self.tty:
            self.stream.write("\r" + self.line().ljust(100) + "\n")
            self.stream.flush()
