"""Provides the server's access rules: loopback by default, bearer API keys from a private file."""

from __future__ import annotations

import hmac
import ipaddress
import os
import stat
from pathlib import Path

from fleettui.errors import FleetError


class SecurityError(FleetError):
    """A setting that would expose the fleet; the message says what to change."""


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and 'localhost'; every other name or address is not loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_api_keys(path: Path) -> tuple[str, ...]:
    """Keys from `path`, one per line (blank lines and '#' comments skipped); the file must be
    private."""
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise SecurityError(f"--api-key-file {path}: {error.strerror or error}") from None
    if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecurityError(
            f"--api-key-file {path}: mode {stat.S_IMODE(mode):04o} lets other users read it; chmod "
            f"600 {path}"
        )
    keys = tuple(
        line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")
    )
    if not keys:
        raise SecurityError(f"--api-key-file {path}: no keys in the file (one key per line)")
    short = [index + 1 for index, key in enumerate(keys) if len(key) < 16]
    if short:
        raise SecurityError(
            f"--api-key-file {path}: keys must be at least 16 characters (key {short[0]})"
        )
    return keys


def check_bind(host: str, keys: tuple[str, ...]) -> None:
    """Refuse to expose the fleet beyond this machine without API keys."""
    if not keys and not is_loopback(host):
        raise SecurityError(
            f"refusing to serve on {host} without --api-key-file (only loopback may go keyless)"
        )


class KeyChecker:
    """Bearer-token check in constant time against every key (no early exit on the first match)."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = tuple(key.encode() for key in keys)

    @property
    def required(self) -> bool:
        return bool(self._keys)

    @staticmethod
    def presented(authorization: str | None) -> bytes:
        """The bearer token of an Authorization header (empty for none or another scheme)."""
        scheme, _, token = (authorization or "").partition(" ")
        return token.strip().encode() if scheme.lower() == "bearer" else b""

    def allows(self, authorization: str | None) -> bool:
        if not self._keys:
            return True
        candidate = self.presented(authorization)
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(candidate, key)
        return matched and bool(candidate)
