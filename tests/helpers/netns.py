"""Several hosts on one machine: network namespaces on a private bridge, and processes in them.

    with Network({"coordinator": "192.0.2.1", "client": "192.0.2.100"}) as net:
        proc = net["coordinator"].start(sys.executable, "-m", "coordinator", ...)

Each host is a namespace with loopback up and one veth (`eth0`, a /24 of RFC 5737's
192.0.2.0/24) whose other end is a port of a bridge in a "switch" namespace of its own. Nothing
is added to the root namespace and no host has a route off the /24, so no packet leaves the
namespaces and the machine's own network is untouched. Needs root and iproute2.

Namespaces are named `sdgt-<pid>-<run>-<role>`: parallel runs do not collide, and a run whose
process is gone (killed before its teardown) is removed, with any process left in it, the next
time a Network is set up.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import threading
import time

PREFIX = "sdgt-"
SUBNET_BITS = 24


def ip(*args: str) -> str:
    """Run `ip args...`; its stdout, or a RuntimeError with its stderr."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> None:
    """Delete this harness's namespaces whose creating process has exited, and what runs in them."""
    for name in namespaces():
        pid = name.removeprefix(PREFIX).split("-")[0]
        if name.startswith(PREFIX) and pid.isdigit() and not _alive(int(pid)):
            _delete(name)


def _delete(name: str) -> None:
    # A namespace outlives its name while a process is in it: those processes are this
    # harness's (nothing else runs in its namespaces), ended by pid before the name goes.
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
    for pid in pids.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)


class Process:
    """A child process with its stdout and stderr read on threads, line by line."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None):
        self.argv = argv
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._changed = threading.Condition()
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(env or os.environ, PYTHONUNBUFFERED="1"), start_new_session=True,
        )
        self._readers = [threading.Thread(target=self._read, args=(f, lines), daemon=True)
                         for f, lines in ((self.proc.stdout, self.stdout),
                                          (self.proc.stderr, self.stderr))]
        for t in self._readers:
            t.start()

    def _read(self, stream, lines: list[str]) -> None:
        for line in stream:
            with self._changed:
                lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for_line(self, prefix: str, timeout: float) -> str:
        """The first stdout line starting with `prefix`; a RuntimeError, with the stderr's
        tail, if the process exits or `timeout` seconds pass first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                line = next((s for s in self.stdout if s.startswith(prefix)), None)
                if line is not None:
                    return line.rstrip("\n")
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    break
                self._changed.wait(min(left, 0.2))
        raise RuntimeError(f"no {prefix!r} line from `{' '.join(self.argv)}` "
                           f"(exit {self.proc.poll()}):\n{self.tail()}")

    def wait(self, timeout: float) -> int:
        """The exit status, once stdout and stderr are read to their end."""
        code = self.proc.wait(timeout)
        for t in self._readers:
            t.join(timeout)
        return code

    def tail(self, lines: int = 30) -> str:
        return "".join(self.stderr[-lines:])

    def stop(self, timeout: float = 15.0) -> None:
        """SIGINT (a siding process drains and exits), then SIGKILL for its whole group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # children it left behind (a coordinator's frontends) share its group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


class Host:
    """One namespace on the network: its name for `ip netns exec`, and its address."""

    def __init__(self, netns: str, address: str):
        self.netns = netns
        self.address = address

    def argv(self, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *cmd]

    def start(self, *cmd: str, env: dict[str, str] | None = None) -> Process:
        return Process(self.argv(*cmd), env)

    def run(self, *cmd: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*cmd), capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))


class Network:
    """Hosts (role -> IPv4 address on one /24) joined by a bridge, for the `with` block."""

    def __init__(self, addresses: dict[str, str]):
        self.addresses = addresses
        self.run_id = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self.run_id}-switch"
        self.hosts: dict[str, Host] = {}
        self._ports: dict[str, str] = {}  # role -> its bridge port in the switch namespace
        self._made: list[str] = []

    def __getitem__(self, role: str) -> Host:
        return self.hosts[role]

    def __enter__(self) -> Network:
        if shutil.which("ip") is None:
            raise RuntimeError("the multi-host tests need iproute2's `ip` (and root)")
        remove_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add(self, name: str) -> None:
        ip("netns", "add", name)
        self._made.append(name)
        ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        sw = self.switch
        self._add(sw)
        ip("-n", sw, "link", "add", "br0", "type", "bridge")  # STP off: ports forward at once
        ip("-n", sw, "link", "set", "br0", "up")
        for i, (role, address) in enumerate(self.addresses.items()):
            name = f"{self.run_id}-{role}"
            self._add(name)
            port = f"p{i}"  # interface names are per namespace, and at most 15 bytes
            ip("-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0",
               "netns", name)
            ip("-n", sw, "link", "set", port, "master", "br0", "up")
            ip("-n", name, "addr", "add", f"{address}/{SUBNET_BITS}", "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")
            self.hosts[role] = Host(name, address)
            self._ports[role] = port

    def link(self, role: str, up: bool) -> None:
        """Cut a host off the network (its bridge port down), or connect it again."""
        ip("-n", self.switch, "link", "set", self._ports[role], "up" if up else "down")

    def close(self) -> None:
        for name in reversed(self._made):
            _delete(name)
        self._made.clear()

