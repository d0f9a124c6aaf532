"""Binding policy, and CURVE end to end: the right keys get answers, other keys get nothing."""

from __future__ import annotations

import shutil
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq

from coordinator.config import CoordinatorConfig
from protocol import Client, ErrorCode, RequestError
from protocol.messages import StatusReply
from protocol.security import check_bind, generate_keys, is_loopback, secure_server
from protocol.wire import decode, encode


@pytest.mark.parametrize(
    ("endpoint", "local"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.3.4.5:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True),
        ("tcp://[::ffff:127.0.0.1]:5555", True),
        ("tcp://127.0.0.1:*", True),
        ("ipc:///tmp/siding.sock", True),
        ("inproc://coordinator", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://[::]:5555", False),
        ("tcp://10.0.0.7:5555", False),
        ("tcp://192.168.1.2:5555", False),
        ("tcp://eth0:5555", False),
        ("tcp://example.com:5555", False),
        ("tcp://localhost.example.com:5555", False),
        ("ws://127.0.0.1:5555", False),
        ("epgm://eth0;239.192.1.1:5555", False),
    ],
)
def test_is_loopback(endpoint, local):
    assert is_loopback(endpoint) is local


def test_check_bind_allows_loopback_keys_or_insecure_and_refuses_the_rest():
    check_bind("tcp://127.0.0.1:5555", None, False)
    check_bind("tcp://0.0.0.0:5555", "/etc/siding/keys", False)
    check_bind("tcp://0.0.0.0:5555", None, True)
    with pytest.raises(ValueError) as e:
        check_bind("tcp://0.0.0.0:5555", None, False)
    assert str(e.value) == (
        "binding tcp://0.0.0.0:5555 needs --curve-keys DIR (see `siding keys`) or --insecure"
    )


def test_a_coordinator_without_workers_of_its_own_needs_keys_or_insecure_even_on_loopback():
    with pytest.raises(ValueError, match=r"the worker links need --curve-keys DIR.*`siding keys"):
        CoordinatorConfig(spawn_workers=False)
    CoordinatorConfig(spawn_workers=False, curve_keys="/etc/siding/keys")
    CoordinatorConfig(spawn_workers=False, insecure=True)
    CoordinatorConfig()  # `launch` makes keys for the links of the workers it starts


def test_generate_keys_writes_two_keypairs_with_private_secrets_and_never_overwrites(tmp_path):
    keys = tmp_path / "keys"
    generate_keys(keys)
    names = ["client.key", "client.key_secret", "server.key", "server.key_secret"]
    assert sorted(p.name for p in keys.iterdir()) == names
    assert stat.S_IMODE((keys / "server.key_secret").stat().st_mode) == 0o600
    before = (keys / "server.key_secret").read_bytes()
    with pytest.raises(FileExistsError):
        generate_keys(keys)
    assert (keys / "server.key_secret").read_bytes() == before


@contextmanager
def curve_servers(*keys_dirs: Path) -> Iterator[list[str]]:
    """CURVE ROUTERs, one per keys directory, on one context; each answers with a StatusReply."""
    context = zmq.Context()
    sockets = [context.socket(zmq.ROUTER) for _ in keys_dirs]
    auths = [secure_server(socket, keys) for socket, keys in zip(sockets, keys_dirs, strict=True)]
    endpoints = [f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for s in sockets]
    stop = threading.Event()

    def serve() -> None:
        poller = zmq.Poller()
        for socket in sockets:
            poller.register(socket, zmq.POLLIN)
        while not stop.is_set():
            for socket, _ in poller.poll(10):
                identity, *parts = socket.recv_multipart()
                decode(parts)
                socket.send_multipart([identity, *encode(StatusReply({"secure": True}))])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield endpoints
    finally:
        stop.set()
        thread.join()
        for auth in auths:
            auth.stop()
        for socket in sockets:
            socket.close(linger=0)
        context.term()


@contextmanager
def curve_server(keys: Path) -> Iterator[str]:
    with curve_servers(keys) as (endpoint,):
        yield endpoint


def answered(endpoint: str, keys_dir: Path | None) -> bool:
    """Whether a status request with `keys_dir`'s keys is answered; a refused client hears that
    its handshake was refused (or, its connection dropped, nothing at its silence timeout)."""
    with Client(endpoint, timeout=60, curve_keys_dir=keys_dir and str(keys_dir)) as c:
        try:
            return c.status() == {"secure": True}
        except RequestError as e:
            assert e.code == ErrorCode.UNAVAILABLE, e
            return False


def client_keys(tmp_path: Path, name: str, server_key_from: Path | None) -> Path:
    """A keys directory with a fresh client keypair and, if given, the server key of another."""
    keys = generate_keys(tmp_path / name)
    if server_key_from is not None:
        shutil.copy(server_key_from / "server.key", keys / "server.key")
    return keys


def test_only_clients_with_the_right_keys_are_answered(tmp_path):
    keys = generate_keys(tmp_path / "keys")
    unauthorized = client_keys(tmp_path, "unauthorized", server_key_from=keys)
    wrong_server = client_keys(tmp_path, "wrong-server", server_key_from=None)
    with curve_server(keys) as endpoint:
        assert answered(endpoint, keys)
        assert not answered(endpoint, unauthorized)
        assert not answered(endpoint, wrong_server)
        assert not answered(endpoint, None)  # no CURVE at all


def test_an_authorized_directory_replaces_the_keys_beside_the_keypairs(tmp_path):
    keys = generate_keys(tmp_path / "keys")
    listed = client_keys(tmp_path, "listed", server_key_from=keys)
    (keys / "authorized").mkdir()
    shutil.copy(listed / "client.key", keys / "authorized" / "listed.key")
    with curve_server(keys) as endpoint:
        assert answered(endpoint, listed)
        assert not answered(endpoint, keys)


def test_a_server_without_client_keys_refuses_to_start(tmp_path):
    keys = generate_keys(tmp_path / "keys")
    (keys / "authorized").mkdir()
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    with pytest.raises(ValueError) as e:
        secure_server(socket, keys)
    socket.close(linger=0)
    assert str(e.value) == f"no client public keys (*.key) in {keys / 'authorized'}"


def test_sockets_of_one_context_each_accept_only_their_own_clients(tmp_path):
    first = generate_keys(tmp_path / "first")
    second = generate_keys(tmp_path / "second")
    with curve_servers(first, second) as (first_endpoint, second_endpoint):
        assert answered(first_endpoint, first)
        assert answered(second_endpoint, second)
        crossing = tmp_path / "crossing"  # second's client, pointed at the first server
        crossing.mkdir()
        for name in ("client.key", "client.key_secret"):
            shutil.copy(second / name, crossing / name)
        shutil.copy(first / "server.key", crossing / "server.key")
        assert not answered(first_endpoint, crossing)


def test_a_refused_client_hears_unavailable_at_its_silence_timeout_not_its_timeout(tmp_path):
    """After a refused handshake ZeroMQ may drop the connection, and a send then waits for a
    peer that never comes: it gives up at the silence timeout, as a silent server does."""
    keys = generate_keys(tmp_path / "keys")
    with curve_server(keys) as endpoint:
        for delay in (0.0, 1.5):  # sent at once, or once the refused connection is gone
            with Client(endpoint, timeout=30, silence_timeout=1.0) as c:
                time.sleep(delay)
                t0 = time.monotonic()
                with pytest.raises(RequestError) as e:
                    c.status()
                assert e.value.code == "unavailable" and time.monotonic() - t0 < 15  # not 30
