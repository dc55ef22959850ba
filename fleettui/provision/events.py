"""What provisioning reports: progress events per host and the results of deploy, push and stop."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

Step = Literal[
    "compile",
    "connect",
    "preflight",
    "wheelhouse",
    "install",
    "devices",
    "shard",
    "config",
    "launch",
    "ready",
    "done",
    "failed",
    "skipped",
    "stop",
    "logs",
    "prune",
    "calibrate",
]
STEPS: tuple[Step, ...] = get_args(Step)


@dataclass(frozen=True)
class ProvisionEvent:
    """The one deploy event: a host's (or the compiler's) step and, for transfers, bytes done /
    total."""

    host: str
    step: Step
    bytes_done: int = 0
    bytes_total: int = 0
    message: str = ""


@dataclass(frozen=True)
class Preflight:
    """What a host offers, as found by the preflight (devices once the worker is installed)."""

    system: str
    os: str
    machine: str
    cpu: str
    cpu_count: int
    python: tuple[int, int, int]
    python_executable: str
    libc: tuple[str, str]
    workdir: str
    disk_free: int
    memory_total: int
    memory_available: int
    ensurepip: bool
    os_name: str = "posix"
    installed: str | None = None  # digest of the wheelhouse installed in the host's venv, if any
    devices: tuple[str, ...] = ()
    device_names: dict[str, str] = field(default_factory=dict)
    openvino: str | None = None
    # /etc/machine-id (MachineGuid on Windows): which installation answers
    machine_id: str | None = None

    def identity(self) -> dict[str, Any]:
        """What tells one PC from another behind the same address (a calibration profile records
        it)."""
        memory_gb = round(self.memory_total / 2**30, 1)
        return {
            "machine_id": self.machine_id,
            "cpu": self.cpu,
            "cpu_count": self.cpu_count,
            "memory_gb": memory_gb,
        }

    @classmethod
    def from_answer(cls, answer: dict[str, Any]) -> Preflight:
        return cls(
            system=str(answer["system"]),
            os=str(answer["os"]),
            machine=str(answer["machine"]),
            cpu=str(answer["cpu"]),
            cpu_count=int(answer["cpu_count"]),
            python=(int(answer["python"][0]), int(answer["python"][1]), int(answer["python"][2])),
            python_executable=str(answer["python_executable"]),
            libc=(str(answer["libc"][0]), str(answer["libc"][1])),
            workdir=str(answer["workdir"]),
            disk_free=int(answer["disk_free"]),
            memory_total=int(answer["memory_total"]),
            memory_available=int(answer["memory_available"]),
            ensurepip=bool(answer["ensurepip"]),
            os_name=str(answer.get("os_name", "posix")),
            installed=answer.get("installed"),
            machine_id=answer.get("machine_id"),
        )

    def summary(self) -> str:
        python = ".".join(map(str, self.python))
        return (
            f"{self.os} {self.machine}, {self.cpu} x{self.cpu_count}, Python {python}, "
            f"{self.memory_available / 2**30:.1f}/{self.memory_total / 2**30:.1f} GB free, "
            f"{self.disk_free / 2**30:.1f} GB disk"
            + (f", OpenVINO {self.openvino} {'/'.join(self.devices)}" if self.openvino else "")
        )


@dataclass(frozen=True)
class PushResult:
    """One SFTP push: files and bytes actually sent (0 when everything was already there)."""

    files: int
    files_sent: int
    bytes_sent: int
    bytes_total: int
    bytes_resumed: int
    seconds: float

    @property
    def megabytes_per_second(self) -> float:
        return self.bytes_sent / 1e6 / self.seconds if self.seconds > 0 and self.bytes_sent else 0.0


@dataclass(frozen=True)
class RemotePaths:
    """Where one stage lives on its host (absolute, in the host's own path syntax)."""

    workdir: str
    venv_python: str
    wheelhouse: str
    shard: str
    config: str
    log: str
    pidfile: str


def run_file(workdir: str, name: str, base_port: int, suffix: str) -> str:
    """A stage's config, log or pid file on its host, named by host name and port block.

    Two fleets may give a host the same name; only one of them can hold a port block, so deploying a
    stage replaces the previous run on the same ports (which must go to free them) and never another
    fleet's."""
    return f"{workdir}/run/{name}-{base_port}{suffix}"


@dataclass(frozen=True)
class HostDeployment:
    """The outcome of deploying one stage to one host."""

    host: str
    ok: bool
    step: str  # the last step reached (the failing one when not ok)
    error: str | None = None
    stage: int | None = None
    preflight: Preflight | None = None
    paths: RemotePaths | None = None
    installed: bool = False  # False when the same wheelhouse was already installed
    wheelhouse: str | None = None  # digest of the wheelhouse the host runs
    wheelhouse_push: PushResult | None = None
    shard_push: PushResult | None = None
    pid: int | None = None


@dataclass(frozen=True)
class DeployReport:
    """All hosts of one deployment; ``deployment`` identifies the processes it started."""

    deployment: str
    hosts: tuple[HostDeployment, ...]

    @property
    def ok(self) -> bool:
        return all(host.ok for host in self.hosts)

    @property
    def failed(self) -> tuple[HostDeployment, ...]:
        return tuple(host for host in self.hosts if not host.ok)

    def host(self, name: str) -> HostDeployment:
        return next(host for host in self.hosts if host.host == name)

    def summary(self) -> str:
        lines = []
        for host in self.hosts:
            if not host.ok:
                lines.append(f"{host.host}: FAILED at {host.step}: {host.error}")
                continue
            push = host.shard_push
            moved = (
                f"shard {push.bytes_sent / 1e6:.1f} MB at {push.megabytes_per_second:.1f} MB/s"
                if push
                else ""
            )
            lines.append(f"{host.host}: stage {host.stage} pid {host.pid}; {moved}".rstrip("; "))
        return "\n".join(lines)


@dataclass(frozen=True)
class StoppedProcess:
    pidfile: str
    pid: int | None
    action: str  # terminated | killed | none
    detail: str


@dataclass(frozen=True)
class HostStop:
    host: str
    ok: bool
    processes: tuple[StoppedProcess, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class StopReport:
    hosts: tuple[HostStop, ...]

    @property
    def ok(self) -> bool:
        return all(host.ok for host in self.hosts)

    def summary(self) -> str:
        lines = []
        for host in self.hosts:
            if not host.ok:
                lines.append(f"{host.host}: could not stop: {host.error}")
            for process in host.processes:
                lines.append(f"{host.host}: pid {process.pid}: {process.action} ({process.detail})")
            if host.ok and not host.processes:
                lines.append(f"{host.host}: nothing was running")
        return "\n".join(lines)
