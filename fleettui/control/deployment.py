"""Provides the deployment: per-stage worker configurations, ports, endpoints and CurveZMQ keys
of one run."""

from __future__ import annotations

import os
import random
import secrets
import socket
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from fleettui.config.fleet import PORTS_PER_HOST, Fleet, Host
from fleettui.runtime.transport import ClientKeys
from remote_worker.config import CurveKeys, Endpoint, StageConfig

LOCALHOST = "127.0.0.1"


def generate_keypair() -> tuple[str, str]:
    """A fresh CurveZMQ key pair as Z85 text (public, secret)."""
    import zmq

    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


def free_port_block(
    count: int = PORTS_PER_HOST, host: str = LOCALHOST, avoid: Iterable[int] = ()
) -> int:
    """A base port whose next `count` ports are free on `host` right now and overlap no block given
    before.

    Chosen below the kernel's ephemeral range: a port from that range (what binding port 0 gives)
    can be taken as the source port of any outgoing connection before the worker binds it ("Address
    already in use" on a busy machine). A block is only free until its worker binds it, so this
    process remembers the blocks it handed out and never hands out an overlapping one (a fleet's
    hosts and its draft are chosen before any of them binds); `avoid` adds ports known to be meant
    for something else. Another process may draw the same block in that window too: each process
    draws first from its own stripe of the range (by process id, one of `PORT_STRIPES`), so two
    commands or test workers at once collide only when their ids share a stripe."""
    low, high = _ephemeral_range()
    first, last = (1024, low) if low - 1024 > 1000 else (high + 1, 65535)
    width = (last - first) // PORT_STRIPES
    start = first + (os.getpid() % PORT_STRIPES) * width
    ranges = [(start, start + width)] * 400 + [(first, last)] * 100  # its stripe, then anywhere
    generator = random.Random()
    avoided = {port for block in _HANDED_OUT for port in block} | set(avoid)
    for low_end, high_end in ranges:
        base = generator.randrange(low_end, high_end - count)
        block = range(base, base + count)
        if avoided.isdisjoint(block) and all(_port_free(host, port) for port in block):
            _HANDED_OUT.append(block)
            return base
    raise RuntimeError("no free block of ports")


PORT_STRIPES = 16
# the blocks this process handed out last (long bound)
_HANDED_OUT: deque[range] = deque(maxlen=512)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535  # the IANA dynamic range (Windows, macOS)


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class Placement:
    """One worker of the deployment: where it runs and the configuration it is started with."""

    host: Host
    config: StageConfig
    connect_address: str  # where the coordinator (and the upstream stage) reach this host

    @property
    def control_url(self) -> str:
        return Endpoint(self.connect_address, self.config.control_port).url()

    @property
    def telemetry_url(self) -> str:
        return Endpoint(self.connect_address, self.config.telemetry_port).url()

    @property
    def data_url(self) -> str:
        return Endpoint(self.connect_address, self.config.data_port).url()

    @property
    def result_url(self) -> str:
        assert self.config.result_port is not None
        return Endpoint(self.connect_address, self.config.result_port).url()

    @property
    def server_key(self) -> str | None:
        return self.config.curve.public_key if self.config.curve else None


@dataclass(frozen=True)
class Deployment:
    id: str
    stages: tuple[Placement, ...]
    draft: Placement | None
    keys: ClientKeys | None  # the coordinator's CurveZMQ key pair; None = plaintext

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self.stages + ((self.draft,) if self.draft is not None else ())

    def ranges(self) -> list[tuple[int, int]]:
        """The layer range [start, end) each stage runs, in pipeline order."""
        spans = (p.config.extra.get("layers", (0, 0)) for p in self.stages)
        return [(int(start), int(end)) for start, end in spans]


def _precision(value: str, exact: bool) -> str | None:
    if exact:
        return "f32"
    return None if value == "auto" else value


def _data_endpoint(sender: Host, receiver: Host) -> Endpoint:
    """Where `sender`'s worker reaches `receiver`'s data socket."""
    return Endpoint(
        LOCALHOST if receiver.is_local and sender.is_local else receiver.address, receiver.data_port
    )


def build_deployment(
    fleet: Fleet,
    ranges: list[tuple[int, int]],
    shard_dir: Callable[[Host], str],
    draft_dir: str | None = None,
    draft_host: Host | None = None,
) -> Deployment:
    """Worker configurations for every host (one stage each, in fleet order) and the optional draft.

    `shard_dir(host)` is where that host's worker finds the compiled shards (a remote path for SSH
    hosts). Keys are generated per deployment: each worker accepts only the coordinator and its own
    upstream stage.
    """
    runtime = fleet.runtime
    encrypted = runtime.encryption == "curve"
    coordinator = generate_keypair() if encrypted else None
    stage_keys = [generate_keypair() if encrypted else None for _ in fleet.hosts]
    deployment_id = secrets.token_hex(6)
    placements: list[Placement] = []
    count = len(fleet.hosts)
    for index, host in enumerate(fleet.hosts):
        last = index == count - 1
        following = fleet.hosts[index + 1] if not last else None
        curve = None
        if encrypted:
            assert coordinator is not None
            public, secret = stage_keys[index]  # type: ignore[misc]
            allowed = [coordinator[0]] + ([stage_keys[index - 1][0]] if index else [])  # type: ignore[index]
            if index == 0 and count > 1:  # the last stage sends a run's tokens back to stage 0
                allowed.append(stage_keys[-1][0])  # type: ignore[index]
            next_key = stage_keys[index + 1][0] if not last else None  # type: ignore[index]
            loop_key = stage_keys[0][0] if last and count > 1 else None  # type: ignore[index]
            curve = CurveKeys(public, secret, tuple(allowed), next_key, loop_key)
        next_endpoint = loop = None
        if following is not None:
            next_endpoint = _data_endpoint(host, following)
        elif count > 1:
            loop = _data_endpoint(host, fleet.hosts[0])
        config = StageConfig(
            name=host.name,
            shard_dir=shard_dir(host),
            stage_index=index,
            data_port=host.data_port,
            control_port=host.control_port,
            telemetry_port=host.telemetry_port,
            result_port=host.result_port if last else None,
            role="stage",
            bind_address=LOCALHOST if host.is_local else "0.0.0.0",
            next=next_endpoint,
            loop=loop,
            device=host.device,
            threads=host.threads,
            inference_precision=_precision(runtime.inference_precision, runtime.exact),
            kv_cache_precision=_precision(runtime.kv_cache_precision, runtime.exact),
            wire_dtype="f32" if runtime.exact else runtime.wire_dtype,
            curve=curve,
            compile_cache=runtime.compile_cache,
            result_batch_ms=runtime.result_batch_ms if last else 0.0,
            cpu_cores=host.cores,
            deployment=deployment_id,
            max_sessions=fleet.sessions.max_sessions,
            stages=count,
            extra={"layers": list(ranges[index])} if index < len(ranges) else {},
        )
        placements.append(Placement(host, config, LOCALHOST if host.is_local else host.address))
    draft = None
    if draft_dir is not None:
        taken = [
            port
            for each in fleet.hosts
            for port in range(each.base_port, each.base_port + PORTS_PER_HOST)
        ]
        host = draft_host or Host(name="draft", base_port=free_port_block(avoid=taken))
        curve = None
        if encrypted:
            assert coordinator is not None
            public, secret = generate_keypair()
            curve = CurveKeys(public, secret, (coordinator[0],), None)
        config = StageConfig(
            name="draft",
            shard_dir=draft_dir,
            stage_index=0,
            data_port=host.data_port,
            control_port=host.control_port,
            telemetry_port=host.telemetry_port,
            result_port=host.result_port,
            role="draft",
            bind_address=LOCALHOST,
            device="CPU",
            threads=host.threads,
            inference_precision=_precision(runtime.inference_precision, runtime.exact),
            kv_cache_precision=_precision(runtime.kv_cache_precision, runtime.exact),
            curve=curve,
            compile_cache=runtime.compile_cache,
            cpu_cores=host.cores,
            deployment=deployment_id,
            max_sessions=fleet.sessions.max_sessions,
        )
        draft = Placement(host, config, LOCALHOST)
    keys = ClientKeys(*coordinator) if coordinator is not None else None
    return Deployment(deployment_id, tuple(placements), draft, keys)


def rerouted(deployment: Deployment, route: Callable[[Endpoint], Endpoint]) -> Deployment:
    """Every stage's downstream links (`next`, `loop`) sent through `route` (e.g. the bench's
    hop-delay proxies)."""
    stages = []
    for placement in deployment.stages:
        config = placement.config
        if config.next is not None:
            config = replace(config, next=route(config.next))
        if config.loop is not None:
            config = replace(config, loop=route(config.loop))
        stages.append(replace(placement, config=config))
    return replace(deployment, stages=tuple(stages))


def write_config(placement: Placement, directory: Path) -> Path:
    """The worker's JSON configuration, readable by its owner only (it holds a secret key)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{placement.config.name}.json"
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(placement.config.to_json())
    return path
