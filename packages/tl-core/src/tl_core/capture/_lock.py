"""One writer per store: a lock file naming the process, taken over when that process is gone.

The lock records the holder's process id, host, command line and, where ``/proc`` exists,
the process's start time (with the boot id). A process id is reused once its process has
exited, so a live process with the lock's id holds the lock only when its start time is
the recorded one; a lock whose id now belongs to another process is taken over. A lock
may also name the attempt of a job it belongs to (a part run by a cluster, which starts an
attempt only after the previous one's process died): a later attempt of the same job takes
it over from any host.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from tl_core._errors import UserError

__all__ = ["LOCK", "StoreLock", "process_start"]

LOCK = ".lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as error:
        return error.errno == errno.EPERM  # exists, owned by someone else
    try:  # a zombie (killed, not yet reaped by its parent) writes nothing any more
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2 :].split()[:1] != ["Z"]


def process_start(pid: int) -> str | None:
    """When process ``pid`` started, as ``"<boot id>:<clock ticks since boot>"`` (``None``
    without ``/proc``, or when the process is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    # Fields after the command name (which may hold spaces and parentheses): state is
    # field 3 and the start time field 22 (proc(5)).
    fields = stat[stat.rindex(")") + 2 :].split()
    return f"{boot}:{fields[19]}" if len(fields) > 19 else None


def _command(pid: int) -> str | None:
    """Process ``pid``'s command line (``None`` where it cannot be read)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    text = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    return text[:200] or None


class StoreLock:
    """Held while a capture writes ``folder``; a second writer is refused with the holder named.

    A lock whose process is gone (exited, or its id now taken by a process that started
    later) is taken over, and ``notes`` says so. A lock held from another host is refused,
    since its process cannot be checked from here, as is a lock of a live process whose
    start time the lock does not record (written by an older tl-core); both messages name
    the lock file to delete once the job is known to be gone.
    """

    def __init__(self, folder: Path, *, job: str | None = None) -> None:
        """
        Args:
            folder: The store folder.
            job: What this writer is one attempt of (e.g. a cluster job's part); a lock left
                by another attempt of the same job is taken over wherever it was written,
                since the cluster starts an attempt only after the previous one died.
        """
        self.path = folder / LOCK
        self.job = job
        self.notes: list[str] = []
        self._held = False

    def _me(self) -> str:
        pid = os.getpid()
        return json.dumps(
            {
                "pid": pid,
                "host": socket.gethostname(),
                "started": process_start(pid),
                "command": " ".join(sys.argv)[:200],
                **({"job": self.job} if self.job is not None else {}),
            }
        )

    def __enter__(self) -> StoreLock:
        return self.acquire()

    def acquire(self) -> StoreLock:
        """Take the lock (taking over a stale one); returns ``self``.

        Raises:
            UserError: A live writer holds it, or it cannot be judged stale from here.
        """
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as handle:
                handle.write(self._me())
            self._held = True
            return self
        raise UserError(
            f"could not take the lock {self.path}: other processes keep taking it; check that "
            f"no other capture writes {self.path.parent}, then rerun"
        )

    def _read(self) -> tuple[str, dict[str, Any]]:
        """The lock's text and its fields (``pid`` -1 when it names none)."""
        text = ""
        for _ in range(20):  # a lock just created holds its content a moment later
            try:
                text = self.path.read_text()
            except FileNotFoundError:
                return "", {"pid": -1}
            except OSError:
                break
            if text:
                break
            time.sleep(0.01)
        try:
            fields = json.loads(text)
        except ValueError:
            pid_text, _, host = text.partition(" ")  # "<pid> <host>", tl-core 0.1's format
            fields = {
                "pid": int(pid_text) if pid_text.strip().isdigit() else -1,
                "host": host.strip(),
            }
        if not isinstance(fields, dict) or not isinstance(fields.get("pid"), int):
            fields = {"pid": -1}
        return text, fields

    def _take_over_if_stale(self) -> None:
        text, holder = self._read()
        why = self._stale_reason(holder)
        # Take it over only if it still holds what was judged stale (another writer may
        # have taken it over meanwhile).
        with contextlib.suppress(OSError):
            if self.path.read_text() == text:
                self.path.unlink()
        self.notes.append(f"took over {self.path}, left by a capture that did not finish: {why}")

    def _stale_reason(self, holder: dict[str, Any]) -> str:
        """Why the lock ``holder`` wrote is stale; raises when its writer may still run."""
        pid, host = holder["pid"], holder.get("host") or ""
        folder, here = self.path.parent, socket.gethostname()
        if self.job is not None and holder.get("job") == self.job:
            return f"an earlier attempt of {self.job} (process {pid} on {host or 'an unknown host'}) died"
        if host and host != here:
            raise UserError(
                f"{folder} is locked by a capture on host {host!r} (process {pid}); if that job is "
                f"gone, delete {self.path} and rerun"
            )
        if pid > 0 and _alive(pid):
            started, now = holder.get("started"), process_start(pid)
            command = _command(pid)
            shown = f" ({command})" if command else ""
            if started is not None and now is not None and started != now:
                return (
                    f"its process {pid} has exited; that id now belongs to another process{shown}"
                )
            elif started is not None and started == now:
                raise UserError(
                    f"another capture (process {pid}{shown}) is writing {folder}; wait for it to "
                    f"finish or stop it (kill {pid}), then rerun"
                )
            else:
                capturing = command is not None and "capture" in command
                what = "another capture" if capturing else "a process"
                unknown = (
                    "the lock does not record when that process started"
                    if started is None
                    else "this system does not show when that process started"
                )
                raise UserError(
                    f"{folder} is locked by {self.path}, which names {what} that is still running "
                    f"(process {pid}{shown}); {unknown}, so tl cannot tell it from an unrelated "
                    f"process that got the same id. If no capture is writing {folder}, delete "
                    f"{self.path} and rerun"
                )
        return f"its process {pid} no longer runs" if pid > 0 else "it names no process"

    def release(self) -> None:
        """Remove the lock, if this object holds it."""
        if self._held:
            self.path.unlink(missing_ok=True)
            self._held = False

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.release()
