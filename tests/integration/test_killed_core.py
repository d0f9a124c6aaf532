"""A core killed with SIGKILL leaves its private directory (the frontends' socket, the worker
links' keys made for the run) behind only until the next core starts, which removes it."""

import contextlib
import os
import signal
from pathlib import Path

from coordinator.local_cluster import LocalCluster
from coordinator.run_dir import LOCK


def run_dir(pid: int) -> Path:
    """The run directory whose lock the process `pid` holds."""
    fds = Path(f"/proc/{pid}/fd")
    (lock,) = [p for p in (Path(os.readlink(fd)) for fd in fds.iterdir()) if p.name == LOCK]
    return lock.parent


def test_the_directory_of_a_killed_core_is_gone_once_the_next_core_starts():
    killed = LocalCluster("--model", "synthetic:tiny", timeout=300)
    killed.start()
    try:
        left = run_dir(killed.proc.pid)
        assert (left / "core").exists() and (left / "links" / "server.key_secret").exists()
        os.kill(killed.proc.pid, signal.SIGKILL)
        killed.proc.wait()
        assert left.exists()  # nothing of the dead core's could remove it
        with LocalCluster("--model", "synthetic:tiny", timeout=300) as after:
            assert not left.exists()
            own = run_dir(after.proc.pid)
        assert not own.exists()  # a core that stops removes its own
    finally:
        with contextlib.suppress(ProcessLookupError):  # its workers and frontends, if left
            os.killpg(killed.proc.pid, signal.SIGKILL)
