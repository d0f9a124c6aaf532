"""RunDir: an engine core's private directory (`siding-*` in the temporary directory, mode
0700): the frontends' ipc socket and, for `launch`, the worker links' keys made for the run.

A core removes it when it stops. One killed (SIGKILL, the OOM killer) cannot, so the directory
says whether its owner lives: the core holds an flock on `owner.lock` inside it, which the
kernel drops when the process dies however it dies. Every core, as it starts, removes the
directories of this user whose lock it can take. A lock is no pid: it is neither reused nor
misread across pid namespaces sharing one /tmp.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tempfile
from pathlib import Path

PREFIX = "siding-"
LOCK = "owner.lock"


class RunDir:
    def __init__(self):
        sweep()
        self.path = Path(tempfile.mkdtemp(prefix=PREFIX))
        # Locked before it has its name, so a sweep never finds the lock free in a live one.
        unnamed = self.path / f".{LOCK}"
        self.lock = os.open(unnamed, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self.lock, fcntl.LOCK_EX)
        unnamed.rename(self.path / LOCK)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self.lock)


def sweep() -> None:
    """Remove the run directories whose core died without removing them."""
    uid = os.getuid()
    for d in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            st = d.lstat()
            if st.st_uid != uid or not stat.S_ISDIR(st.st_mode):
                continue
            # none: not a run directory, or one not yet named
            fd = os.open(d / LOCK, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # its core lives
            continue
        else:
            shutil.rmtree(d, ignore_errors=True)
        finally:
            os.close(fd)
