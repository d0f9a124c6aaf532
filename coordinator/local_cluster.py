"""A cluster in child processes: `siding launch` on free loopback ports, ready when it says so.

Used by `siding demo`, the benchmarks and the integration tests, so all three start clusters the
way a user does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def checkout_env(root: str | None) -> dict[str, str]:
    """The environment of a process that runs the code of the checkout `root` (None: this
    one's)."""
    env = dict(os.environ)
    if root is not None:
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


class LocalCluster:
    def __init__(self, *launch_args: str, timeout: float = 600.0, quiet: bool = True,
                 command: str = "launch", root: str | None = None, log: str | Path | None = None):
        self.args = list(launch_args)
        self.root = root  # another checkout to run the cluster from (a benchmark's baseline)
        self.command = command  # "coordinator" waits for workers started elsewhere
        self.timeout = timeout
        self.quiet = quiet
        self.proc: subprocess.Popen | None = None
        self.endpoint = ""
        self.http = ""  # the OpenAI API's URLs (comma-separated), when launched with --http
        self.stderr: list[str] = []
        self.log = log  # a file that gets every stderr line as it comes (a benchmark's record)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        args = list(self.args)
        if "--listen" not in args:
            args += ["--listen", "tcp://127.0.0.1:*"]
        if "--worker-listen" not in args:
            args += ["--worker-listen", "tcp://127.0.0.1:*"]
        if "--metrics-port" not in args:
            args += ["--metrics-port", "0"]
        env = dict(checkout_env(self.root), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator", self.command, *args], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True, cwd=self.root,
        )
        threading.Thread(target=self._read_stderr, daemon=True).start()
        deadline = time.monotonic() + self.timeout
        ready = threading.Event()
        threading.Thread(target=self._read_stdout, args=(ready,), daemon=True).start()
        while not ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = "".join(self.stderr[-20:])
                raise RuntimeError(f"cluster did not start ({' '.join(args)}):\n{tail}")

    def _read_stdout(self, ready: threading.Event) -> None:
        for line in self.proc.stdout:
            if line.startswith("http "):
                self.http = line.split()[1]
            if line.startswith("ready "):
                self.endpoint = line.split()[1]
                ready.set()

    def _read_stderr(self) -> None:
        with open(self.log, "a", buffering=1) if self.log else contextlib.nullcontext() as log:
            for line in self.proc.stderr:
                self.stderr.append(line)
                if log:
                    log.write(line)
                if not self.quiet:
                    sys.stderr.write(line)

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()
