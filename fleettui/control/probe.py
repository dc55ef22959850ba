"""Provides host probing for `fleettui init`: reach a host, check its key, measure it, and size its
fleet entry.

A probe is the first steps of a deployment and nothing more: connect (host key per the host's
policy), preflight (OS, CPU, Python, memory, disk), and, when asked, the offline install of the
worker so that OpenVINO can list the host's devices. From what it measured it proposes the host's
`memory_gb`, `threads` and `device` for the fleet file."""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

from fleettui.config.fleet import Host
from fleettui.errors import ProvisionError
from fleettui.provision.events import Preflight, ProvisionEvent

# the share of a PC's memory the planner may fill; the rest stays with the OS and its user
USABLE_MEMORY = 0.75
GIB = 1 << 30
_ADDRESS = re.compile(
    r"^(?:(?P<user>[^@\s]+)@)?(?P<host>\[[0-9A-Fa-f:.]+\]|[^:@\s\[\]]+)(?::(?P<port>\d+))?$"
)


@dataclass(frozen=True)
class Address:
    """`user@host[:port]` as typed by the operator (`local` is this machine)."""

    host: str
    user: str | None = None
    port: int = 22

    @property
    def is_local(self) -> bool:
        return self.host == "local"


def parse_address(text: str) -> Address:
    """`[user@]host[:port]` (IPv6 in brackets); ValueError with a one-line reason otherwise."""
    match = _ADDRESS.match(text.strip())
    if not match:
        raise ValueError(
            f"{text!r} is not an address: expected [user@]host[:port], e.g. fleet@192.168.1.20"
        )
    port = int(match.group("port") or 22)
    if not 1 <= port <= 65535:
        raise ValueError(f"{text!r}: port {port} is out of range 1..65535")
    return Address(match.group("host").strip("[]"), match.group("user"), port)


def host_name(address: Address, taken: set[str]) -> str:
    """A fleet host name for an address: the address itself (plus the port when not 22), unique."""
    base = re.sub(r"[^A-Za-z0-9_.\-]", "-", address.host).strip("-.") or "host"
    if not base[0].isalnum():
        base = f"pc-{base}"
    name = base if address.port == 22 else f"{base}-{address.port}"
    candidate, number = name, 2
    while candidate in taken:
        candidate, number = f"{name}-{number}", number + 1
    return candidate


@dataclass(frozen=True)
class HostProbe:
    """What a probe found on one host (or why it could not)."""

    host: Host
    ok: bool
    preflight: Preflight | None = None
    host_key: str = ""  # "ssh-ed25519 SHA256:..." as the server presented it
    key_trust: str = ""  # how the key was trusted
    error: str = ""
    step: str = ""

    def proposed(self) -> Host:
        """The host with memory_gb, threads and device set from the measurements."""
        if self.preflight is None:
            return self.host
        preflight = self.preflight
        memory = max(0.1, round(preflight.memory_total / GIB * USABLE_MEMORY, 1))
        devices = [device.split(".")[0] for device in preflight.devices]
        device = "CPU" if not devices or "CPU" in devices else devices[0]
        return replace(
            self.host, memory_gb=memory, threads=max(0, preflight.cpu_count), device=device
        )


async def _probe_ssh(
    host: Host, install: bool, on_event: Callable[[ProvisionEvent], None] | None
) -> HostProbe:
    from fleettui.provision.deploy import HostSession
    from fleettui.provision.ssh import _is_known
    from fleettui.provision.wheelhouse import Target, build_wheelhouse

    # memory_gb stays tiny while probing: the preflight refuses a host with less memory than the
    # file asks.
    session = HostSession(replace(host, memory_gb=0.001), on_event)
    step = "connect"
    try:
        known_before = host.host_key_policy == "tofu" and _is_known(host)
        await session.open()
        key = session.connection.get_server_host_key()
        fingerprint = f"{key.get_algorithm()} {key.get_fingerprint('sha256')}"
        if host.host_key_policy == "tofu" and not known_before:
            trust = f"trusted on first use, now in {host.known_hosts}"
        else:
            trust = f"verified against {host.known_hosts}"
        step = "preflight"
        preflight = await session.run_preflight()
        if install:
            step = "wheelhouse"
            wheelhouse = await build_wheelhouse(
                Target.from_preflight(preflight),
                on_step=lambda text: session.emit("wheelhouse", text),
            )
            step = "install"
            await session.install(wheelhouse)
            step = "devices"
            preflight = await session.probe_devices()
        return HostProbe(host, True, preflight, fingerprint, trust)
    except ProvisionError as error:
        return HostProbe(host, False, error=error.reason, step=error.step)
    except Exception as error:  # asyncssh.Error, OSError: one line, the other hosts go on
        reason = getattr(error, "reason", None) or str(error) or type(error).__name__
        return HostProbe(host, False, error=reason, step=step)
    finally:
        await session.close()


class LocalRunner:
    """Runs the remote operations on this machine (same interface as an asyncssh connection's
    ``run``)."""

    async def run(self, command: str, *, input: str, check: bool = False) -> Any:  # noqa: A002
        process = await asyncio.create_subprocess_shell(
            command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await process.communicate(input.encode())
        return SimpleNamespace(
            stdout=stdout.decode(), stderr=stderr.decode(), exit_status=process.returncode
        )


async def _probe_local(host: Host) -> HostProbe:
    from fleettui.provision.remote import PosixShell, run_operation

    try:
        answer = await run_operation(
            LocalRunner(),
            PosixShell(),
            sys.executable,
            "preflight",
            {"workdir": host.workdir, "venv": ""},
            host=host.name,
            step="preflight",
        )
    except ProvisionError as error:
        return HostProbe(host, False, error=error.reason, step=error.step)
    return HostProbe(host, True, Preflight.from_answer(answer), "", "this machine (no SSH)")


async def probe_hosts(
    hosts: list[Host],
    install: bool = False,
    on_event: Callable[[ProvisionEvent], None] | None = None,
) -> list[HostProbe]:
    """Probe every host concurrently; a host that fails is reported, the others go on."""

    async def one(host: Host) -> HostProbe:
        return await (_probe_local(host) if host.is_local else _probe_ssh(host, install, on_event))

    return list(await asyncio.gather(*(one(host) for host in hosts)))


def describe(probe: HostProbe) -> list[str]:
    """Comment lines (without '#') saying what was measured on a host and how its keys were
    filled."""
    preflight = probe.preflight
    if preflight is None:
        return []
    python = ".".join(map(str, preflight.python))
    lines = [
        f"measured by `fleettui init`: {preflight.os} {preflight.machine}, {preflight.cpu} "
        f"x{preflight.cpu_count}, "
        f"Python {python} ({preflight.python_executable})",
        f"memory {preflight.memory_total / GIB:.1f} GB total, "
        f"{preflight.memory_available / GIB:.1f} GB free; "
        f"disk {preflight.disk_free / GIB:.1f} GB free in {preflight.workdir}",
    ]
    if probe.host_key:
        lines.append(f"host key {probe.host_key} ({probe.key_trust})")
    elif probe.key_trust:
        lines.append(probe.key_trust)
    if preflight.openvino:
        names = ", ".join(f"{name}: {full}" for name, full in preflight.device_names.items())
        lines.append(
            f"OpenVINO {preflight.openvino} devices: {names or ', '.join(preflight.devices)}"
        )
    else:
        lines.append(
            "OpenVINO devices not probed (`fleettui init --install` installs the worker and lists "
            "them)"
        )
    host = probe.proposed()
    lines.append(
        f"memory_gb = {USABLE_MEMORY:.0%} of the memory measured; threads = the "
        f"{preflight.cpu_count} CPUs "
        f"measured; device = {host.device}"
    )
    return lines


def summary(probe: HostProbe) -> str:
    """One line per host for the terminal."""
    if not probe.ok:
        return f"{probe.host.name}: {probe.step}: {probe.error}"
    assert probe.preflight is not None
    host = probe.proposed()
    return (
        f"{probe.host.name}: {probe.preflight.summary()} -> memory_gb {host.memory_gb:g}, threads "
        f"{host.threads}, {host.device}"
    )
