"""Binding policy and CURVE: who may listen where, and the keys that let them.

A keys directory, as `generate_keys` writes it:

    server.key  server.key_secret    the coordinator's keypair
    client.key  client.key_secret    a keypair for clients
    authorized/                      optional: the client public keys (*.key) the server accepts

Without `authorized/`, the server accepts every public key `*.key` in the directory except its
own. With it, only the keys inside it, so keys can be added and revoked apart from the keypairs.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import zmq
from zmq.auth import create_certificates, load_certificate
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

SERVER = "server"
CLIENT = "client"
AUTHORIZED = "authorized"

_AUTHENTICATORS: dict[zmq.Context, ThreadAuthenticator] = {}


def is_loopback(endpoint: str) -> bool:
    """Whether only this machine can reach `endpoint` (ipc:// and inproc:// always can)."""
    transport, _, address = endpoint.partition("://")
    if transport in ("ipc", "inproc"):
        return True
    if transport != "tcp":
        return False
    host = address.rpartition(":")[0].removeprefix("[").removesuffix("]")
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:  # "*", an interface name or a host name
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def check_bind(endpoint: str, curve_keys: str | None, insecure: bool) -> None:
    """Refuse to listen beyond this machine without CURVE keys, unless told `insecure`."""
    if is_loopback(endpoint) or curve_keys or insecure:
        return
    raise ValueError(
        f"binding {endpoint} needs --curve-keys DIR (see `siding keys`) or --insecure"
    )


def check_links(curve_keys: str | None, insecure: bool) -> None:
    """Refuse worker links (`siding coordinator`'s worker socket, a worker's sockets) without
    CURVE keys, even on loopback, unless told `insecure`: any local user could join them."""
    if curve_keys or insecure:
        return
    raise ValueError("the worker links need --curve-keys DIR, the same on the coordinator and "
                     "every worker (make them with `siding keys DIR`), or --insecure")


def check_http_bind(host: str, api_key: str | None, insecure: bool) -> None:
    """The same rule for the HTTP API: beyond this machine only with an API key."""
    if is_loopback(f"tcp://{host}:0") or api_key or insecure:
        return
    raise ValueError(
        f"serving HTTP on {host} needs --api-key KEY (or --api-key-file PATH) or --insecure"
    )


def generate_keys(keys_dir: str | os.PathLike) -> Path:
    """Write a server and a client keypair into `keys_dir`; never overwrites existing keys."""
    path = Path(keys_dir)
    path.mkdir(parents=True, exist_ok=True)
    existing = [p.name for name in (SERVER, CLIENT) for p in path.glob(f"{name}.key*")]
    if existing:
        raise FileExistsError(f"{path} already holds keys ({', '.join(sorted(existing))})")
    for name in (SERVER, CLIENT):
        _, secret_file = create_certificates(path, name)
        os.chmod(secret_file, 0o600)  # zmq writes it with the umask's permissions
    return path


class RejectionCounter:
    """Calls `on_reject()` for every peer of a socket whose handshake failed (no keys, wrong
    keys, not speaking CURVE), from a thread reading the socket's monitor. `stop()` it before
    the context is destroyed: libzmq aborts when a socket closes under a thread using it."""

    EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
              | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

    def __init__(self, socket: zmq.Socket, on_reject):
        self.socket = socket
        self.monitor = socket.get_monitor_socket(self.EVENTS | zmq.EVENT_MONITOR_STOPPED)
        self.on_reject = on_reject
        self.thread = threading.Thread(target=self._read, name="auth-monitor", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.monitor)
            except zmq.ZMQError:  # the context is going away
                return
            if event["event"] & self.EVENTS:
                self.on_reject()
            elif event["event"] == zmq.EVENT_MONITOR_STOPPED:
                return

    def stop(self) -> None:
        """End the thread (the monitor reports itself stopped) and close its socket."""
        try:
            self.socket.disable_monitor()
        except zmq.ZMQError:
            pass
        self.thread.join(2.0)
        if not self.thread.is_alive():
            self.monitor.close(linger=0)



def secure_server(socket: zmq.Socket, keys_dir: str | os.PathLike) -> ThreadAuthenticator:
    """Make `socket` a CURVE server that accepts only the authorized client keys.

    Call before binding. ZeroMQ takes one authenticator per context, so the sockets of a
    context share one (started here, returned; stop it when they close), and each keys
    directory is a ZAP domain of its own: a socket accepts only its own directory's clients.
    """
    path = Path(keys_dir).resolve()
    public, secret = _keypair(path / f"{SERVER}.key_secret")
    allowed = _authorized_keys(path)
    domain = "siding-" + hashlib.sha256(str(path).encode()).hexdigest()[:16]  # ZAP allows 255 B
    auth = _AUTHENTICATORS.get(socket.context)
    if auth is None or not auth.is_alive():
        auth = _AUTHENTICATORS[socket.context] = ThreadAuthenticator(socket.context)
        auth.start()
    auth.configure_curve_callback(
        domain=domain, credentials_provider=SimpleNamespace(callback=lambda _, key: key in allowed)
    )
    socket.zap_domain = domain.encode()
    socket.curve_publickey = public
    socket.curve_secretkey = secret
    socket.curve_server = True
    return auth


def secure_client(
    socket: zmq.Socket, keys_dir: str | os.PathLike | None, server_key: bytes | None = None
) -> None:
    """Make `socket` a CURVE client: its keypair and the server's public key from `keys_dir`.

    `server_key` (Z85) overrides the server key found there; without `keys_dir` the client uses
    a fresh keypair, which only a server that accepts any client key lets in. Call before
    connecting.
    """
    if keys_dir is not None:
        path = Path(keys_dir)
        public, secret = _keypair(path / f"{CLIENT}.key_secret")
        if server_key is None:
            server_key = _public_key(path / f"{SERVER}.key")
    else:
        public, secret = zmq.curve_keypair()
    if server_key is None:
        raise ValueError("a CURVE client needs the server's public key or a keys directory")
    socket.curve_publickey = public
    socket.curve_secretkey = secret
    socket.curve_serverkey = server_key


def _authorized_keys(keys_dir: Path) -> frozenset[bytes]:
    """Z85 public keys of the clients the server accepts (see the module docstring)."""
    where = keys_dir / AUTHORIZED
    if not where.is_dir():
        where = keys_dir
    files = sorted(p for p in where.glob("*.key") if p != keys_dir / f"{SERVER}.key")
    if not files:
        raise ValueError(f"no client public keys (*.key) in {where}")
    return frozenset(_public_key(f) for f in files)


def _keypair(secret_file: Path) -> tuple[bytes, bytes]:
    public, secret = _load(secret_file)
    if secret is None:
        raise ValueError(f"{secret_file} holds no secret key")
    return public, secret


def _public_key(key_file: Path) -> bytes:
    return _load(key_file)[0]


def _load(key_file: Path) -> tuple[bytes, bytes | None]:
    try:
        return load_certificate(key_file)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"cannot read CURVE key {key_file} ({e}); create keys with `siding keys DIR`"
        ) from None
