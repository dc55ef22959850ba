"""Provides the stage configuration contract: what the operator writes for one worker process
(JSON)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

CONFIG_VERSION = 1
# The vocabularies, defined once here (the contract): fleettui's fleet file adds "auto" where it
# plans.
# widest first: the planner steps down this order
WEIGHT_PRECISIONS = (
    "fp32",
    "fp16",
    "int8",
    "int4",
)
INFERENCE_PRECISIONS = ("f32", "f16", "bf16")
KV_CACHE_PRECISIONS = ("f32", "f16", "u8")
WIRE_DTYPES = ("f16", "f32")
ENCRYPTIONS = ("curve", "plaintext")
DEVICES = ("CPU", "GPU", "NPU", "AUTO")
ROLES = ("stage", "draft")


class ConfigError(ValueError):
    """A stage configuration that cannot be served; the message names the field."""


@dataclass(frozen=True)
class Endpoint:
    address: str
    port: int

    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"tcp://{host}:{self.port}"


@dataclass(frozen=True)
class CurveKeys:
    """CurveZMQ material for one worker (Z85 text keys).

    The worker's sockets are CURVE servers with `secret_key`; only clients whose public key is
    listed in `allowed_clients` (the deployment's coordinator and, for a middle/last stage, its
    upstream stage; for stage 0 of a longer chain, the last stage too) pass the ZAP handshake. Its
    outgoing link to the next stage is a CURVE client with the same key pair and `next_server_key`;
    the last stage's link back to stage 0 (`loop`) one with `loop_server_key`."""

    public_key: str
    secret_key: str
    allowed_clients: tuple[str, ...]
    next_server_key: str | None = None
    loop_server_key: str | None = None


@dataclass(frozen=True)
class StageConfig:
    name: str
    shard_dir: str
    stage_index: int
    data_port: int
    control_port: int
    telemetry_port: int
    result_port: int | None = None  # bound by the last stage and by a draft (coordinator connects)
    role: str = "stage"
    bind_address: str = "127.0.0.1"
    next: Endpoint | None = None  # the downstream stage; None for the last stage and the draft
    # the last stage of several: stage 0's data socket (a run's tokens go back)
    loop: Endpoint | None = None
    device: str = "CPU"
    threads: int = 0  # 0 = plugin default
    inference_precision: str | None = None  # None = device default (reported)
    kv_cache_precision: str | None = None
    wire_dtype: str = "f16"
    curve: CurveKeys | None = None  # None = plaintext (debug only; logged loudly)
    verify_hashes: bool = True
    # False: hash every file of the stage at start, whatever its stamp says (`deploy --recheck`)
    trust_stamps: bool = True
    # keep the compiled model in the shard folder's compiled/ for restarts
    compile_cache: bool = True
    max_sessions: int = 64  # an Open beyond this is answered with an Error (the coordinator queues)
    batching: bool = True  # steps of up to max_sessions sessions share one inference
    # stages in the pipeline: a batch takes 1/stages of the active sessions, so each has work
    stages: int = 1
    # requests waiting to be served, in bytes; beyond it they are refused
    max_queue_bytes: int = 256 << 20
    # last stage: a run's Results leave together at most this often (0 = each)
    result_batch_ms: float = 0.0
    lease_seconds: float = 0.0  # > 0: exit when no control request came for this long (0 = never)
    cpu_cores: tuple[int, ...] = ()
    deployment: str = ""  # id of the deployment that started this worker
    version: int = CONFIG_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role: {self.role!r} is not one of {', '.join(ROLES)}")
        if self.inference_precision not in (None, *INFERENCE_PRECISIONS):
            raise ConfigError(
                f"inference_precision: {self.inference_precision!r} is not one of "
                f"{INFERENCE_PRECISIONS}"
            )
        if self.kv_cache_precision not in (None, *KV_CACHE_PRECISIONS):
            raise ConfigError(
                f"kv_cache_precision: {self.kv_cache_precision!r} is not one of "
                f"{KV_CACHE_PRECISIONS}"
            )
        if self.wire_dtype not in WIRE_DTYPES:
            raise ConfigError(f"wire_dtype: {self.wire_dtype!r} is not one of {WIRE_DTYPES}")
        for name in ("data_port", "control_port", "telemetry_port", "result_port"):
            port = getattr(self, name)
            if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
                raise ConfigError(f"{name}: {port!r} is not a TCP port")
        for name in ("next", "loop"):
            endpoint = getattr(self, name)
            if endpoint is not None and (
                not isinstance(endpoint.port, int) or not 0 < endpoint.port < 65536
            ):
                raise ConfigError(f"{name}.port: {endpoint.port!r} is not a TCP port")
        if self.loop is not None and self.next is not None:
            raise ConfigError("loop: only the last stage sends a run's tokens back to stage 0")
        if self.next is None and self.result_port is None:
            raise ConfigError(
                "result_port: required when there is no next stage (last stage or draft)"
            )
        if not isinstance(self.max_sessions, int) or self.max_sessions < 1:
            raise ConfigError(f"max_sessions: {self.max_sessions!r} must be a whole number >= 1")
        if (
            not isinstance(self.max_queue_bytes, int)
            or not 1 << 20 <= self.max_queue_bytes <= 1 << 40
        ):
            raise ConfigError(f"max_queue_bytes: {self.max_queue_bytes!r} must lie in 1 MiB..1 TiB")
        batch = self.result_batch_ms
        if isinstance(batch, bool) or not isinstance(batch, (int, float)) or not 0 <= batch <= 1000:
            raise ConfigError(
                f"result_batch_ms: {batch!r} must be a number of milliseconds in 0..1000"
            )
        lease = self.lease_seconds
        if (
            isinstance(lease, bool)
            or not isinstance(lease, (int, float))
            or not 0 <= lease <= 86400
        ):
            raise ConfigError(f"lease_seconds: {lease!r} must be a number of seconds in 0..86400")
        if not isinstance(self.batching, bool):
            raise ConfigError(f"batching: {self.batching!r} must be true or false")
        if not isinstance(self.compile_cache, bool):
            raise ConfigError(f"compile_cache: {self.compile_cache!r} must be true or false")
        if self.version != CONFIG_VERSION:
            raise ConfigError(f"version: {self.version}, this worker reads {CONFIG_VERSION}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> StageConfig:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"not JSON: {error}") from None
        if not isinstance(data, dict):
            raise ConfigError("top level must be an object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{unknown[0]}: unknown key")
        try:
            for name in ("next", "loop"):
                if data.get(name) is not None:
                    data[name] = Endpoint(**data[name])
            if data.get("curve") is not None:
                curve = dict(data["curve"])
                curve["allowed_clients"] = tuple(curve.get("allowed_clients", ()))
                data["curve"] = CurveKeys(**curve)
            data["cpu_cores"] = tuple(data.get("cpu_cores", ()))
            return cls(**data)
        except (
            TypeError,
            ValueError,
        ) as error:  # e.g. a non-object "next"/"curve", a wrong argument
            raise ConfigError(str(error)) from None

    @classmethod
    def load(cls, path: Path) -> StageConfig:
        try:
            return cls.from_json(Path(path).read_text())
        except OSError as error:
            raise ConfigError(f"{path}: {error.strerror}") from None
        except ConfigError as error:
            raise ConfigError(f"{path}: {error}") from None
