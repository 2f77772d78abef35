"""CURVE authentication for tcp:// channels (ZeroMQ CURVE + a ZAP handler from zmq.auth).

A session generates one server and one client key pair (``CurveKeys.generate``) and hands them to
its processes. Binding sockets are CURVE servers that accept only the session's client public key;
connecting sockets are CURVE clients that know the server's public key. A peer without the keys
fails the handshake and never delivers a message.

Policy: ``tcp://`` to an address that is not loopback must use CURVE; loopback and ipc/inproc may
run without it, unless ``TransportConfig.curve`` forces it on.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator


@dataclass(frozen=True)
class CurveKeys:
    """Z85-encoded key pairs of a session (picklable, so spawned processes receive them)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)


def is_loopback(endpoint: str) -> bool:
    """True for tcp:// endpoints on 127.0.0.0/8, ::1 or localhost."""
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # an interface name or a hostname: not provably loopback
        return False


def curve_required(endpoint: str, force: bool) -> bool:
    return endpoint.startswith("tcp://") and (force or not is_loopback(endpoint))


class _AllowedKeys:
    """ZAP credentials provider: only the session's client public key is let in."""

    def __init__(self, allowed: set[bytes]) -> None:
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.allowed


class Security:
    """Applies the CURVE policy to the sockets of one zmq context (one ZAP handler per context)."""

    def __init__(self, ctx: zmq.asyncio.Context, keys: CurveKeys | None, force_curve: bool) -> None:
        self.ctx = ctx
        self.keys = keys
        self.force_curve = force_curve
        self._auth: AsyncioAuthenticator | None = None

    def _keys_for(self, endpoint: str) -> CurveKeys | None:
        if not curve_required(endpoint, self.force_curve):
            return None
        if self.keys is None:
            why = "CURVE is forced on" if self.force_curve else "it is not loopback"
            raise PermissionError(f"{endpoint}: CURVE keys are required ({why}) but none were given")
        return self.keys

    def server(self, sock: zmq.asyncio.Socket, endpoint: str) -> None:
        """Make a binding socket a CURVE server if the policy says so (call before bind)."""
        keys = self._keys_for(endpoint)
        if keys is None:
            return
        if self._auth is None:
            self._auth = AsyncioAuthenticator(self.ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", _AllowedKeys({keys.client_public}))
        sock.curve_server = True
        sock.curve_secretkey = keys.server_secret
        sock.curve_publickey = keys.server_public

    def client(self, sock: zmq.asyncio.Socket, endpoint: str) -> None:
        """Make a connecting socket a CURVE client if the policy says so (call before connect)."""
        keys = self._keys_for(endpoint)
        if keys is None:
            return
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey = keys.client_public
        sock.curve_secretkey = keys.client_secret

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
