"""`fleettui init`: probe real sshd hosts in network namespaces, write a fleet file that
validates, plan it."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from fleettui.config.fleet import load_fleet
from fleettui.control.probe import HostProbe, host_name, parse_address
from fleettui.provision.events import Preflight
from tests.support.netns import SshHosts, available

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30


def init(
    *arguments: str, stdin: str = "", cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleettui", "init", *arguments],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd or ROOT,
    )


# -- pure parts
# -----------------------------------------------------------------------------------------


def test_addresses_and_names() -> None:
    assert parse_address("fleet@192.168.1.20:2222") == parse_address(" fleet@192.168.1.20:2222 ")
    address = parse_address("fleet@192.168.1.20:2222")
    assert (address.user, address.host, address.port) == ("fleet", "192.168.1.20", 2222)
    assert parse_address("[fe80::1]:22").host == "fe80::1" and parse_address("pc-a").user is None
    assert parse_address("local").is_local
    for bad in ("a@b@c", "pc:99999", "", "pc a"):
        with pytest.raises(ValueError, match="address|port"):
            parse_address(bad)
    taken: set[str] = set()
    for text in ("pc-a", "pc-a", "10.0.0.5:2200", "[fe80::1]"):
        taken.add(host_name(parse_address(text), taken))
    assert taken == {"pc-a", "pc-a-2", "10.0.0.5-2200", "fe80--1"}


def test_written_text_validates_and_says_what_was_measured(tmp_path: Path) -> None:
    from fleettui.commands.init import fleet_text
    from fleettui.config.fleet import Host

    preflight = Preflight(
        "Linux",
        "Debian 12",
        "x86_64",
        "Intel Core i5",
        8,
        (3, 11, 2),
        "/usr/bin/python3",
        ("glibc", "2.36"),
        "/home/fleet/.fleettui",
        100 * GIB,
        16 * GIB,
        12 * GIB,
        True,
        devices=("CPU", "GPU"),
        device_names={"CPU": "Intel Core i5", "GPU": "Intel UHD"},
        openvino="2026.4.1",
    )
    host = Host("pc-a", transport="ssh", address="10.0.0.5", ssh_port=2222, user="fleet")
    probe = HostProbe(
        host, True, preflight, "ssh-ed25519 SHA256:abc", "verified against known_hosts"
    )
    path = tmp_path / "fleet.toml"
    path.write_text(
        fleet_text("smollm2-135m-instruct", "int4", [probe], datetime.datetime(2026, 1, 2))
    )
    fleet = load_fleet(path)
    written = fleet.hosts[0]
    assert (written.memory_gb, written.threads, written.device) == (12.0, 8, "CPU")  # 75% of 16 GB
    assert (written.ssh_port, written.user, written.host_key_policy) == (2222, "fleet", "verify")
    text = path.read_text()
    assert (
        "# measured by `fleettui init`: Debian 12 x86_64, Intel Core i5 x8, Python 3.11.2" in text
    )
    assert "# host key ssh-ed25519 SHA256:abc (verified against known_hosts)" in text
    assert "# OpenVINO 2026.4.1 devices: CPU: Intel Core i5, GPU: Intel UHD" in text


def test_local_hosts_are_measured_here_and_planned(tmp_path: Path) -> None:
    out = tmp_path / "local.toml"
    result = init(str(out), "local", "local", "--model", "smollm2-135m-instruct")
    assert result.returncode == 0, result.stderr
    fleet = load_fleet(out)
    assert [host.name for host in fleet.hosts] == ["local", "local-2"]
    expected = round(psutil.virtual_memory().total / GIB * 0.75, 1)
    assert all(host.is_local and host.memory_gb == expected for host in fleet.hosts)
    assert all(host.threads == os.cpu_count() for host in fleet.hosts)
    assert "this machine (no SSH)" in out.read_text()
    assert "stage host" in result.stdout and "[0, " in result.stdout  # the plan is printed
    again = init(str(out), "local")
    assert again.returncode == 2 and "exists: pass --force" in again.stderr


# -- against real sshd hosts
# -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ssh_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHosts]:
    reason = available()
    if reason and os.environ.get("CI"):
        pytest.fail(f"CI must run the real-sshd tests: {reason}")
    if reason:
        pytest.skip(reason)
    with SshHosts(2, tmp_path_factory.mktemp("sshd")) as hosts:
        yield hosts


def addresses(hosts: SshHosts) -> list[str]:
    return [f"root@{host.address}:{host.port}" for host in hosts.hosts]


def fingerprint(public_key_line: str, tmp_path: Path) -> str:
    key = tmp_path / "key.pub"
    key.write_text(public_key_line + "\n")
    return subprocess.run(
        ["ssh-keygen", "-lf", str(key)], capture_output=True, text=True, check=True
    ).stdout.split()[1]


def common(hosts: SshHosts, tmp_path: Path, known_hosts: Path | None = None) -> list[str]:
    return [
        "--identity-file",
        str(hosts.client_key),
        "--known-hosts",
        str(known_hosts or hosts.known_hosts),
        "--workdir",
        str(tmp_path / "work"),
    ]


@pytest.mark.ssh
def test_init_probes_two_hosts_and_writes_a_fleet_that_validates(
    ssh_hosts: SshHosts, tmp_path: Path
) -> None:
    out = tmp_path / "office.toml"
    result = init(str(out), *addresses(ssh_hosts), *common(ssh_hosts, tmp_path))
    assert result.returncode == 0, result.stderr
    fleet = load_fleet(out)
    # the namespaces share this machine
    expected_memory = round(psutil.virtual_memory().total / GIB * 0.75, 1)
    for host, ssh_host in zip(fleet.hosts, ssh_hosts.hosts, strict=True):
        assert (host.transport, host.address, host.ssh_port, host.user) == (
            "ssh",
            ssh_host.address,
            ssh_host.port,
            "root",
        )
        assert (host.memory_gb, host.threads, host.device) == (
            expected_memory,
            os.cpu_count(),
            "CPU",
        )
        assert (
            host.identity_file == ssh_hosts.client_key and host.known_hosts == ssh_hosts.known_hosts
        )
        assert host.host_key_policy == "verify" and host.workdir == str(tmp_path / "work")
    text = out.read_text()
    for ssh_host in ssh_hosts.hosts:
        key = fingerprint(ssh_host.host_key, tmp_path)
        assert f"# host key ssh-ed25519 {key} (verified against {ssh_hosts.known_hosts})" in text
    assert text.count("# measured by `fleettui init`: ") == 2 and "Python 3." in text
    # planned on both
    assert "stage host" in result.stdout and f"{fleet.hosts[1].name}" in result.stdout
    assert result.stderr.count("ok ") >= 2


@pytest.mark.ssh
def test_init_asks_for_hosts_when_none_are_given(ssh_hosts: SshHosts, tmp_path: Path) -> None:
    out = tmp_path / "asked.toml"
    typed = "\n".join(addresses(ssh_hosts)[:1]) + "\n\n"
    result = init(str(out), *common(ssh_hosts, tmp_path), stdin=typed)
    assert result.returncode == 0, result.stderr
    assert "host 1: " in result.stderr and "host 2: " in result.stderr
    assert [host.address for host in load_fleet(out).hosts] == [ssh_hosts.hosts[0].address]


@pytest.mark.ssh
def test_unknown_host_key_is_refused_unless_tofu(ssh_hosts: SshHosts, tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    known.write_text("")
    out = tmp_path / "fleet.toml"
    refused = init(str(out), addresses(ssh_hosts)[0], *common(ssh_hosts, tmp_path, known))
    assert (
        refused.returncode == 1
        and "not trusted" in refused.stderr
        and "nothing written" in refused.stderr
    )
    assert not out.exists()
    trusted = init(str(out), addresses(ssh_hosts)[0], "--tofu", *common(ssh_hosts, tmp_path, known))
    assert trusted.returncode == 0, trusted.stderr
    # recorded for the next connection
    assert ssh_hosts.hosts[0].host_key.split()[1] in known.read_text()
    assert f"trusted on first use, now in {known}" in out.read_text()
    assert load_fleet(out).hosts[0].host_key_policy == "verify"  # from now on the key is checked


@pytest.mark.ssh
def test_an_unreachable_host_writes_nothing_unless_skipped(
    ssh_hosts: SshHosts, tmp_path: Path
) -> None:
    out = tmp_path / "fleet.toml"
    live = addresses(ssh_hosts)[0]
    dead = f"root@{ssh_hosts.hosts[1].address}:1"  # nothing listens on port 1
    result = init(str(out), live, dead, *common(ssh_hosts, tmp_path))
    assert result.returncode == 1 and not out.exists()
    assert f"FAILED {ssh_hosts.hosts[1].address}-1: connect: cannot reach" in result.stderr
    skipped = init(str(out), live, dead, "--skip-failed", *common(ssh_hosts, tmp_path))
    assert skipped.returncode == 1 and [h.address for h in load_fleet(out).hosts] == [
        ssh_hosts.hosts[0].address
    ]


@pytest.mark.ssh
@pytest.mark.slow
def test_install_lists_the_openvino_devices(ssh_hosts: SshHosts, tmp_path: Path) -> None:
    out = tmp_path / "fleet.toml"
    result = init(str(out), addresses(ssh_hosts)[0], "--install", *common(ssh_hosts, tmp_path))
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert "# OpenVINO 2026" in text and "devices: CPU: " in text
    assert load_fleet(out).hosts[0].device == "CPU"


@pytest.mark.ssh
@pytest.mark.slow
def test_from_init_to_an_answer_without_editing_the_file(
    ssh_hosts: SshHosts, shard_cache: Path, tmp_path: Path
) -> None:
    """The file init writes deploys as it is: a 1-host SSH fleet answers with the unsplit model's
    greedy text."""
    out = tmp_path / "fleet.toml"
    written = init(
        str(out),
        addresses(ssh_hosts)[1],
        "--install",
        "--shards",
        str(shard_cache),
        *common(ssh_hosts, tmp_path),
    )
    assert written.returncode == 0, written.stderr
    fleet = load_fleet(out)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fleettui",
            str(out),
            "--ask",
            "What is the capital of France?",
            "--exact",
            "--no-spec",
            "--json",
            "--max-tokens",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in json.loads(result.stdout)["text"]
    # progress of the SFTP push, as plain lines
    assert f"{fleet.hosts[0].name} push shard" in result.stderr
