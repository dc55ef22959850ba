"""SSH connections with the fleet file's host-key policy (verify against known_hosts, or trust on
first use)."""

from __future__ import annotations

import asyncio
import getpass
import logging
from typing import Any

import asyncssh

from fleettui.config.fleet import Host
from fleettui.errors import ProvisionError

logger = logging.getLogger(__name__)

# AES-GCM first: with AES-NI it pushes shards faster than asyncssh's chacha20 default
# (docs/performance.md).
CIPHERS = (
    "aes128-gcm@openssh.com",
    "aes256-gcm@openssh.com",
    "chacha20-poly1305@openssh.com",
    "aes128-ctr",
    "aes256-ctr",
)


def _known_host_pattern(host: Host) -> str:
    return host.address if host.ssh_port == 22 else f"[{host.address}]:{host.ssh_port}"


def _is_known(host: Host) -> bool:
    if not host.known_hosts.is_file():
        return False
    try:
        entries = asyncssh.read_known_hosts(str(host.known_hosts))
    except (OSError, ValueError) as error:
        raise ProvisionError(
            host.name, "connect", f"cannot read {host.known_hosts}: {error}"
        ) from None
    keys, authorities, revoked = entries.match(host.address, host.address, host.ssh_port)[:3]
    return bool(keys or authorities or revoked)


def _remember_host_key(host: Host, key: Any) -> None:
    host.known_hosts.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    line = f"{_known_host_pattern(host)} {key.export_public_key('openssh').decode().strip()}\n"
    with open(host.known_hosts, "a", encoding="utf-8") as stream:
        stream.write(line)
    logger.warning("%s: trusted on first use: %s", host.name, line.strip())


async def connect(host: Host, timeout: float = 10.0) -> Any:
    """An SSH connection to ``host`` that honours its host-key policy; ProvisionError explains
    failures."""
    user = host.user or getpass.getuser()
    where = f"{user}@{host.address}:{host.ssh_port}"
    options: dict[str, Any] = {"port": host.ssh_port, "username": user, "connect_timeout": timeout}
    options["keepalive_interval"] = 15
    options["encryption_algs"] = list(CIPHERS)
    if host.identity_file is not None:
        if not host.identity_file.is_file():
            raise ProvisionError(
                host.name, "connect", f"identity_file {host.identity_file} does not exist"
            )
        options["client_keys"] = [str(host.identity_file)]
        options["agent_path"] = None
    tofu = host.host_key_policy == "tofu" and not _is_known(host)
    if tofu:
        options["known_hosts"] = None
    elif host.known_hosts.is_file():
        options["known_hosts"] = str(host.known_hosts)
    else:
        raise ProvisionError(
            host.name,
            "connect",
            f"known_hosts file {host.known_hosts} does not exist: add {host.address}'s key or set "
            'host_key_policy = "tofu"',
        )
    try:
        connection = await asyncssh.connect(host.address, **options)
    except asyncssh.HostKeyNotVerifiable as error:
        raise ProvisionError(
            host.name,
            "connect",
            f"host key of {host.address}:{host.ssh_port} is not trusted by {host.known_hosts} "
            f"({error.reason}); "
            'add it with ssh-keyscan or set host_key_policy = "tofu"',
        ) from None
    except asyncssh.PermissionDenied:
        identity = host.identity_file or "the SSH agent and default keys"
        raise ProvisionError(
            host.name,
            "connect",
            f"authentication refused for {where} with {identity}: is its public key authorized?",
        ) from None
    except (OSError, asyncio.TimeoutError) as error:
        reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
        raise ProvisionError(host.name, "connect", f"cannot reach {where}: {reason}") from None
    except asyncssh.Error as error:
        raise ProvisionError(host.name, "connect", f"{where}: {error.reason}") from None
    if tofu:
        _remember_host_key(host, connection.get_server_host_key())
    return connection
