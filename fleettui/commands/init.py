"""Provides `fleettui init [OUT.toml] [user@host[:port] ...]`: probe the PCs, write a fleet file,
show its plan.

Hosts come from the arguments or, when none is given, are asked one per line. Each SSH host is
reached with its host key checked (known_hosts, or trust on first use with `--tofu`), measured (OS,
CPU, Python, memory, disk; OpenVINO devices with `--install`), and written with `memory_gb`,
`threads` and `device` filled from the measurements. The file is written with tomli-w, one table at
a time with comment lines saying what was measured, validated by loading it back, and planned."""

from __future__ import annotations

import argparse
import datetime
import getpass
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from fleettui.config.fleet import PRECISIONS, Fleet, Host, ModelSettings
from fleettui.errors import FleetError

NAME = "init"
HELP = (
    "probe PCs over SSH (reachability, host key, OS, Python, cores, memory, OpenVINO devices with "
    "--install), "
    "write a fleet file with what was measured, and print its stage plan"
)
DEFAULT_OUT = "fleet.toml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "targets",
        nargs="*",
        metavar="OUT.toml|user@host[:port]",
        help=f"the file to write (default {DEFAULT_OUT}) and the hosts, in pipeline order ('local' "
        "= this "
        "machine); without hosts they are asked one per line",
    )
    parser.add_argument(
        "--identity-file", type=Path, help="SSH private key (default: the agent / ~/.ssh keys)"
    )
    parser.add_argument(
        "--known-hosts",
        type=Path,
        default=Path("~/.ssh/known_hosts"),
        help="known_hosts to check keys against",
    )
    parser.add_argument(
        "--tofu",
        action="store_true",
        help="trust a host key seen for the first time (and add it to known_hosts)",
    )
    parser.add_argument(
        "--python", default="python3", help="the hosts' Python interpreter (default python3)"
    )
    parser.add_argument(
        "--workdir", default="~/.fleettui", help="the hosts' work folder (default ~/.fleettui)"
    )
    parser.add_argument(
        "--model", default=ModelSettings.name, help="model to plan for (default %(default)s)"
    )
    parser.add_argument(
        "--precision", default=ModelSettings.precision, help="weights: fp32|fp16|int8|int4"
    )
    parser.add_argument(
        "--shards", type=Path, help="shard cache root to write as [model] shards (default: unset)"
    )
    parser.add_argument(
        "--install",
        action="store_true",
        help="install the worker offline on each host and list its OpenVINO devices",
    )
    parser.add_argument("--force", action="store_true", help="overwrite OUT.toml if it exists")
    parser.add_argument(
        "--skip-failed",
        action="store_true",
        help="write the hosts that answered even if others did not",
    )


def split_targets(targets: list[str]) -> tuple[Path, list[str]]:
    """(output file, host addresses): the one argument ending in .toml is the file."""
    files = [target for target in targets if target.endswith(".toml")]
    if len(files) > 1:
        raise FleetError(f"init: one output file please, got {', '.join(files)}")
    return Path(files[0] if files else DEFAULT_OUT), [
        target for target in targets if not target.endswith(".toml")
    ]


def ask_addresses(stdin: Any = None) -> list[str]:
    """Host addresses typed one per line (an empty line or end of input finishes)."""
    stream = stdin or sys.stdin
    print(
        "hosts in pipeline order, one per line: user@host[:port] or 'local'; an empty line ends",
        file=sys.stderr,
    )
    addresses: list[str] = []
    while True:
        print(f"host {len(addresses) + 1}: ", end="", file=sys.stderr, flush=True)
        line = stream.readline()
        if not line or not line.strip():
            print(file=sys.stderr)
            return addresses
        addresses.append(line.strip())


def hosts_from(addresses: list[str], args: argparse.Namespace) -> list[Host]:
    from fleettui.control.probe import host_name, parse_address

    hosts: list[Host] = []
    taken: set[str] = set()
    for text in addresses:
        try:
            address = parse_address(text)
        except ValueError as error:
            raise FleetError(f"init: {error}") from None
        name = host_name(address, taken)
        taken.add(name)
        if address.is_local:
            hosts.append(Host(name=name))
            continue
        hosts.append(
            Host(
                name=name,
                transport="ssh",
                address=address.host,
                ssh_port=address.port,
                user=address.user,
                identity_file=args.identity_file.expanduser().resolve()
                if args.identity_file
                else None,
                host_key_policy="tofu" if args.tofu else "verify",
                known_hosts=args.known_hosts.expanduser().resolve(),
                python=args.python,
                workdir=args.workdir,
            )
        )
    return hosts


# -- writing ---------------------------------------------------------------------------------------


def _host_table(host: Host) -> dict[str, Any]:
    """The keys worth writing (defaults left out, so the file stays short and readable)."""
    default = Host(name=host.name)
    table: dict[str, Any] = {"name": host.name}
    if host.transport != "local":
        table.update(transport=host.transport, address=host.address)
        if host.ssh_port != 22:
            table["ssh_port"] = host.ssh_port
        table["user"] = host.user or getpass.getuser()
        if host.identity_file is not None:
            table["identity_file"] = str(host.identity_file)
        table["host_key_policy"] = "verify"  # init has checked (or just recorded) the key
        if host.known_hosts != default.known_hosts:
            table["known_hosts"] = str(host.known_hosts)
        if host.python != default.python:
            table["python"] = host.python
        if host.workdir != default.workdir:
            table["workdir"] = host.workdir
    table.update(device=host.device, memory_gb=host.memory_gb, threads=host.threads)
    return table


def fleet_text(
    model: str,
    precision: str,
    probes: list[Any],
    when: datetime.datetime,
    shards: Path | None = None,
) -> str:
    """The fleet file: tomli-w tables, each host preceded by comments on what was measured."""
    import tomli_w

    from fleettui.control.probe import describe

    parts = [
        f"# Fleet file written by `fleettui init` on {when:%Y-%m-%d %H:%M} UTC from {len(probes)} "
        "host(s).",
        "# Every key and its default is documented in fleets/office.toml of the fleettui sources.",
        "# `fleettui plan THIS_FILE` shows the stage plan; `fleettui THIS_FILE` deploys it and "
        "opens the TUI.",
        "",
        tomli_w.dumps(
            {
                "model": {
                    "name": model,
                    "precision": precision,
                    **({"shards": str(shards)} if shards else {}),
                }
            }
        ).rstrip(),
        "",
    ]
    for probe in probes:
        parts.extend(f"# {line}" for line in describe(probe))
        # tomli-w writes a short array of tables inline; a [[hosts]] table per host reads better and
        # leaves room for the comments: dump it as the table [hosts] and make the header an array
        # entry.
        table = tomli_w.dumps({"hosts": _host_table(probe.proposed())}).rstrip()
        assert table.startswith("[hosts]\n")
        parts.append("[[hosts]]" + table[len("[hosts]") :])
        parts.append("")
    return "\n".join(parts)


def run(args: argparse.Namespace) -> int:
    """`fleettui init`: 0 written and planned, 1 a host failed or the model does not fit, 2 bad
    input."""
    out, addresses = split_targets(args.targets)
    if args.precision not in PRECISIONS:
        raise FleetError(
            f"init: --precision {args.precision!r} is not one of {' | '.join(PRECISIONS)}"
        )
    model = Path(args.model).expanduser()
    if model.exists():  # a local model: absolute, so the file works from any folder
        args.model = str(model.resolve())
    if out.exists() and not args.force:
        raise FleetError(f"init: {out} exists: pass --force to overwrite it, or another file name")
    if not addresses:
        addresses = ask_addresses()
    if not addresses:
        raise FleetError("init: no hosts given")
    hosts = hosts_from(addresses, args)
    from fleettui.commands.progress import ProgressReporter
    from fleettui.control.probe import probe_hosts, summary
    from fleettui.control.running import run as run_loop

    with (
        ProgressReporter() as reporter
    ):  # a signal closes the SSH connections (and an install) cleanly
        probes = run_loop(lambda: probe_hosts(hosts, args.install, reporter.provision))
    for probe in probes:
        print(f"{'ok' if probe.ok else 'FAILED'} {summary(probe)}", file=sys.stderr)
    answered = [probe for probe in probes if probe.ok]
    failed = [probe for probe in probes if not probe.ok]
    if failed and (not args.skip_failed or not answered):
        print(f"fleettui: init: {len(failed)} host(s) failed; nothing written", file=sys.stderr)
        if answered:
            print("fleettui: init: --skip-failed writes the hosts that answered", file=sys.stderr)
        return 1
    when = datetime.datetime.now(datetime.timezone.utc)
    out.parent.mkdir(parents=True, exist_ok=True)
    shards = args.shards.expanduser().resolve() if args.shards else None
    out.write_text(fleet_text(args.model, args.precision, answered, when, shards), encoding="utf-8")
    fleet = _validated(out)
    print(f"wrote {out} ({len(fleet.hosts)} host(s))")
    return _print_plan(fleet) if not failed else 1


def _validated(path: Path) -> Fleet:
    from fleettui.config.fleet import load_fleet

    # what init writes must load; a FleetConfigError here is a bug worth seeing
    return load_fleet(path)


def _print_plan(fleet: Fleet) -> int:
    from fleettui.config.local_cores import share_local_cores
    from fleettui.errors import PlanError
    from fleettui.planning.planner import format_plan, plan_fleet

    try:
        print(format_plan(plan_fleet(share_local_cores(replace(fleet)))))  # as it will run
    except PlanError as error:
        print(f"fleettui: the plan: {error}", file=sys.stderr)
        return 1
    return 0
