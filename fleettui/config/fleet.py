"""The fleet file: load and validate a fleet TOML into frozen, typed settings (errors name
file:line: key)."""

from __future__ import annotations

import ipaddress
import logging
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from fleettui.config import paths
from fleettui.config.resilience import ResilienceSettings, parse_resilience
from fleettui.config.toml_source import LineIndex, Section, decoded, key_name, show
from fleettui.errors import FleetConfigError, PlanError
from fleettui.model.shape import layer_range_problem
from remote_worker import config as contract

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

logger = logging.getLogger(__name__)

FLEETS_DIR = Path(__file__).resolve().parents[2] / "fleets"  # a checkout's examples (bare names)
# ships in the wheel; a copy of fleets/local.toml
DEFAULT_FLEET = Path(__file__).resolve().parent / "local.toml"

PRECISIONS = contract.WEIGHT_PRECISIONS
INFERENCE_PRECISIONS = ("auto", *contract.INFERENCE_PRECISIONS)
KV_CACHE_PRECISIONS = ("auto", *contract.KV_CACHE_PRECISIONS)
WIRE_DTYPES = contract.WIRE_DTYPES
ENCRYPTIONS = contract.ENCRYPTIONS
BUILTIN_DRAFTS = ("self-int4", "prompt-lookup", "none")
TRANSPORTS = ("local", "ssh")
HOST_KEY_POLICIES = ("verify", "tofu")
DEVICES = contract.DEVICES
PORTS_PER_HOST = 4  # data, control, telemetry, result
FIRST_BASE_PORT = 5550
BASE_PORT_STEP = 10
MAX_K = 16
# the adaptive K stays small on a LAN; behind slow links long drafts pay (bench delay group)
DEFAULT_MAX_K = 16


@dataclass(frozen=True)
class ModelSettings:
    """Which model to run and how its weights are compressed."""

    name: str = "smollm2-135m-instruct"  # builtin name, HF folder, .gguf path (resolved) or hub id
    precision: str = "int4"  # weight precision actually used (fp32 when runtime.exact)
    # cache root: <root>/shards/<key>
    shards: Path = field(default_factory=lambda: paths.cache_dir())


RUNTIME_KEYS: tuple[str, ...] = (
    "inference_precision",
    "kv_cache_precision",
    "wire_dtype",
    "encryption",
)
RUNTIME_KEYS += ("exact", "compile_cache", "result_batch_ms")
# a 25 Hz stream: the coordinator wakes once per burst, not once per token
DEFAULT_RESULT_BATCH_MS = 40.0


@dataclass(frozen=True)
class RuntimeSettings:
    """How the stages run: OpenVINO precisions, the wire format between stages, link encryption."""

    inference_precision: str = "auto"  # auto | f32 | f16 | bf16 (f32 when exact)
    kv_cache_precision: str = "auto"  # auto | f32 | f16 | u8 (f32 when exact)
    wire_dtype: str = "f16"  # f16 | f32 (f32 when exact)
    encryption: str = "curve"  # curve | plaintext
    exact: bool = False
    # each worker keeps its compiled model in its shard folder (fast restarts)
    compile_cache: bool = True
    # a run's tokens leave the last stage together at most this often (0: each at once)
    result_batch_ms: float = DEFAULT_RESULT_BATCH_MS


@dataclass(frozen=True)
class SpeculationSettings:
    """Speculative decoding: which draft proposes tokens and how many per verify step."""

    draft: str = "self-int4"  # self-int4 | prompt-lookup | none | resolved path of a draft
    k: int | Literal["auto"] = "auto"
    max_k: int = DEFAULT_MAX_K

    @property
    def draft_path(self) -> Path | None:
        """The draft as a path when it is not one of the builtin drafts."""
        return None if self.draft in BUILTIN_DRAFTS else Path(self.draft)


@dataclass(frozen=True)
class SessionSettings:
    """Chat sessions: how many at once and the sampling defaults (None: the model's recommended
    sampling)."""

    max_sessions: int = 4
    max_tokens: int = 256
    temperature: float | None = None  # None: fleettui.config.recommended (greedy under --exact)
    top_p: float | None = None
    seed: int = 0  # fixed, so a sampled answer can be reproduced


@dataclass(frozen=True)
class Host:
    """One PC of the fleet; it serves one pipeline stage on four consecutive ports from
    base_port."""

    name: str
    transport: str = "local"  # local | ssh
    address: str = "127.0.0.1"
    ssh_port: int = 22
    user: str | None = None  # None: the operator's user name
    identity_file: Path | None = None  # None: the SSH agent / default keys
    host_key_policy: str = "verify"  # verify (known_hosts) | tofu
    known_hosts: Path = Path("~/.ssh/known_hosts").expanduser()
    python: str = "python3"  # remote interpreter used to create the worker venv
    workdir: str = "~/.fleettui"  # remote path, expanded by the remote shell
    device: str = "CPU"  # CPU | GPU | NPU | AUTO
    memory_gb: float = 8.0  # usable memory the planner may fill
    speed: float = 1.0  # relative compute speed for the planner
    threads: int = 0  # 0 = device default
    cores: tuple[int, ...] = ()  # optional CPU pinning
    base_port: int = FIRST_BASE_PORT
    # manual split [start, end); N.5 cuts layer N after its attention
    layers: tuple[float, float] | None = None

    @property
    def is_local(self) -> bool:
        return self.transport == "local"

    @property
    def data_port(self) -> int:
        return self.base_port

    @property
    def control_port(self) -> int:
        return self.base_port + 1

    @property
    def telemetry_port(self) -> int:
        return self.base_port + 2

    @property
    def result_port(self) -> int:
        return self.base_port + 3

    @property
    def ports(self) -> tuple[int, int, int, int]:
        return (self.data_port, self.control_port, self.telemetry_port, self.result_port)


@dataclass(frozen=True)
class Fleet:
    """A validated fleet file."""

    hosts: tuple[Host, ...]
    model: ModelSettings = field(default_factory=ModelSettings)
    runtime: RuntimeSettings = field(default_factory=RuntimeSettings)
    speculation: SpeculationSettings = field(default_factory=SpeculationSettings)
    sessions: SessionSettings = field(default_factory=SessionSettings)
    path: Path | None = None
    resilience: ResilienceSettings = field(default_factory=ResilienceSettings)

    @property
    def manual_layers(self) -> bool:
        """True when the fleet file fixes the split with ``layers`` on every host."""
        return bool(self.hosts) and all(host.layers is not None for host in self.hosts)

    def host(self, name: str) -> Host:
        for host in self.hosts:
            if host.name == name:
                return host
        raise KeyError(name)


def resolve_fleet(arg: str | None) -> Path:
    """The fleet file for a CLI argument: None → the embedded default; a bare name →
    fleets/NAME.toml."""
    if arg is None:
        return DEFAULT_FLEET
    path = Path(arg).expanduser()
    if not path.exists() and not path.suffix and (FLEETS_DIR / f"{arg}.toml").exists():
        return FLEETS_DIR / f"{arg}.toml"
    if path.is_dir():
        raise FleetConfigError(path, 0, "fleet", _folder_hint(path))
    if not path.is_file():
        raise FleetConfigError(path, 0, "fleet", "no such fleet file")
    return path


def _folder_hint(path: Path) -> str:
    """What to say when a folder is given where a fleet file belongs."""
    found = sorted(child.name for child in path.glob("*.toml"))[:4]
    if found:
        return f"is a folder, not a fleet file: pass one of its TOML files, e.g. {path / found[0]}"
    return "is a folder, not a fleet file: pass a fleet TOML file (`fleettui init` writes one)"


_BARE_WORD = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*=\s*([A-Za-z][^#]*?)\s*(#.*)?$")


def _unquoted_hint(text: str, line: int) -> str:
    """A hint when the failing line holds a bare word where TOML wants a quoted string."""
    lines = text.splitlines()
    if not 0 < line <= len(lines):
        return ""
    match = _BARE_WORD.match(lines[line - 1])
    if not match or match.group(2) in ("true", "false", "inf", "nan"):
        return ""
    value = match.group(2).replace('"', '\\"')
    return f': strings need quotes, e.g. {match.group(1)} = "{value}"'


def _local_path(value: str, base: Path) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else (base / path).resolve()


def _is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


# --------------------------------------------------------------------------------------------------


def load_fleet(path: Path) -> Fleet:
    """Read and validate a fleet file; raises FleetConfigError naming file, line and key."""
    path = Path(path)
    try:
        text = decoded(path, path.read_bytes())
    except FileNotFoundError:
        raise FleetConfigError(path, 0, "fleet", "no such fleet file") from None
    except IsADirectoryError:
        raise FleetConfigError(path, 0, "fleet", _folder_hint(path)) from None
    except OSError as error:
        raise FleetConfigError(
            path, 0, "fleet", f"cannot read: {error.strerror or error}"
        ) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        message = str(error)
        match = re.search(r"\(at line (\d+), column \d+\)", message)
        line = int(match.group(1)) if match else 0
        if "(at end of document)" in message:
            line = max(1, len(text.splitlines()))
        reason = (
            re.sub(r"\s*\((at line \d+, column \d+|at end of document)\)", "", message)
            or "invalid TOML"
        )
        if reason.startswith("Invalid value"):
            reason += _unquoted_hint(text, line)
        raise FleetConfigError(path, line, "toml", reason) from None
    return _validate(path, text, data)


def _validate(path: Path, text: str, data: dict[str, Any]) -> Fleet:
    lines = LineIndex(text)
    base = path.resolve().parent
    top = Section(path, lines, "", 0, "fleet", data)
    top.reject_unknown(("model", "runtime", "speculation", "sessions", "resilience", "hosts"))
    for table in ("model", "runtime", "speculation", "sessions", "resilience"):
        if table in data and not isinstance(data[table], Mapping):
            raise FleetConfigError(
                path, lines.line("", 0, table), table, "expected a table [" + table + "]"
            )

    runtime = _runtime(Section(path, lines, "runtime", 0, "runtime", data.get("runtime", {})))
    model = _model(
        Section(path, lines, "model", 0, "model", data.get("model", {})), base, runtime.exact
    )
    speculation = _speculation(
        Section(path, lines, "speculation", 0, "speculation", data.get("speculation", {})), base
    )
    sessions = _sessions(Section(path, lines, "sessions", 0, "sessions", data.get("sessions", {})))
    resilience = parse_resilience(
        Section(path, lines, "resilience", 0, "resilience", data.get("resilience", {}))
    )

    raw_hosts = data.get("hosts", [])
    if not isinstance(raw_hosts, list) or not raw_hosts:
        raise FleetConfigError(
            path, lines.line("", 0, "hosts"), "hosts", "expected at least one [[hosts]] table"
        )
    sections = []
    for index, raw in enumerate(raw_hosts):
        name = raw.get("name") if isinstance(raw, Mapping) else None
        label = (
            f"hosts[{key_name(name)}]" if isinstance(name, str) and name else f"hosts[#{index + 1}]"
        )
        sections.append(Section(path, lines, "hosts", index, label, raw))
    hosts = _hosts(sections, base)
    if runtime.exact:
        logger.info(
            "%s: exact = true: fp32 weights, f32 inference, f32 KV cache and f32 wire", path
        )
    if runtime.encryption == "plaintext":
        logger.warning(
            "%s: encryption = plaintext: stage links are NOT encrypted or authenticated", path
        )
    fleet = Fleet(hosts, model, runtime, speculation, sessions, path, resilience)
    _check_manual_split(fleet, sections)
    return fleet


def _model(section: Section, base: Path, exact: bool) -> ModelSettings:
    from fleettui.errors import PlanError
    from fleettui.model.shape import BUILTIN_SHAPES, SYNTHETIC_PREFIX, synthetic_shape

    section.reject_unknown(("name", "precision", "shards"))
    name = section.get("name", str, ModelSettings.name)
    if not name:
        raise section.error("name", "must not be empty")
    if name.startswith(
        SYNTHETIC_PREFIX
    ):  # seeded random weights of a real architecture (bench only)
        try:
            synthetic_shape(name)
        except PlanError as error:
            raise section.error("name", error.message) from None
    elif name not in BUILTIN_SHAPES:
        candidate = _local_path(name, base)
        if candidate.exists():
            name = str(candidate)
        elif (
            name.endswith(".gguf")
            or name.startswith((".", "/", "~"))
            or not re.fullmatch(r"[\w.-]+/[\w.-]+", name)
        ):
            builtins = ", ".join(BUILTIN_SHAPES)
            raise section.error(
                "name", f"no such file or folder {candidate} and not a builtin model ({builtins})"
            )
    precision = section.choice("precision", PRECISIONS, ModelSettings.precision)
    given = section.get("shards", str, None)
    shards = _local_path(given, base) if given else paths.cache_dir()
    return ModelSettings(name, "fp32" if exact else precision, shards)


def _runtime(section: Section) -> RuntimeSettings:
    section.reject_unknown(RUNTIME_KEYS)
    exact = section.get("exact", bool, False)
    inference = section.choice("inference_precision", INFERENCE_PRECISIONS, "auto")
    kv_cache = section.choice("kv_cache_precision", KV_CACHE_PRECISIONS, "auto")
    wire = section.choice("wire_dtype", WIRE_DTYPES, "f16")
    encryption = section.choice("encryption", ENCRYPTIONS, "curve")
    if exact:
        inference, kv_cache, wire = "f32", "f32", "f32"
    batch = section.number(
        "result_batch_ms", float, DEFAULT_RESULT_BATCH_MS, lambda v: 0 <= v <= 1000, "0..1000 ms"
    )
    return RuntimeSettings(
        inference,
        kv_cache,
        wire,
        encryption,
        exact,
        section.get("compile_cache", bool, True),
        batch,
    )


def _speculation(section: Section, base: Path) -> SpeculationSettings:
    section.reject_unknown(("draft", "k", "max_k"))
    draft = section.get("draft", str, "self-int4")
    if draft not in BUILTIN_DRAFTS:
        candidate = _local_path(draft, base)
        if not candidate.exists():
            raise section.error(
                "draft",
                f"{show(draft)} is neither {' | '.join(BUILTIN_DRAFTS)} nor an existing path",
            )
        draft = str(candidate)
    max_k = section.number("max_k", int, DEFAULT_MAX_K, lambda v: 1 <= v <= MAX_K, f"1..{MAX_K}")
    k = section.get("k", (str, int), "auto")
    if isinstance(k, str) and k != "auto":
        raise section.error("k", f'expected "auto" or an integer 0..{MAX_K}, got {show(k)}')
    if isinstance(k, int) and not 0 <= k <= max_k:
        raise section.error("k", f"{k} is out of range: 0..max_k ({max_k})")
    return SpeculationSettings(draft, k, max_k)


def _sessions(section: Section) -> SessionSettings:
    section.reject_unknown(("max_sessions", "max_tokens", "temperature", "top_p", "seed"))
    return SessionSettings(
        max_sessions=section.number("max_sessions", int, 4, lambda v: 1 <= v <= 64, "1..64"),
        max_tokens=section.number(
            "max_tokens", int, 256, lambda v: 1 <= v <= 1_000_000, "1..1000000"
        ),
        temperature=section.number(
            "temperature", float, None, lambda v: v is None or 0.0 <= v <= 10.0, "0..10"
        ),
        top_p=section.number(
            "top_p", float, None, lambda v: v is None or 0.0 < v <= 1.0, "greater than 0, at most 1"
        ),
        seed=section.number("seed", int, 0, lambda v: 0 <= v < 2**63, "0..2^63-1"),
    )


_HOST_KEYS = (
    "name",
    "transport",
    "address",
    "ssh_port",
    "user",
    "identity_file",
    "host_key_policy",
    "known_hosts",
    "python",
    "workdir",
    "device",
    "memory_gb",
    "speed",
    "threads",
    "cores",
    "base_port",
    "layers",
)


def _host(section: Section, base: Path) -> tuple[Host, bool]:
    """One host and whether its base_port was given."""
    section.reject_unknown(_HOST_KEYS)
    if "name" not in section.data:
        raise section.error(None, "missing key name")
    name = section.get("name", str, "")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", name):
        raise section.error("name", f"{show(name)} must be letters, digits, '.', '-' or '_'")
    transport = section.choice("transport", TRANSPORTS, "local")
    address = section.get("address", str, "127.0.0.1").strip()
    if not address:
        raise section.error("address", "must not be empty")
    if transport == "local" and not _is_loopback(address):
        raise section.error(
            "address", f'{show(address)} is not this machine: use transport = "ssh"'
        )
    identity = section.get("identity_file", str, None)
    cores = section.get("cores", list, [])
    if not all(
        isinstance(core, int) and not isinstance(core, bool) and core >= 0 for core in cores
    ):
        raise section.error(
            "cores", f"expected a list of CPU numbers (integers >= 0), got {show(cores)}"
        )
    if len(set(cores)) != len(cores):
        raise section.error("cores", f"repeats a CPU number: {show(cores)}")
    layers = section.get("layers", list, None)
    if layers is not None and (problem := layer_range_problem(layers, show(layers))):
        raise section.error("layers", problem)
    user = section.get("user", str, None)
    host = Host(
        name=name,
        transport=transport,
        address=address,
        ssh_port=section.number("ssh_port", int, 22, lambda v: 1 <= v <= 65535, "1..65535"),
        user=user or None,
        identity_file=_local_path(identity, base) if identity else None,
        host_key_policy=section.choice("host_key_policy", HOST_KEY_POLICIES, "verify"),
        known_hosts=_local_path(section.get("known_hosts", str, "~/.ssh/known_hosts"), base),
        python=section.get("python", str, "python3") or "python3",
        workdir=section.get("workdir", str, "~/.fleettui") or "~/.fleettui",
        device=section.choice("device", DEVICES, "CPU", upper=True),
        memory_gb=section.number("memory_gb", float, 8.0, lambda v: 0 < v <= 1e6, "greater than 0"),
        speed=section.number("speed", float, 1.0, lambda v: 0 < v <= 1e6, "greater than 0"),
        threads=section.number("threads", int, 0, lambda v: 0 <= v <= 4096, "0..4096"),
        cores=tuple(cores),
        base_port=section.number(
            "base_port",
            int,
            FIRST_BASE_PORT,
            lambda v: 1024 <= v <= 65536 - PORTS_PER_HOST,
            "1024..65532",
        ),
        layers=(layers[0], layers[1]) if layers is not None else None,
    )
    return host, "base_port" in section.data


def _machine(host: Host) -> str:
    """Hosts that share this key are one machine, so their ports must not overlap."""
    return "local" if host.is_local or _is_loopback(host.address) else host.address.lower()


def _hosts(sections: list[Section], base: Path) -> tuple[Host, ...]:
    hosts: list[Host] = []
    explicit: list[bool] = []
    seen: dict[str, int] = {}
    for section in sections:
        host, given = _host(section, base)
        if host.name in seen:
            first = sections[seen[host.name]]
            raise section.error(
                "name",
                f'duplicate host name "{host.name}" (first at line '
                f"{first.lines.line('hosts', first.index, 'name')})",
            )
        seen[host.name] = len(hosts)
        hosts.append(host)
        explicit.append(given)
    # Explicit ports first: they must not overlap on one machine.
    taken: dict[str, list[tuple[int, int]]] = {}
    for index, host in enumerate(hosts):
        if not explicit[index]:
            continue
        for other_index, other_base in taken.get(_machine(host), []):
            if abs(other_base - host.base_port) < PORTS_PER_HOST:
                other = hosts[other_index]
                raise sections[index].error(
                    "base_port",
                    f"ports {host.base_port}-{host.base_port + PORTS_PER_HOST - 1} overlap host "
                    f"{other.name}'s "
                    f"{other_base}-{other_base + PORTS_PER_HOST - 1} on the same address "
                    f"(each host uses {PORTS_PER_HOST} ports)",
                )
        taken.setdefault(_machine(host), []).append((index, host.base_port))
    # Hosts without base_port get the first free block of FIRST_BASE_PORT + n * BASE_PORT_STEP.
    for index, host in enumerate(hosts):
        if explicit[index]:
            continue
        used = taken.setdefault(_machine(host), [])
        port = FIRST_BASE_PORT
        while any(abs(port - other) < PORTS_PER_HOST for _, other in used):
            port += BASE_PORT_STEP
        used.append((index, port))
        hosts[index] = replace(host, base_port=port)
    with_layers = [host.layers is not None for host in hosts]
    if any(with_layers) and not all(with_layers):
        index = with_layers.index(False) if with_layers[0] else with_layers.index(True)
        raise sections[index].error("layers", "set layers on all hosts or on none")
    if all(with_layers):
        expected: float = 0
        for index, host in enumerate(hosts):
            assert host.layers is not None
            if host.layers[0] != expected:
                raise sections[index].error(
                    "layers",
                    f"starts at {host.layers[0]} but the previous host ends at {expected}: "
                    "ranges must be contiguous and half-open [start, end), in host order from 0",
                )
            expected = host.layers[1]
    return tuple(hosts)


def _check_manual_split(fleet: Fleet, sections: list[Section]) -> None:
    """A manual split must cover the model's layers exactly (checked when the shape is known
    cheaply)."""
    if not fleet.manual_layers:
        return
    from fleettui.model.builtin import shape_for_model
    from fleettui.model.shape import check_manual_layers

    try:
        shape = shape_for_model(fleet.model.name)
    except PlanError:
        return  # e.g. a GGUF file: the planner checks the split when the shape is read
    if shape is None:
        return
    try:
        check_manual_layers(shape, fleet.hosts)
    except PlanError as error:
        names = [host.name for host in fleet.hosts]
        index = names.index(error.host) if error.host in names else len(names) - 1
        raise sections[index].error("layers", str(error)) from None
