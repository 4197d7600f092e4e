"""Run nox's default sessions in two lanes at once, each session's log printed whole when it ends.

``python -m nox`` runs the sessions one after another. Most of a session is one Python
process (a test suite on tiny models, pip unpacking wheels), so on a 2-core machine one core
sits idle for most of the run. This runner runs the lanes of ``LANES`` side by side, each
lane's sessions in order.

Each session is a separate ``python -m nox -s NAME`` with its output in
``.nox/_logs/NAME.log``; that log is printed when the session ends, so two sessions' lines
never interleave. Every few minutes a line says what is still running. At the end a table
gives each session's result, lane, start and duration; the exit status is 1 if any failed.

Usage: ``python scripts/run_sessions.py [SESSION ...]`` (default: nox's default sessions,
each in its lane). Anything after ``--`` goes to every nox call (for example ``-- -r``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOGS = ROOT / ".nox" / "_logs"

#: The lanes, each a list of sessions run in order. The vllm session holds the longest chain
#: (about 40 minutes) and runs alone. The ray session opens the other lane: it is done (about
#: 4 minutes) while the vllm session still installs vLLM and runs its first engine tests, long
#: before that suite's Ray-executor test, so two Ray clusters never run at once (it ran
#: before vllm in lane 0, adding its 4 minutes to the wall while lane 1 idled from 28).
#: A default session missing here joins the lane with the fewest sessions; a session named
#: here that nox does not run by default is left out.
LANES: tuple[tuple[str, ...], ...] = (
    ("vllm",),
    (
        "ray",
        "docs",
        "tests(package='tl-driver-hf')",
        "tests(package='tl-driver-inspect')",
        "transformer_lens",
        "parity",
        "integration",
        "typecheck",
        "tests(package='tl-core')",
        "tests(package='tl-parity')",
        "tests(package='_template')",
        "demo",
        "lint",
    ),
)
#: Environment each lane's sessions get, unless the caller set the variable. Lane 1's
#: sessions run tiny models one thread each: torch would take both cores, and with the vLLM
#: lane's engines (OpenMP threads bound to every core) and compiles beside it, two lanes of
#: two threads each oversubscribed the machine (tl-core's suite took 7:19 beside the vLLM
#: lane against 1-2 minutes alone).
LANE_ENV: tuple[dict[str, str], ...] = ({}, {"OMP_NUM_THREADS": "1"})
#: How often a line says what is still running.
HEARTBEAT_S = 300.0


@dataclass
class Outcome:
    """One session's run: its lane, when it started (seconds into the run) and how it ended."""

    name: str
    lane: int
    log: Path
    start: float = 0.0
    seconds: float = 0.0
    returncode: int | None = None


def default_sessions() -> list[str]:
    """The sessions ``python -m nox`` would run, as nox names them."""
    listed = subprocess.run(
        [sys.executable, "-m", "nox", "--list", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return [entry["session"] for entry in json.loads(listed.stdout)]


def plan_lanes(sessions: list[str]) -> list[list[str]]:
    """``sessions`` placed in ``LANES`` (in their order there); any other joins the lane with
    the fewest sessions."""
    lanes = [[name for name in lane if name in sessions] for lane in LANES]
    for name in sessions:
        if not any(name in lane for lane in lanes):
            min(lanes, key=len).append(name)
    return [lane for lane in lanes if lane]


def log_name(session: str) -> str:
    """A file name for a session's log (``tests(package='tl-core')`` -> ``tests-tl-core``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", session.replace("package=", "")).strip("-")


def _clock(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}:{rest:02d}"


class Runner:
    """Runs each lane's sessions in order, the lanes side by side."""

    def __init__(
        self, lanes: list[list[str]], command: Callable[[str], list[str]], logs: Path = LOGS
    ) -> None:
        self.lanes = lanes
        self.command = command
        self.logs = logs
        self.began = time.monotonic()
        self.outcomes: list[Outcome] = []
        self.running: dict[str, tuple[Outcome, subprocess.Popen[bytes]]] = {}
        self.stopping = False
        self.lock = threading.Lock()

    def _lane(self, lane: int) -> None:
        for name in self.lanes[lane]:
            log = self.logs / f"{log_name(name)}.log"
            with self.lock:
                if self.stopping:
                    return
                outcome = Outcome(name, lane, log, start=time.monotonic() - self.began)
                self.outcomes.append(outcome)
                with log.open("wb") as handle:
                    extra = LANE_ENV[lane] if lane < len(LANE_ENV) else {}
                    process = subprocess.Popen(
                        self.command(name),
                        cwd=ROOT,
                        env={**extra, **os.environ},
                        stdout=handle,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # so its whole process group can be stopped
                    )
                self.running[name] = (outcome, process)
                print(f"ci: {_clock(outcome.start)} lane {lane}: {name} started", flush=True)
            returncode = process.wait()
            with self.lock:
                del self.running[name]
                outcome.seconds = time.monotonic() - self.began - outcome.start
                outcome.returncode = returncode
                status = "passed" if returncode == 0 else f"FAILED (exit {returncode})"
                print(f"\n===== {name}: {status} in {_clock(outcome.seconds)} (lane {lane}) =====")
                sys.stdout.flush()
                sys.stdout.buffer.write(log.read_bytes())
                print(f"===== end of {name} =====\n", flush=True)

    def _heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(HEARTBEAT_S):
            with self.lock:
                now = time.monotonic() - self.began
                busy = ", ".join(
                    f"{n} ({_clock(now - o.start)})" for n, (o, _) in self.running.items()
                )
                print(f"ci: {_clock(now)}: running {busy or 'nothing'}", flush=True)

    def stop_all(self) -> None:
        """Start no more sessions and stop the running ones (their process groups)."""
        with self.lock:
            self.stopping = True
            for _, process in self.running.values():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)

    def run(self) -> list[Outcome]:
        """Run every lane to its end; each session's outcome, in the order they started."""
        self.logs.mkdir(parents=True, exist_ok=True)
        stop = threading.Event()
        threading.Thread(target=self._heartbeat, args=(stop,), daemon=True).start()
        workers = [threading.Thread(target=self._lane, args=(i,)) for i in range(len(self.lanes))]
        for worker in workers:
            worker.start()
        try:
            for worker in workers:
                while worker.is_alive():
                    worker.join(timeout=1.0)
        except KeyboardInterrupt:
            self.stop_all()
            for worker in workers:
                worker.join()
            raise
        finally:
            stop.set()
        return sorted(self.outcomes, key=lambda o: o.start)


def summary(outcomes: list[Outcome], wall: float) -> str:
    """The closing table: each session's result, lane, start and duration."""
    width = max(len(o.name) for o in outcomes)
    lines = [f"{'session':<{width}}  result  lane  start   took"]
    for o in outcomes:
        result = "passed" if o.returncode == 0 else "FAILED"
        lines.append(
            f"{o.name:<{width}}  {result:<6}  {o.lane:>4}  {_clock(o.start):>5}  {_clock(o.seconds):>5}"
        )
    serial = sum(o.seconds for o in outcomes)
    lines.append(f"wall {_clock(wall)} for {_clock(serial)} of sessions")
    return "\n".join(lines)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    nox_args: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, nox_args = args[:cut], args[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sessions", nargs="*", help="nox session names (default: nox's defaults)")
    options = parser.parse_args(args)
    known = default_sessions()
    unknown = [s for s in options.sessions if s not in known]
    if unknown:
        parser.error(
            f"not among nox's default sessions: {', '.join(unknown)} "
            "(python -m nox --list names them; run any other with python -m nox -s NAME)"
        )
    lanes = plan_lanes(options.sessions or known)
    for i, lane in enumerate(lanes):
        print(f"ci: lane {i}: {', '.join(lane)}", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
    runner = Runner(lanes, lambda name: [sys.executable, "-m", "nox", "-s", name, *nox_args])
    try:
        outcomes = runner.run()
    except KeyboardInterrupt:
        print("ci: interrupted; the running sessions were stopped", file=sys.stderr)
        return 130
    print(summary(outcomes, time.monotonic() - runner.began), flush=True)
    failed = [o.name for o in outcomes if o.returncode != 0]
    if failed:
        print(f"ci: failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
