"""Provides measured cost profiles per host: the calibration run, its cache, and `fleettui plan
--profile`.

Calibration compiles the model with the split [0, 1, L-1, L] (cached like any shards) and times each
of its three stages with the host's OpenVINO settings (`python -m remote_worker.profile`, a child
process: fleettui never imports OpenVINO), each after the pause it has in the fleet's pipeline
serving one user. `fit_costs` turns the three timings into per-layer, head and per-call costs, kept
under the cache dir per machine / device / threads / cores / model / precisions / stage count (hosts
on alike cores of this machine, calibrated together, share the mean: `pool_alike`). The planner uses
them when every host has one. Local hosts are calibrated here, SSH hosts on themselves (the worker
installed and the split pushed as a deploy does: `fleettui.control.calibration`), keyed by their
address; each SSH profile records which PC it timed, so a deploy drops it when another PC answers at
that address (`replaced_profiles`). A host without a profile of the fleet's stage count plans from
its profile of the nearest other one (`nearest_costs`: a re-plan)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleettui.errors import PlanError, child_failure
from fleettui.planning.costs import MeasuredCosts, StageTiming, fit_costs, imbalance, predicted_ms

if TYPE_CHECKING:
    from fleettui.config.fleet import Fleet, Host

PROFILE_VERSION = 2  # 2: each calibration stage timed after its live 1-user pause (was round-robin)
TIMEOUT = 1800.0
MAX_PIPELINE = 16  # stage counts a profile of another stage count is looked up among


def _material(fleet: Fleet, host: Host, pipeline: int | None = None) -> dict[str, Any]:
    runtime = fleet.runtime
    return {
        "version": PROFILE_VERSION,
        "machine": socket.gethostname() if host.is_local else host.address,
        "device": host.device,
        "threads": host.threads,
        "cores": list(host.cores),
        "model": fleet.model.name,
        "precision": fleet.model.precision,
        "inference": runtime.inference_precision,
        "kv_cache": runtime.kv_cache_precision,
        # a stage pauses (S-1)/S of a token between steps: costs depend on the stage count
        "pipeline": len(fleet.hosts) if pipeline is None else pipeline,
    }


def profile_path(
    fleet: Fleet, host: Host, root: Path | None = None, pipeline: int | None = None
) -> Path:
    from fleettui.config.paths import cache_dir

    material = json.dumps(_material(fleet, host, pipeline), sort_keys=True)
    key = hashlib.sha256(material.encode()).hexdigest()[:16]
    return (root or cache_dir()) / "profiles" / f"{key}.json"


def load_costs(
    fleet: Fleet, host: Host, root: Path | None = None, pipeline: int | None = None
) -> MeasuredCosts | None:
    """The cached cost profile of HOST for this fleet's model and settings (and stage count), or
    None."""
    try:
        data = json.loads(profile_path(fleet, host, root, pipeline).read_text(encoding="utf-8"))
        return MeasuredCosts(**data["costs"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def nearest_costs(fleet: Fleet, host: Host, root: Path | None = None) -> MeasuredCosts | None:
    """HOST's profile for this fleet's stage count, else the one measured in the nearest other stage
    count (same machine, device, threads, cores, model and precisions). A re-plan around a lost host
    changes the stage count but not what a layer costs on the hosts that are left: their costs plan
    it, not bytes."""
    count = len(fleet.hosts)
    for distance in range(MAX_PIPELINE):
        for pipeline in dict.fromkeys((count - distance, count + distance)):
            if 1 <= pipeline <= MAX_PIPELINE:
                found = load_costs(fleet, host, root, pipeline)
                if found is not None:
                    return found
    return None


def _records(root: Path | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """Every cached profile record (its file and JSON object), in file-name order; unreadable
    ones left out."""
    from fleettui.config.paths import cache_dir

    records = []
    for path in sorted(((root or cache_dir()) / "profiles").glob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            records.append((path, record))
    return records


def shared_differently(
    fleet: Fleet, host: Host, records: list[tuple[Path, dict[str, Any]]]
) -> MeasuredCosts | None:
    """A local HOST's profile among RECORDS measured with another share of this machine's cores
    (same machine, device, model and precisions; the nearest stage count, then the nearest core
    count). Local survivors of a re-plan share the cores anew, a setting no calibration timed, but
    what the head costs against a layer holds."""
    wanted = _material(fleet, host)
    fixed = {
        key: value for key, value in wanted.items() if key not in ("threads", "cores", "pipeline")
    }
    best: tuple[tuple[int, int, str], MeasuredCosts] | None = None
    for path, record in records:
        try:
            settings, costs = record["settings"], MeasuredCosts(**record["costs"])
            if any(settings.get(key) != value for key, value in fixed.items()):
                continue
            rank = (
                abs(int(settings["pipeline"]) - wanted["pipeline"]),
                abs(len(settings["cores"]) - len(wanted["cores"])),
                path.name,
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if best is None or rank < best[0]:
            best = (rank, costs)
    return None if best is None else best[1]


def fleet_costs(
    fleet: Fleet, root: Path | None = None, nearest: bool = True
) -> list[MeasuredCosts] | None:
    """One cached profile per host, or None when any host has none (then the byte-count estimate
    plans).

    `nearest`: of the nearest stage count when none of this one; and a fleet all on this machine
    that has no profile with its share of the cores (the survivors of a re-plan) takes the ones
    measured with another share, all of them alike, so the hosts' costs stay comparable."""
    if nearest:
        found = [nearest_costs(fleet, host, root) for host in fleet.hosts]
        if fleet.hosts and all(c is None for c in found) and all(h.is_local for h in fleet.hosts):
            records = _records(root)  # read once for every host
            found = [shared_differently(fleet, host, records) for host in fleet.hosts]
    else:
        found = [load_costs(fleet, host, root) for host in fleet.hosts]
    return None if any(cost is None for cost in found) else found  # type: ignore[return-value]


def replaced_profiles(
    address: str, identity: dict[str, Any], root: Path | None = None
) -> tuple[list[Path], str]:
    """The cached profiles measured on the SSH host at ADDRESS by another PC than the one IDENTITY
    describes (the operator swapped it behind the same address), and what differs ("cpu: A -> B").
    Profiles that recorded no identity (measured before identities were kept) cannot tell and
    stay."""
    stale: list[Path] = []
    change = ""
    for path, record in _records(root):
        try:
            measured_on = record.get("identity")
            if record["settings"]["machine"] != address or not isinstance(measured_on, dict):
                continue
        except (KeyError, TypeError, AttributeError):
            continue
        differs = [key for key in identity if measured_on.get(key) != identity[key]]
        if differs:
            stale.append(path)
            change = ", ".join(
                f"{key}: {measured_on.get(key)} -> {identity[key]}" for key in differs
            )
    return stale, change


class Children:
    """The child processes (shard compiler, stage timing) of one calibration. `stop()`, from any
    thread, kills those running and refuses new ones, so a cancelled caller does not wait for a
    timing it no longer wants."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen[str]] = set()
        self._hooks: list[Callable[[], None]] = []
        self._stopped = False

    def on_stop(self, hook: Callable[[], None]) -> None:
        """Call HOOK (from any thread) when the calibration is stopped: at once if it is already."""
        with self._lock:
            if not self._stopped:
                self._hooks.append(hook)
                return
        hook()

    def run(self, command: list[str], what: str) -> str:
        """The last line the child printed; PlanError with its last stderr line when it fails or
        is stopped."""
        with self._lock:
            if self._stopped:
                raise PlanError(f"{what}: stopped")
            child = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            self._running.add(child)
        try:
            stdout, stderr = child.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            raise PlanError(f"{what}: no result within {TIMEOUT:.0f} s") from None
        finally:
            with self._lock:
                self._running.discard(child)
        if self._stopped:
            raise PlanError(f"{what}: stopped")
        if child.returncode != 0:
            raise PlanError(f"{what}: {child_failure(stderr, child.returncode)}")
        return stdout.strip().splitlines()[-1]

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            for child in self._running:
                child.kill()
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook()


def compile_split(
    fleet: Fleet, splits: Sequence[int | str], children: Children | None = None
) -> Path:
    """Shards of the fleet's model for SPLITS (the shard compiler in a child process; cached by
    content; a boundary 12.5 cuts layer 12 between its attention and its MLP)."""
    command = [
        sys.executable,
        "-m",
        "shard_compiler",
        "--model",
        fleet.model.name,
        "--split",
        ",".join(map(str, splits)),
        "--precision",
        fleet.model.precision,
        "--cache-root",
        str(fleet.model.shards),
    ]
    return Path((children or Children()).run(command, "shard compiler"))


def profile_arguments(fleet: Fleet, host: Host, pauses_ms: list[float] | None = None) -> list[str]:
    """The options of `remote_worker.profile` for HOST's settings (all but `--shard` and
    `--stages`): each timed stage after PAUSES_MS (per stage) when given, else as the calibration
    split of the fleet's pipeline (each after the rest of the fleet's token:
    `remote_worker.profile.time_stages`)."""
    arguments = ["--device", host.device]
    if pauses_ms is not None:
        arguments += ["--pauses-ms", ",".join(f"{pause:.3f}" for pause in pauses_ms)]
    else:
        arguments += ["--pipeline", str(len(fleet.hosts))]
    if host.threads:
        arguments += ["--threads", str(host.threads)]
    if host.cores:
        arguments += ["--cores", ",".join(map(str, host.cores))]
    runtime = fleet.runtime
    if runtime.inference_precision != "auto":
        arguments += ["--inference-precision", runtime.inference_precision]
    if runtime.kv_cache_precision != "auto":
        arguments += ["--kv-cache-precision", runtime.kv_cache_precision]
    return arguments


def time_stages(
    fleet: Fleet,
    host: Host,
    shard_dir: Path,
    stages: list[int] | None = None,
    children: Children | None = None,
    pauses_ms: list[float] | None = None,
) -> list[dict[str, Any]]:
    """The stages of SHARD_DIR (all by default) timed with HOST's settings, in a child process here
    (`profile_arguments`)."""
    command = [sys.executable, "-m", "remote_worker.profile", "--shard", str(shard_dir)]
    if stages is not None:
        command += ["--stages", ",".join(map(str, stages))]
    command += profile_arguments(fleet, host, pauses_ms)
    return list(
        json.loads((children or Children()).run(command, f"profile of {host.name}"))["stages"]
    )


def timings(stages: list[dict[str, Any]]) -> list[StageTiming]:
    return [
        StageTiming(
            s["layers"][1] - s["layers"][0],
            bool(s["last"]),
            float(s["decode_ms"]),
            float(s["prefill_ms"]),
        )
        for s in stages
    ]


RemoteTimer = Callable[[list[tuple["Host", list[str]]], Path, list[int]], list[dict[str, Any]]]
"""Times STAGES of a shard folder on SSH hosts, each with its `profile_arguments`, all at once: per
host {"stages": the profile's per-stage records, "identity": which PC answered}
(`fleettui.control.calibration. remote_timer`; planning does not reach hosts)."""


def calibrate(
    fleet: Fleet,
    num_layers: int,
    root: Path | None = None,
    progress: Callable[[str], None] | None = None,
    force: bool = False,
    measured: set[Path] | None = None,
    children: Children | None = None,
    remote: RemoteTimer | None = None,
) -> dict[str, MeasuredCosts]:
    """Measured costs of every host (calibrated once per distinct settings, then cached): local
    hosts in child processes here, SSH hosts on the host itself through REMOTE (without it they keep
    the byte-count estimate).

    Local hosts pinned to disjoint cores are timed at the same time when the memory allows (one
    window: noise from other programs then tilts none of them against another); others one after the
    other. SSH hosts are separate machines: they are timed at the same time, beside the local ones.

    `force` measures again instead of using the cache, once per distinct settings; profiles named in
    `measured` (those this program already measured, e.g. earlier in one bench run) are not measured
    twice. `children.stop()` ends the calibration at once (PlanError), its child processes killed.
    """
    children = children or Children()
    say = progress or (lambda text: None)
    if num_layers < 4:
        raise PlanError(
            "calibration needs at least 4 layers (the split [0, 1, L-1, L]); the model has "
            f"{num_layers}"
        )
    found: dict[str, MeasuredCosts] = {}
    done = measured if measured is not None else set()
    todo: dict[Path, list[Host]] = {}  # per settings (a cache file): the hosts that share them
    for host in fleet.hosts:
        path = profile_path(fleet, host, root)
        cached = None if force and path not in done else load_costs(fleet, host, root)
        if cached is not None:
            found[host.name] = cached
        elif not host.is_local and remote is None:
            say(f"{host.name}: SSH host, not calibrated (the byte-count estimate plans it)")
        else:
            # a second host with the same settings shares the timing
            todo.setdefault(path, []).append(host)
    if not todo:
        return found
    say("compiling the calibration split [0, 1, L-1, L] (cached)")
    shard_dir = compile_split(fleet, [0, 1, num_layers - 1, num_layers], children)
    timed = [hosts[0] for hosts in todo.values()]
    local = [host for host in timed if host.is_local]
    away = [host for host in timed if not host.is_local]
    at_once = (
        len(local) > 1
        and _disjoint([h.cores for h in local])
        and _memory_allows(shard_dir, len(local))
    )
    if local:
        say(
            f"{', '.join(h.name for h in local)}: timing the three calibration "
            f"stages{AT_ONCE if at_once else ''}"
        )
    if away:
        say(
            f"{', '.join(h.name for h in away)}: installing the worker, pushing the calibration "
            "split, timing it"
        )
    identities: dict[str, dict[str, Any]] = {}  # SSH hosts: which PC was timed (`forget_replaced`)
    with (
        ThreadPoolExecutor(len(local) if at_once else 1) as pool,
        ThreadPoolExecutor(1) as hosts_away,
    ):
        try:
            remote_results = (
                hosts_away.submit(
                    remote, [(h, profile_arguments(fleet, h)) for h in away], shard_dir, [0, 1, 2]
                )
                if away and remote is not None
                else None
            )
            local_results = list(
                pool.map(lambda h: time_stages(fleet, h, shard_dir, None, children), local)
            )
            by_host = dict(zip([h.name for h in local], local_results, strict=True))
            if remote_results is not None:
                for host, answer in zip(away, remote_results.result(), strict=True):
                    by_host[host.name], identities[host.name] = answer["stages"], answer["identity"]
        except BaseException:  # one failed: the others stop too (their timing would go unused)
            children.stop()
            raise
    results = [by_host[host.name] for host in timed]
    own = [fit_costs(timings(stages)) for stages in results]
    pooled = pool_alike(timed, own)
    for (path, hosts), stages, costs, mine in zip(todo.items(), results, pooled, own, strict=True):
        record = {
            "settings": _material(fleet, hosts[0]),
            "costs": asdict(costs),
            "own_costs": asdict(mine),
            "stages": stages,
            "identity": identities.get(hosts[0].name),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "timed_together": [host.name for host in local]
            if at_once and hosts[0].is_local
            else [hosts[0].name],
        }
        _write_atomically(path, json.dumps(record, indent=1))
        done.add(path)
        found.update((host.name, costs) for host in hosts)
    return found


def _write_atomically(path: Path, text: str) -> None:
    """Write PATH whole or not at all: two programs calibrating the same settings at once (two
    deploys, two test workers) each leave a complete profile, the last one wins."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def pool_alike(hosts: list[Host], costs: list[MeasuredCosts]) -> list[MeasuredCosts]:
    """Per host, the mean costs of the hosts calibrated with it that differ only by which cores of
    this machine they use, when those cores are alike (`core_kind`: capacity, top clock, performance
    or efficient core). Two such hosts differ only by noise, which can be enough to tip the plan;
    their mean halves that noise. Hosts on unlike cores (a hybrid CPU's P- and E-cores) keep their
    own costs."""
    from fleettui.config.local_cores import core_kind

    def key(host: Host) -> tuple[object, ...] | None:
        if not host.is_local or not host.cores:  # (an SSH host's cores are not this machine's)
            return None
        kinds = {core_kind(cpu) for cpu in host.cores}
        return (
            (host.device, host.threads, len(host.cores), tuple(sorted(kinds)))
            if len(kinds) == 1
            else None
        )

    groups: dict[tuple[object, ...], list[int]] = {}
    for index, host in enumerate(hosts):
        found = key(host)
        if found is not None:
            groups.setdefault(found, []).append(index)
    pooled = list(costs)
    for members in groups.values():
        if len(members) > 1:
            mean = MeasuredCosts(
                **{
                    term.name: sum(getattr(costs[i], term.name) for i in members) / len(members)
                    for term in fields(MeasuredCosts)
                }
            )
            for index in members:
                pooled[index] = mean
    return pooled


AT_ONCE = (
    " at the same time (each on its own cores: one window, so load from other programs skews none)"
)


def _memory_allows(shard_dir: Path, copies: int) -> bool:
    """Whether COPIES calibrations fit in this machine's available memory at once: each loads the
    whole model (the split's weights, plus half again for the compiled model and the runtime)."""
    import psutil

    weights = sum(path.stat().st_size for path in shard_dir.rglob("*.bin"))
    available = int(psutil.virtual_memory().available)
    return copies * weights * 1.5 < available


def _disjoint(core_sets: list[tuple[int, ...]]) -> bool:
    """Whether every host is pinned to cores no other host uses (then their calibrations may run
    at once)."""
    seen: set[int] = set()
    for cores in core_sets:
        if not cores or seen & set(cores):
            return False
        seen |= set(cores)
    return True


def format_comparison(
    names: list[str],
    counts: Sequence[float],
    costs: list[MeasuredCosts],
    measured: list[float] | None,
) -> str:
    """Per stage: layers, predicted ms/token from the profile, measured ms/token, and the
    imbalance."""
    predicted = predicted_ms(counts, costs)
    lines = [
        f"{'stage':<6}{'host':<16}{'layers':>7}{'predicted ms':>14}{'measured ms':>13}{'error':>8}"
    ]
    for index, (name, layers, guess) in enumerate(zip(names, counts, predicted, strict=True)):
        real = measured[index] if measured else None
        error = f"{(guess - real) / real:+.0%}" if real else "-"
        shown = f"{real:.2f}" if real is not None else "-"
        lines.append(f"{index:<6}{name[:15]:<16}{layers:>7.3g}{guess:>14.2f}{shown:>13}{error:>8}")
    summary = f"imbalance (slowest - fastest) / slowest: predicted {imbalance(predicted):.0%}"
    if measured:
        summary += f", measured {imbalance(measured):.0%}"
    return "\n".join([*lines, summary])
