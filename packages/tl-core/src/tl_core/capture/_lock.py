"""One writer per store: a lock file naming the process, taken over when that process is gone."""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from types import TracebackType

from tl_core._errors import UserError

__all__ = ["StoreLock"]

LOCK = ".lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as error:
        return error.errno == errno.EPERM  # exists, owned by someone else
    return True


class StoreLock:
    """Held while a capture writes ``folder``; a second writer is refused with the holder named.

    A lock left by a killed process on this host is taken over (the process is gone); one
    held from another host is refused, since its process cannot be checked from here.
    """

    def __init__(self, folder: Path) -> None:
        self.path = folder / LOCK
        self._held = False

    def __enter__(self) -> StoreLock:
        me = f"{os.getpid()} {socket.gethostname()}"
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as handle:
                handle.write(me)
            self._held = True
            return self
        raise UserError(f"could not take the lock {self.path}")

    def _take_over_if_stale(self) -> None:
        try:
            pid_text, _, host = self.path.read_text().partition(" ")
            pid = int(pid_text)
        except (OSError, ValueError):
            pid, host = -1, ""
        if host == socket.gethostname() and pid > 0 and _alive(pid):
            raise UserError(
                f"another capture (process {pid}) is writing {self.path.parent}; wait for it or "
                f"stop it first"
            )
        if host and host != socket.gethostname():
            raise UserError(
                f"{self.path.parent} is locked by a capture on host {host!r} (process {pid}); if "
                f"that job is gone, delete {self.path} and rerun"
            )
        self.path.unlink(missing_ok=True)  # left by a process that no longer runs

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._held:
            self.path.unlink(missing_ok=True)
            self._held = False
