"""Test hosts with a real OpenSSH sshd each: network namespaces joined by a bridge, or loopback
ports.

``SshHosts(count, root)`` creates ``count`` namespaces with veth links on a private bridge and
addresses 10.77.N.11, .12, ... (N: the first 10.77.N.0/24 not in use here; the bridge is 10.77.N.1),
and starts ``ip netns exec NS /usr/sbin/sshd -D -f CONFIG`` in each, with its own generated host
key, an authorized client key and its own config. Where ``ip netns`` is refused (not root, no
CAP_NET_ADMIN) or FLEETTUI_TEST_SSH=loopback is set, each sshd listens on its own 127.0.0.1 port
instead, and that is printed. ``close()`` kills every sshd and every process left in the namespaces,
then deletes them. Namespaces share this machine's filesystem, so each host gets its own work
directory under ``root``."""

from __future__ import annotations

import atexit
import contextlib
import getpass
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = shutil.which("sshd", path="/usr/sbin:/usr/bin:/sbin:/bin") or "/usr/sbin/sshd"

SSHD_CONFIG = """\
Port {port}
ListenAddress {address}
HostKey {directory}/ssh_host_ed25519_key
PidFile {directory}/sshd.pid
AuthorizedKeysFile {authorized}
StrictModes no
UsePAM no
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
Subsystem sftp internal-sftp
PrintMotd no
MaxStartups 50
MaxSessions 50
LogLevel VERBOSE
"""


def available() -> str | None:
    """Why real-sshd tests cannot run here, or None when they can."""
    if not Path(SSHD).exists():
        return "OpenSSH sshd is not installed (apt-get install -y openssh-server)"
    if shutil.which("ssh-keygen") is None:
        return "ssh-keygen is not installed"
    return None


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (namespace hosts share this machine's pid
    space)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check)


def keygen(path: Path, comment: str) -> str:
    """An ed25519 key pair at path / path.pub; returns the public key line."""
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path))
    return path.with_suffix(".pub").read_text().strip()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class SshHost:
    """One test host: where its sshd listens and its private folders."""

    name: str
    address: str
    port: int
    namespace: str | None
    directory: Path
    workdir: Path
    host_key: str  # public host key line (type + base64)
    process: subprocess.Popen[bytes] | None = None

    @property
    def known_hosts_line(self) -> str:
        pattern = self.address if self.port == 22 else f"[{self.address}]:{self.port}"
        return f"{pattern} {' '.join(self.host_key.split()[:2])}"


_INSTANCES = itertools.count()


class SshHosts:
    """Two or three real sshd hosts for a test session; use as a context manager."""

    def __init__(self, count: int, root: Path) -> None:
        self.count = count
        self.root = Path(root)
        self.tag = f"{os.getpid() % 100000}{next(_INSTANCES) % 10}"  # two sets alive at once differ
        self.hosts: list[SshHost] = []
        self.mode = "netns"
        self.bridge: str | None = None
        self.subnet: str | None = None
        self.client_key = self.root / "client_key"
        self.other_key = self.root / "other_key"
        self.known_hosts = self.root / "known_hosts"
        self.authorized = self.root / "authorized_keys"

    # --- set-up ----------------------------------------------------------------------------------

    def __enter__(self) -> SshHosts:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> SshHosts:
        self.root.mkdir(parents=True, exist_ok=True)
        client = keygen(self.client_key, "fleettui-test-client")
        keygen(self.other_key, "fleettui-test-not-authorized")
        self.authorized.write_text(client + "\n")
        if os.geteuid() == 0:
            # sshd's privilege-separation directory
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        reason = self._namespaces_refused()
        if reason:
            self.mode = "loopback"
            print(
                f"network namespaces refused ({reason}): falling back to sshd on 127.0.0.1 ports",
                file=sys.stderr,
            )
        else:
            atexit.register(self.close)
            self._make_network()
        for index in range(self.count):
            self.hosts.append(self._make_host(index))
        self.known_hosts.write_text("".join(host.known_hosts_line + "\n" for host in self.hosts))
        for index in range(self.count):
            self.start_sshd(index)
        return self

    def _namespaces_refused(self) -> str | None:
        if os.environ.get("FLEETTUI_TEST_SSH") == "loopback":
            return "FLEETTUI_TEST_SSH=loopback"
        if shutil.which("ip") is None:
            return "iproute2 is not installed"
        probe = f"ftp{self.tag}"
        result = _run("ip", "netns", "add", probe, check=False)
        if result.returncode != 0:
            return result.stderr.strip() or "ip netns add failed"
        _run("ip", "netns", "del", probe, check=False)
        result = _run("ip", "link", "add", f"ftq{self.tag}", "type", "bridge", check=False)
        if result.returncode != 0:
            return "cannot create a bridge: " + (result.stderr.strip() or "ip link add failed")
        _run("ip", "link", "del", f"ftq{self.tag}", check=False)
        return None

    def _make_network(self) -> None:
        used = _run("ip", "-4", "-o", "addr", "show").stdout
        third = next(n for n in range(256) if f" 10.77.{n}." not in used)
        self.subnet = f"10.77.{third}"
        self.bridge = f"ftb{self.tag}"
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")

    def _make_host(self, index: int) -> SshHost:
        name = f"host{index}"
        directory = self.root / name
        (directory / "work").mkdir(parents=True, exist_ok=True)
        host_key = keygen(directory / "ssh_host_ed25519_key", name)
        if self.mode == "netns":
            assert self.subnet and self.bridge
            namespace = f"ft{self.tag}-{index}"
            outside, inside = f"ftv{self.tag}{index}", f"fte{self.tag}{index}"
            address = f"{self.subnet}.{11 + index}"
            _run("ip", "netns", "add", namespace)
            _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            _run("ip", "link", "set", inside, "netns", namespace)
            _run("ip", "link", "set", outside, "master", self.bridge)
            _run("ip", "link", "set", outside, "up")
            _run(
                "ip",
                "netns",
                "exec",
                namespace,
                "ip",
                "addr",
                "add",
                f"{address}/24",
                "dev",
                inside,
            )
            _run("ip", "netns", "exec", namespace, "ip", "link", "set", inside, "up")
            _run("ip", "netns", "exec", namespace, "ip", "link", "set", "lo", "up")
            _run(
                "ip",
                "netns",
                "exec",
                namespace,
                "ip",
                "route",
                "add",
                "default",
                "via",
                f"{self.subnet}.1",
            )
            port = 22
        else:
            namespace, address, port = None, "127.0.0.1", _free_port()
        config = SSHD_CONFIG.format(
            port=port, address=address, directory=directory, authorized=self.authorized
        )
        (directory / "sshd_config").write_text(config)
        return SshHost(name, address, port, namespace, directory, directory / "work", host_key)

    # --- control ---------------------------------------------------------------------------------

    def command(self, host: SshHost, *argv: str) -> list[str]:
        """argv as run inside the host's namespace (unchanged in loopback mode)."""
        return ["ip", "netns", "exec", host.namespace, *argv] if host.namespace else list(argv)

    def start_sshd(self, index: int) -> None:
        host = self.hosts[index]
        log = open(host.directory / "sshd.log", "ab")  # noqa: SIM115 - kept open for the daemon's life
        argv = self.command(host, SSHD, "-D", "-e", "-f", str(host.directory / "sshd_config"))
        host.process = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if host.process.poll() is not None:
                text = (host.directory / "sshd.log").read_text(errors="replace")
                raise RuntimeError(f"sshd of {host.name} exited: {text[-500:]}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection((host.address, host.port), timeout=0.5),
            ):
                return
            time.sleep(0.05)
        raise RuntimeError(f"sshd of {host.name} does not answer on {host.address}:{host.port}")

    def stop_sshd(self, index: int) -> None:
        """Take a host down: its sshd stops listening (sessions already open stay until closed)."""
        host = self.hosts[index]
        if host.process is not None and host.process.poll() is None:
            host.process.terminate()
            try:
                host.process.wait(5)
            except subprocess.TimeoutExpired:
                host.process.kill()
                host.process.wait(5)
        host.process = None

    def set_link(self, index: int, up: bool) -> None:
        """Cut a host off the network (its link down: nothing in or out, processes keep running)
        or restore it."""
        host = self.hosts[index]
        if not host.namespace:
            raise RuntimeError("a link can only be cut in network-namespace mode")
        state = "up" if up else "down"
        _run(*self.command(host, "ip", "link", "set", f"fte{self.tag}{index}", state))
        if up:  # the default route went with the link
            _run(
                *self.command(host, "ip", "route", "replace", "default", "via", f"{self.subnet}.1")
            )

    def namespace_pids(self, host: SshHost) -> list[int]:
        if not host.namespace:
            return []
        output = _run("ip", "netns", "pids", host.namespace, check=False).stdout
        return [int(pid) for pid in output.split()]

    def fleet_toml(
        self, *, python: str = "python3", memory_gb: float = 1.0, extra: str = ""
    ) -> str:
        """A fleet file for these hosts (ssh transport, root, the test keys and known_hosts)."""
        parts = []
        for host in self.hosts:
            parts.append(
                f'[[hosts]]\nname = "{host.name}"\ntransport = "ssh"\naddress = "{host.address}"\n'
                f'ssh_port = {host.port}\nuser = "{getpass.getuser()}"\nidentity_file = '
                f'"{self.client_key}"\n'
                f'known_hosts = "{self.known_hosts}"\npython = "{python}"\nworkdir = '
                f'"{host.workdir}"\n'
                f"memory_gb = {memory_gb}\n{extra}\n"
            )
        return "\n".join(parts)

    def close(self) -> None:
        for index in range(len(self.hosts)):
            with contextlib.suppress(Exception):
                self.stop_sshd(index)
        for index, host in enumerate(self.hosts):
            for pid in self.namespace_pids(host):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 5
            while self.namespace_pids(host) and time.monotonic() < deadline:
                time.sleep(0.05)
            if host.namespace:
                _run("ip", "link", "del", f"ftv{self.tag}{index}", check=False)
                _run("ip", "netns", "del", host.namespace, check=False)
                host.namespace = None
        if self.bridge:
            _run("ip", "link", "del", self.bridge, check=False)
            self.bridge = None
