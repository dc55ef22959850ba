"""Provides CurveZMQ link security for a worker: server sockets, a ZAP allow-list and the client
link onward."""

from __future__ import annotations

import logging

import zmq
from zmq.utils import z85

from remote_worker.config import ConfigError, CurveKeys

logger = logging.getLogger(__name__)

ZAP_DOMAIN = "fleettui"
PLAINTEXT_WARNING = "PLAINTEXT: links are neither encrypted nor authenticated"
KEY_LENGTH = 40  # a Z85-encoded 32-byte Curve25519 key


def generate_keypair() -> tuple[str, str]:
    """A new Curve25519 key pair as Z85 text: (public, secret)."""
    public, secret = zmq.curve_keypair()
    return public.decode("ascii"), secret.decode("ascii")


def _key(value: str | None, name: str) -> bytes:
    if not isinstance(value, str) or len(value) != KEY_LENGTH:
        raise ConfigError(f"curve.{name}: expected a {KEY_LENGTH}-character Z85 key")
    try:
        z85.decode(value.encode("ascii"))
    except (ValueError, UnicodeEncodeError, KeyError):
        raise ConfigError(f"curve.{name}: not a Z85 key") from None
    return value.encode("ascii")


class _AllowList:
    """ZAP credentials provider: a client passes only if its public key is listed."""

    def __init__(self, allowed: set[bytes]) -> None:
        self.allowed = allowed
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        self.refused += 1
        if (
            self.refused <= 3 or self.refused % 100 == 0
        ):  # a refused peer reconnects ~10 times a second
            logger.warning(
                "refused a CURVE client with an unknown key %s… (%d refusals so far)",
                key[:8].decode("ascii", "replace"),
                self.refused,
            )
        return False


class LinkSecurity:
    """Applies a worker's CurveKeys to its sockets; with no keys, plaintext (and says so loudly)."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], curve: CurveKeys | None) -> None:
        self.curve = curve
        self._authenticator = None
        self._allow: _AllowList | None = None
        if curve is None:
            logger.warning(PLAINTEXT_WARNING)
            # A ZAP handler that lets every peer in still makes libzmq refuse unversioned (ZMTP/1.0)
            # peers: raw garbage on a port then fails its handshake instead of parsing as ZMTP/1.0
            # frames (which stalled the control socket for seconds).
            from zmq.auth.thread import ThreadAuthenticator

            self._authenticator = ThreadAuthenticator(
                context, log=logging.getLogger(f"{__name__}.zap")
            )
            self._authenticator.start()
            return
        self._public = _key(curve.public_key, "public_key")
        self._secret = _key(curve.secret_key, "secret_key")
        if not curve.allowed_clients:
            raise ConfigError("curve.allowed_clients: at least one client key is required")
        allowed = {_key(client, "allowed_clients") for client in curve.allowed_clients}
        self._next = (
            _key(curve.next_server_key, "next_server_key") if curve.next_server_key else None
        )
        self._loop = (
            _key(curve.loop_server_key, "loop_server_key") if curve.loop_server_key else None
        )
        from zmq.auth.thread import ThreadAuthenticator

        self._allow = _AllowList(allowed)
        self._authenticator = ThreadAuthenticator(context, log=logging.getLogger(f"{__name__}.zap"))
        self._authenticator.start()
        self._authenticator.configure_curve_callback(
            domain=ZAP_DOMAIN, credentials_provider=self._allow
        )
        logger.info("CURVE: encrypted links; %d client key(s) allowed", len(allowed))

    @property
    def mode(self) -> str:
        return "curve" if self.curve is not None else "plaintext"

    @property
    def refused(self) -> int:
        """Clients the ZAP handler turned away so far."""
        return self._allow.refused if self._allow is not None else 0

    def server(self, socket: zmq.Socket[bytes]) -> None:
        """Make a socket that binds a CURVE server guarded by the allow-list (plaintext: ZAP lets
        all in)."""
        socket.zap_domain = ZAP_DOMAIN.encode("ascii")
        if self.curve is None:
            return
        socket.curve_secretkey = self._secret
        socket.curve_publickey = self._public
        socket.curve_server = True

    def client(self, socket: zmq.Socket[bytes], loop: bool = False) -> None:
        """Make the outgoing link a CURVE client of the next stage, or with `loop` of stage 0 (no-op
        in plaintext)."""
        if self.curve is None:
            return
        server = self._loop if loop else self._next
        if server is None:
            name = "loop_server_key" if loop else "next_server_key"
            raise ConfigError(f"curve.{name}: required when the worker sends to that stage")
        socket.curve_secretkey = self._secret
        socket.curve_publickey = self._public
        socket.curve_serverkey = server

    def stop(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None
