"""Small shared helpers for the benchmarks: interleaved timing, peak memory, tables.

The benchmarks report ratios to a baseline measured in the same run, never absolute
numbers, so everything here is about making two measurements comparable: variants are
timed in alternating order so slow drift (thermal, other load) hits all of them alike,
and peak memory is read in a fresh process per variant so one variant's allocations
cannot hide or inflate another's.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "PeakMemory",
    "TimingStats",
    "environment_line",
    "format_table",
    "load_average",
    "peak_rss_in_subprocess",
    "summarize",
    "time_call",
    "time_interleaved",
    "write_json",
]

_MARKER = "@@PEAK_RSS@@"


def time_interleaved(
    fns: Mapping[str, Callable[[], object]],
    *,
    repeats: int,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Time several callables in interleaved rounds.

    Every round calls each function once. Odd rounds run the functions in reverse order
    (A B C, C B A, A B C, ...), so a linear drift over the run adds the same amount to
    every variant, and no variant always follows the same neighbour. Each result is
    dropped before the next call starts, so a variant that returns a large cache does
    not leave that memory to the next one.

    Args:
        fns: Variant name -> zero-argument callable doing one measured unit of work.
        repeats: Timed calls per variant (rounds), at least 1.
        warmup: Untimed rounds run first (same interleaving), at least 0.
        clock: Monotonic clock in seconds (injectable for tests).

    Returns:
        Variant name -> ``repeats`` durations in seconds, in the order they were taken.

    Raises:
        ValueError: ``repeats < 1``, ``warmup < 0`` or no functions.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if not fns:
        raise ValueError("time_interleaved needs at least one function to time")
    names = list(fns)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(warmup + repeats):
        order = names if round_index % 2 == 0 else names[::-1]
        for name in order:
            fn = fns[name]
            start = clock()
            result = fn()
            elapsed = clock() - start
            del result
            if round_index >= warmup:
                samples[name].append(elapsed)
    return samples


@dataclass(frozen=True)
class TimingStats:
    """Summary of one variant's durations (seconds).

    Attributes:
        median: Median duration; the number ratios are computed from.
        minimum: Fastest call.
        q1: First quartile.
        q3: Third quartile.
        n: Number of samples.
    """

    median: float
    minimum: float
    q1: float
    q3: float
    n: int


def summarize(samples: Sequence[float]) -> TimingStats:
    """Median, minimum and quartiles of a list of durations.

    Args:
        samples: Durations in seconds (at least one).

    Returns:
        The summary.

    Raises:
        ValueError: ``samples`` is empty.
    """
    if not samples:
        raise ValueError("summarize needs at least one sample")
    ordered = sorted(samples)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return TimingStats(
        median=statistics.median(ordered), minimum=ordered[0], q1=q1, q3=q3, n=len(ordered)
    )


@dataclass(frozen=True)
class PeakMemory:
    """Peak resident memory of one measured step in a child process.

    Attributes:
        before: Resident bytes after ``setup``, just before ``run``.
        peak: Highest resident bytes seen while ``run`` executed (and while its result
            was still held).
        method: How the peak was read: ``"proc-hwm"`` (Linux: the kernel's high-water
            mark, reset right before ``run``) or ``"ru_maxrss"`` (the process's lifetime
            maximum, used where no reset exists; a transient peak during ``setup`` can
            hide part of ``run``'s).
    """

    before: int
    peak: int
    method: str

    @property
    def delta(self) -> int:
        """Bytes the step added on top of what was resident before it (never negative)."""
        return max(0, self.peak - self.before)


# The child resets the kernel's resident high-water mark (Linux ``clear_refs`` "5") right
# before the measured step, so transient peaks of imports and model building do not mask
# the step's own peak; elsewhere it falls back to the lifetime ``ru_maxrss``.
_CHILD = r"""
import json, sys

def _status(key):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None

def _reset_hwm():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False

def _maxrss():
    import resource
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return value if sys.platform == "darwin" else value * 1024

_ns = {"__name__": "__bench_child__"}
exec(compile(SETUP, "<setup>", "exec"), _ns)
import gc
gc.collect()
if _status("VmRSS") is not None and _reset_hwm():
    _method = "proc-hwm"
    _before = _status("VmRSS")
else:
    _method = "ru_maxrss"
    _before = _maxrss()
exec(compile(RUN, "<run>", "exec"), _ns)
_peak = _status("VmHWM") if _method == "proc-hwm" else _maxrss()
print(MARKER + json.dumps({"before": _before, "peak": _peak, "method": _method}))
"""


def peak_rss_in_subprocess(
    setup: str,
    run: str,
    *,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> PeakMemory:
    """Run ``setup`` then ``run`` in a fresh Python and read the peak memory of ``run``.

    Both code strings execute in one shared namespace, so ``run`` sees what ``setup``
    defined. Bind ``run``'s result to a name (``out = fn()``) so it is still alive when
    the peak is read.

    Args:
        setup: Code that imports and builds everything (not measured).
        run: Code whose peak resident memory is measured.
        timeout: Seconds before the child is killed.
        env: Extra environment variables for the child (merged into ``os.environ``).

    Returns:
        Resident bytes before ``run`` and the peak while it ran.

    Raises:
        RuntimeError: The child failed, timed out, or printed no measurement (the
            message includes the end of its stderr).
    """
    source = f"SETUP = {setup!r}\nRUN = {run!r}\nMARKER = {_MARKER!r}\n{_CHILD}"
    child_env = {**os.environ, **(env or {})}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", source],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=child_env,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"memory child timed out after {timeout:.0f} s") from exc
    for line in proc.stdout.splitlines():
        if line.startswith(_MARKER):
            data = json.loads(line[len(_MARKER) :])
            return PeakMemory(
                before=int(data["before"]), peak=int(data["peak"]), method=str(data["method"])
            )
    tail = proc.stderr.strip().splitlines()[-15:]
    raise RuntimeError(
        f"memory child exited with code {proc.returncode} and printed no measurement; "
        "stderr ends with:\n" + "\n".join(tail)
    )


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Lay out a plain-text table: first column left-aligned, the others right-aligned.

    Args:
        header: Column titles.
        rows: Cells, already formatted as strings; each row as long as ``header``.

    Returns:
        The table with a dashed rule under the header (no trailing newline).

    Raises:
        ValueError: A row's length differs from the header's.
    """
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row {list(row)!r} has {len(row)} cells, header has {len(header)}")
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.ljust(width) if index == 0 else cell.rjust(width)
            for index, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(header), rule, *(line(row) for row in rows)])


def load_average() -> tuple[float, float, float] | None:
    """The 1/5/15-minute load averages, or ``None`` where the OS has none (Windows)."""
    try:
        return os.getloadavg()
    except (AttributeError, OSError):
        return None


def environment_line() -> str:
    """One line naming what the numbers depend on: torch, threads, CPUs, GPU, Python.

    Returns:
        For example ``torch 2.5.1 | threads 2 | cpus 2 | cuda none | python 3.11.7 | Linux x86_64``.
    """
    import torch

    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    load = load_average()
    parts = [
        f"torch {torch.__version__}",
        f"threads {torch.get_num_threads()}",
        f"cpus {os.cpu_count()}",
        f"cuda {cuda}",
        f"python {platform.python_version()}",
        f"{platform.system()} {platform.machine()}",
    ]
    if load is not None:
        parts.append(f"load {load[0]:.2f}")
    return " | ".join(parts)


def time_call(fn: Callable[[], Any]) -> tuple[float, float]:
    """Wall-clock and process CPU seconds of one call of ``fn``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def write_json(path: Path | None, payload: Any) -> None:
    """Write ``payload`` as indented JSON to ``path`` (folders created); nothing if ``None``."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
