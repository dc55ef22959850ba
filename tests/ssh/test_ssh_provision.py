"""SSH provisioning against real sshd hosts in network namespaces: connect, push, resume, keys,
launch, stop."""
# The test hosts share this machine's filesystem: the tests look at "remote" files directly,
# blocking is fine.
# ruff: noqa: ASYNC220, ASYNC221, ASYNC230, ASYNC240

from __future__ import annotations

import asyncio
import getpass
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from fleettui.config.fleet import Fleet, Host, load_fleet
from fleettui.errors import ProvisionError
from tests.support.netns import SshHosts, alive

pytestmark = pytest.mark.ssh
asyncssh = pytest.importorskip("asyncssh")

from fleettui.provision.deploy import (  # noqa: E402 - after the skip: it imports asyncssh
    DeployOptions,
    HostSession,
    ShardAssignment,
    deploy_fleet,
    stop_fleet,
)
from fleettui.provision.events import ProvisionEvent  # noqa: E402

SLEEPER = "import time; time.sleep(600)"


@pytest.fixture(scope="module")
def fleet(ssh_hosts: SshHosts, tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    path = tmp_path_factory.mktemp("fleet") / "ssh.toml"
    path.write_text(ssh_hosts.fleet_toml())
    return load_fleet(path)


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    """A small stand-in shard folder: manifest, stage_0 (two files), stage_1, tokenizer."""
    folder = tmp_path / "shard"
    (folder / "stage_0").mkdir(parents=True)
    (folder / "stage_1").mkdir()
    (folder / "tokenizer").mkdir()
    (folder / "manifest.json").write_text(json.dumps({"stages": 2}))
    (folder / "stage_0" / "openvino_model.xml").write_text("<net/>" * 1000)
    (folder / "stage_0" / "openvino_model.bin").write_bytes(os.urandom(24 << 20))
    (folder / "stage_1" / "openvino_model.bin").write_bytes(os.urandom(1 << 20))
    (folder / "tokenizer" / "tokenizer.json").write_text("{}")
    return folder


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def test_connect_and_preflight_two_hosts(fleet: Fleet) -> None:
    events: list[ProvisionEvent] = []

    async def preflight(host: Host):
        async with HostSession(host, events.append) as session:
            return await session.run_preflight()

    results = await asyncio.gather(*(preflight(host) for host in fleet.hosts))
    for host, result in zip(fleet.hosts, results, strict=True):
        assert result.system == "Linux" and result.python >= (3, 10, 0)
        assert result.workdir == host.workdir and Path(result.workdir).is_dir()
        assert result.memory_total > 0 and result.disk_free > 0 and result.cpu_count >= 1
    assert {event.host for event in events if event.step == "preflight" and event.message} == {
        "host0",
        "host1",
    }


async def test_push_is_verified_and_unchanged_push_sends_zero_bytes(
    fleet: Fleet, shard: Path
) -> None:
    host = fleet.hosts[0]
    async with HostSession(host) as session:
        await session.run_preflight()
        remote, first = await session.push_shard(ShardAssignment(shard, 0))
        assert first.bytes_sent == first.bytes_total > 24 << 20 and first.files_sent == 3
        print(
            f"SFTP push: {first.bytes_sent / 1e6:.1f} MB at {first.megabytes_per_second:.1f} MB/s"
        )
        for name in ("manifest.json", "stage_0/openvino_model.bin", "stage_0/openvino_model.xml"):
            assert sha256(Path(remote) / name) == sha256(shard / name)
        assert not (Path(remote) / "stage_1").exists()  # only this stage's files travel
        assert not (Path(remote) / "tokenizer").exists()
        again_remote, again = await session.push_shard(ShardAssignment(shard, 0))
        assert again_remote == remote and again.bytes_sent == 0 and again.files_sent == 0


async def test_push_resumes_a_truncated_file_and_restarts_a_foreign_one(
    fleet: Fleet, shard: Path
) -> None:
    host = fleet.hosts[1]
    async with HostSession(host) as session:
        await session.run_preflight()
        remote, _ = await session.push_shard(ShardAssignment(shard, 0))
        weights = Path(remote) / "stage_0" / "openvino_model.bin"
        size = weights.stat().st_size
        with open(weights, "r+b") as stream:
            stream.truncate(5 << 20)  # an interrupted copy
        _, resumed = await session.push_shard(ShardAssignment(shard, 0))
        assert resumed.bytes_resumed == 5 << 20 and resumed.bytes_sent == size - (5 << 20)
        assert sha256(weights) == sha256(shard / "stage_0" / "openvino_model.bin")
        # a leftover .part that is not a prefix of the file is discarded, and the file sent whole
        weights.unlink()
        Path(str(weights) + ".part").write_bytes(b"garbage" * 1000)
        _, restarted = await session.push_shard(ShardAssignment(shard, 0))
        assert restarted.bytes_resumed == 0 and restarted.bytes_sent == size
        assert sha256(weights) == sha256(shard / "stage_0" / "openvino_model.bin")
        assert not Path(str(weights) + ".part").exists()


async def test_a_redeploy_reads_no_unchanged_stage_file_and_the_worker_trusts_the_push(
    fleet: Fleet, tmp_path: Path
) -> None:
    """The host checks a stage's files with the worker's own stamp: the worker's start after a push,
    and an unchanged redeploy, read none of them (an 8B stage is gigabytes); any write on the host
    is caught."""
    from remote_worker.manifest import VERIFIED_FOLDER, verify_stage, write_manifest
    from tests.support.manifests import fake_manifest, rot_behind_the_stamp

    folder = tmp_path / "shard"
    manifest = fake_manifest(folder)
    write_manifest(folder, manifest)
    weights = "stage_0/openvino_model.bin"
    async with HostSession(fleet.hosts[0]) as session:
        await session.run_preflight()
        remote, first = await session.push_shard(ShardAssignment(folder, 0))
        assert first.files_sent == 3
        assert verify_stage(Path(remote), manifest, 0) == 0  # the worker's start hashes nothing
        stamp = Path(remote) / VERIFIED_FOLDER / "stage_0.json"
        stamp.unlink()
        # now the worker writes the stamp itself
        assert verify_stage(Path(remote), manifest, 0) == 2
        # the host reports a stamped file's hash without reading it: a record edited to claim
        # another hash (the file itself untouched) is what the host reports, so that file travels
        # again
        record = json.loads(stamp.read_text())
        record["files"][weights][0] = "0" * 64
        stamp.write_text(json.dumps(record))
        _, again = await session.push_shard(ShardAssignment(folder, 0))
        assert (again.files_sent, again.bytes_sent) == (1, (folder / weights).stat().st_size)
        _, unchanged = await session.push_shard(ShardAssignment(folder, 0))
        assert unchanged.files_sent == 0 and unchanged.bytes_sent == 0
        # a file rewritten on the host with its size and modification time kept is read again and
        # replaced
        path = Path(remote) / weights
        before = path.stat()
        path.write_bytes(bytes(before.st_size))
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        _, repaired = await session.push_shard(ShardAssignment(folder, 0))
        assert repaired.files_sent == 1 and sha256(path) == sha256(folder / weights)
        assert verify_stage(Path(remote), manifest, 0) == 0
        # bit rot on the host, invisible to the stamp: only a recheck reads the file and replaces it
        rot_behind_the_stamp(Path(remote), weights, stamp)
        _, trusted = await session.push_shard(ShardAssignment(folder, 0))
        assert trusted.files_sent == 0
        _, rechecked = await session.push_shard(ShardAssignment(folder, 0), recheck=True)
        assert rechecked.files_sent == 1 and sha256(path) == sha256(folder / weights)
        assert verify_stage(Path(remote), manifest, 0) == 0  # stamped again by the recheck
        # ... and bit rot on the operator's copy is refused by a recheck before anything travels
        rot_behind_the_stamp(folder, weights, folder / VERIFIED_FOLDER / "stage_0.json")
        assert (await session.push_shard(ShardAssignment(folder, 0)))[1].files_sent == 0
        with pytest.raises(
            ProvisionError, match=r"local shard .*openvino_model\.bin: SHA-256 mismatch"
        ):
            await session.push_shard(ShardAssignment(folder, 0), recheck=True)
        # a stage file changed on the operator's machine is refused before anything travels
        (folder / weights).write_text("tampered")
        with pytest.raises(
            ProvisionError, match=r"local shard .*openvino_model\.bin: SHA-256 mismatch"
        ):
            await session.push_shard(ShardAssignment(folder, 0))


async def test_config_is_written_with_mode_0600(fleet: Fleet) -> None:
    async with HostSession(fleet.hosts[0]) as session:
        await session.run_preflight()
        paths = session.paths()
        await session.write_config(paths.config, '{"secret": "curve key"}')
    config = Path(paths.config)
    assert json.loads(config.read_text()) == {"secret": "curve key"}
    assert config.stat().st_mode & 0o777 == 0o600


async def test_wrong_key_is_a_clear_error(fleet: Fleet, ssh_hosts: SshHosts) -> None:
    host = replace(fleet.hosts[0], identity_file=ssh_hosts.other_key)
    with pytest.raises(ProvisionError) as caught:
        await HostSession(host).open()
    message = str(caught.value)
    assert message.startswith(f"host0: connect: authentication refused for {getpass.getuser()}@")
    assert str(ssh_hosts.other_key) in message


async def test_unknown_host_key_refused_unless_tofu(
    fleet: Fleet, tmp_path: Path, ssh_hosts: SshHosts
) -> None:
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")
    host = replace(fleet.hosts[1], known_hosts=known_hosts)
    with pytest.raises(
        ProvisionError,
        match=r'host1: connect: host key of .* is not trusted .*host_key_policy = "tofu"',
    ):
        await HostSession(host).open()
    trusting = replace(host, host_key_policy="tofu")
    async with HostSession(trusting) as session:
        await session.run_preflight()
    assert known_hosts.read_text().strip() == ssh_hosts.hosts[1].known_hosts_line
    async with HostSession(host):  # remembered: now plain verification passes
        pass
    # once known, a different key is refused even under tofu (that is the point of remembering)
    other = ssh_hosts.hosts[0].known_hosts_line.split(" ", 1)[1]
    known_hosts.write_text(ssh_hosts.hosts[1].known_hosts_line.split(" ")[0] + " " + other + "\n")
    with pytest.raises(ProvisionError, match="not trusted"):
        await HostSession(trusting).open()


async def test_launch_detaches_and_stop_stops_exactly_what_was_started(fleet: Fleet) -> None:
    host = fleet.hosts[0]
    async with HostSession(host) as session:
        await session.run_preflight()
        paths = session.paths()
        pid = await session.launch(
            ["python3", "-c", SLEEPER], paths, "deploy-a", {"FLEETTUI_STAGE": "0"}
        )
    # the SSH session is closed; the process lives on in its own session, with our pid file and log
    assert alive(pid) and os.getsid(pid) == pid
    record = json.loads(Path(paths.pidfile).read_text())
    assert record["pid"] == pid and record["deployment"] == "deploy-a"
    assert b"FLEETTUI_STAGE=0" in Path(f"/proc/{pid}/environ").read_bytes()
    bystander = subprocess.Popen([sys.executable, "-c", SLEEPER], start_new_session=True)
    try:
        async with HostSession(host) as session:
            assert (await session.status(paths.pidfile))["alive"]
            # another deployment's stop leaves it alone
            other = await session.stop([paths.pidfile], "deploy-b", 5)
            assert (
                other[0].action == "none" and "another deployment" in other[0].detail and alive(pid)
            )
            stopped = await session.stop([paths.pidfile], "deploy-a", 5)
            assert stopped[0].pid == pid and stopped[0].action == "terminated"
            assert not alive(pid) and not Path(paths.pidfile).exists()
            # a pid file whose pid now belongs to someone else (start time differs) is not acted on
            Path(paths.pidfile).write_text(
                json.dumps({"pid": bystander.pid, "start": "1", "deployment": "x"})
            )
            reused = await session.stop([paths.pidfile], None, 5)
            assert reused[0].action == "none" and "reused" in reused[0].detail
            assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


async def test_launch_reports_a_process_that_dies_at_once(fleet: Fleet) -> None:
    async with HostSession(fleet.hosts[1]) as session:
        await session.run_preflight()
        for said in (
            "an earlier run",
            "bad config",
        ):  # one log, appended to: each error names its own run
            command = ["python3", "-c", f"import sys; print({said!r}); sys.exit(3)"]
            with pytest.raises(ProvisionError, match=f"exited at once with status 3: {said}$"):
                await session.launch(command, session.paths(), "deploy-c", {})


async def test_one_host_down_is_reported_while_the_other_proceeds(
    fleet: Fleet, ssh_hosts: SshHosts, shard: Path
) -> None:
    ssh_hosts.stop_sshd(1)
    events: list[ProvisionEvent] = []
    try:
        options = DeployOptions(
            install=False, argv=("{python}", "-c", SLEEPER, "{config}"), connect_timeout=5
        )
        shards = {
            host.name: ShardAssignment(shard, index) for index, host in enumerate(fleet.hosts)
        }
        configs = {
            host.name: (lambda paths: json.dumps({"shard": paths.shard})) for host in fleet.hosts
        }
        started = time.monotonic()
        report = await deploy_fleet(fleet, shards, configs, events.append, options=options)
        assert time.monotonic() - started < 60
        up, down = report.host("host0"), report.host("host1")
        assert up.ok and up.pid and alive(up.pid) and up.step == "done"
        assert json.loads(Path(up.paths.config).read_text())["shard"] == up.paths.shard
        assert not down.ok and down.step == "connect" and "cannot reach" in down.error
        assert any(e.host == "host1" and e.step == "failed" for e in events)
        assert any(e.host == "host0" and e.step == "shard" and e.bytes_total for e in events)
        assert "host1: FAILED at connect" in report.summary()
        stop = await stop_fleet(fleet, report.deployment, options=options)
        stopped = {host.host: host for host in stop.hosts}
        assert stopped["host0"].ok and stopped["host0"].processes[0].pid == up.pid
        assert stopped["host0"].processes[0].action == "terminated" and not alive(up.pid)
        assert not stopped["host1"].ok and "cannot reach" in stopped["host1"].error
    finally:
        ssh_hosts.start_sshd(1)
    left = [
        pid
        for host in ssh_hosts.hosts
        for pid in ssh_hosts.namespace_pids(host)
        if "sleep(600)" in cmdline(pid)
    ]
    assert not left, f"stage processes left: {left}"


async def test_two_fleets_naming_a_host_alike_keep_their_own_workers(
    fleet: Fleet, shard: Path
) -> None:
    """Same host name, same SSH host, other port block (another fleet file): neither replaces the
    other."""
    from fleettui.provision.deploy import deploy_host, stop_host

    options = DeployOptions(install=False, argv=("{python}", "-c", SLEEPER, "{config}"))
    first, second = fleet.hosts[0], replace(fleet.hosts[0], base_port=fleet.hosts[0].base_port + 40)
    one = await deploy_host(first, ShardAssignment(shard, 0), "{}", "fleet-one", options)
    two = await deploy_host(second, ShardAssignment(shard, 0), "{}", "fleet-two", options)
    try:
        assert one.ok and two.ok and one.pid != two.pid
        assert one.paths and two.paths and one.paths.pidfile != two.paths.pidfile
        # the second deploy did not stop the first fleet's worker
        assert alive(one.pid) and alive(two.pid)
        again = await deploy_host(
            first, ShardAssignment(shard, 0), "{}", "fleet-one-again", options
        )
        # a redeploy replaces only its own run
        assert again.ok and not alive(one.pid) and alive(two.pid)
        stopped = await stop_host(first, None, options)
        assert [p.pid for p in stopped.processes] == [again.pid] and alive(two.pid)
    finally:
        await stop_host(second, None, options)
    assert not alive(two.pid)


# A stand-in stage that does, per run, what argv[2] says ("first,later"): its runs are counted in
# argv[1]. (No braces: deploy formats every argv part.)
STAGED = """
import os, signal, sys, time
from pathlib import Path
folder = Path(sys.argv[1])
runs = len(list(folder.glob('run-*')))
(folder / ('run-%d' % runs)).write_text(str(os.getpid()))
how = sys.argv[2].split(',')[min(runs, 1)]
if how == 'ready':
    (folder / 'ready').write_text(str(os.getpid()))
    time.sleep(600)
if how == 'killed-at-once':
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(1.0)
if how == 'killed':
    os.kill(os.getpid(), signal.SIGKILL)
print('remote_worker: shard /x/stage_0: missing', flush=True)
sys.exit(3)
"""


@pytest.mark.parametrize(
    ("runs", "started_again"),
    [
        ("killed,ready", "died without a reason (killed?)"),
        ("killed-at-once,ready", "killed by signal 9 (SIGKILL) at once"),
        ("fails,ready", None),
        ("killed,killed", "died without a reason (killed?)"),
    ],
)
async def test_a_stage_killed_while_it_loads_is_started_again_once(
    fleet: Fleet, shard: Path, tmp_path: Path, runs: str, started_again: str | None
) -> None:
    """A worker that dies before its handshake without a word (SIGKILL: the OOM killer, a stray
    kill) is started once more, also when it died within the launch's own look; one that says why
    (an exit code with its "remote_worker: ..." line) or dies again fails the host at once with its
    log, nothing left."""
    from fleettui.provision.deploy import deploy_host, stop_host

    folder = tmp_path / "runs"
    folder.mkdir()

    async def ready(_host: Host, _result: object) -> None:
        for _ in range(300):
            if (folder / "ready").exists():
                return
            await asyncio.sleep(0.1)
        raise TimeoutError("no handshake within 30 s")

    options = DeployOptions(install=False, argv=("{python}", "-c", STAGED, str(folder), runs))
    events: list[ProvisionEvent] = []
    host = fleet.hosts[0]
    report = await deploy_host(
        host, ShardAssignment(shard, 0), "{}", "deploy-k", options, events.append, ready
    )
    try:
        pids = [int(path.read_text()) for path in sorted(folder.glob("run-*"))]
        said = [e.message for e in events if "starting it again" in e.message]
        if started_again is None:  # a reason: not started again
            assert len(pids) == 1 and not said
        else:
            assert len(pids) == 2 and said == [
                f"the stage process {started_again} before it was ready; starting it again"
            ]
        if runs.endswith("ready"):
            if started_again is None:
                assert not report.ok and report.step == "ready"
                assert report.error == (
                    "the stage process exited while loading; log: remote_worker: shard /x/stage_0: "
                    "missing"
                )
            else:
                assert report.ok and report.pid == pids[1] == int((folder / "ready").read_text())
                assert alive(pids[1]) and not alive(pids[0])
        else:
            assert not report.ok and report.step == "ready" and report.error
            assert report.error.startswith("the stage process exited while loading")
    finally:
        await stop_host(host, None, options)
    assert not any(alive(pid) for pid in pids)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def fake_worker(tmp_path: Path) -> Path:
    """A tiny stand-in ``remote_worker`` package, to test the wheelhouse mechanics without
    openvino."""
    package = tmp_path / "src" / "remote_worker"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text('"""Stand-in worker."""\n')
    (package / "__main__.py").write_text(
        "import sys, time\nprint('worker', sys.argv[1:], flush=True)\ntime.sleep(600)\n"
    )
    return package


async def test_offline_install_from_wheelhouse_then_skip(
    fleet: Fleet, tmp_path: Path, shard: Path
) -> None:
    """Wheel of only remote_worker + a dependency, pushed and installed with --no-index; then
    skipped."""
    import psutil

    host = fleet.hosts[1]
    options = DeployOptions(
        wheelhouse_cache=tmp_path / "wheelhouse",
        worker_source=fake_worker(tmp_path),
        requirements=(f"psutil=={psutil.__version__}",),
    )
    from fleettui.provision.wheelhouse import Target, build_wheelhouse

    async with HostSession(host) as session:
        preflight = await session.run_preflight()
        wheelhouse = await build_wheelhouse(
            Target.from_preflight(preflight),
            options.wheelhouse_cache,
            options.worker_source,
            list(options.requirements),
        )
        names = sorted(path.name.split("-")[0] for path in wheelhouse.files)
        assert names == ["fleettui_remote_worker", "pip", "psutil"]
        installed, pushed = await session.install(wheelhouse)
        assert installed and pushed and pushed.bytes_sent > 0
        python = session.venv_python()
        check = subprocess.run(
            [python, "-c", "import remote_worker, psutil; print(remote_worker.__file__)"],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        assert check.returncode == 0 and str(host.workdir) in check.stdout
        await session.run_preflight()
        assert await session.install(wheelhouse) == (False, None)
        pid = await session.launch(
            shlex.split(f"{python} -m remote_worker --config x.json"),
            session.paths(),
            "deploy-w",
            {},
        )
        await asyncio.sleep(0.5)
        assert "worker ['--config', 'x.json']" in await session.tail(session.paths().log)
        await session.stop([session.paths().pidfile], "deploy-w", 5)
        assert not alive(pid)


@pytest.mark.slow
async def test_real_worker_wheelhouse_installs_offline_and_sees_openvino_devices(
    fleet: Fleet,
) -> None:
    """The real remote_worker wheel + openvino/numpy/pyzmq/psutil, installed with --no-index on a
    host."""
    from fleettui.provision.wheelhouse import Target, build_wheelhouse

    host = fleet.hosts[0]
    async with HostSession(host) as session:
        preflight = await session.run_preflight()
        wheelhouse = await build_wheelhouse(Target.from_preflight(preflight))
        names = {path.name.split("-")[0] for path in wheelhouse.files}
        assert {"fleettui_remote_worker", "openvino", "numpy", "pyzmq", "psutil", "pip"} <= names
        installed, pushed = await session.install(wheelhouse)
        if installed:
            assert pushed is not None and pushed.bytes_sent > 0
            print(
                f"wheelhouse push: {pushed.bytes_sent / 1e6:.1f} MB at "
                f"{pushed.megabytes_per_second:.1f} MB/s"
            )
        probed = await session.probe_devices()
        assert "CPU" in probed.devices and probed.openvino
        await session.run_preflight()
        assert await session.install(wheelhouse) == (False, None)  # same wheelhouse: nothing to do


def test_only_the_interpreter_meets_the_shell(tmp_path: Path) -> None:
    from fleettui.provision.remote import PosixShell, PowerShell

    payload = {"workdir": str(tmp_path / 'it\'s a "dir" $HOME `x`')}
    command, program = PosixShell().python_operation("~/my env/python", "preflight", payload)
    assert command == "\"$HOME\"/'my env/python' -"
    assert (
        PowerShell().python_operation("C:/Python 3/python.exe", "stop", {})[0]
        == "& 'C:/Python 3/python.exe' -"
    )
    answer = subprocess.run(
        [sys.executable, "-"], input=program, capture_output=True, text=True, check=True
    )
    result = json.loads(answer.stdout.split("FLEETTUI-RESULT ", 1)[1])
    assert result["workdir"] == payload["workdir"] and Path(payload["workdir"]).is_dir()


def test_wheel_targets() -> None:
    from fleettui.provision.wheelhouse import Target

    linux = Target((3, 11), "Linux", "x86_64", ("glibc", "2.36")).platforms()
    assert (
        linux[0] == "manylinux_2_36_x86_64"
        and "manylinux_2_17_x86_64" in linux
        and "manylinux2014_x86_64" in linux
    )
    assert Target((3, 12), "Windows", "AMD64").platforms() == ["win_amd64"]
    with pytest.raises(ProvisionError, match="no wheelhouse recipe"):
        Target((3, 12), "Darwin", "arm64").platforms()


@pytest.mark.slow
async def test_real_pipeline_over_ssh_matches_local_then_redeploys_with_zero_bytes_and_stops(
    ssh_hosts: SshHosts, tmp_path: Path
) -> None:
    """The real model's 2-stage pipeline deployed over SSH answers like the same split run
    locally."""
    from fleettui.control.controller import FleetController, compile_model
    from fleettui.control.deployment import build_deployment
    from fleettui.control.launcher import SshLauncher
    from fleettui.planning.planner import plan_fleet
    from fleettui.runtime.chat_format import ChatFormat
    from fleettui.runtime.coordinator import Coordinator
    from fleettui.runtime.generation import GenerationParams
    from fleettui.runtime.transport import ZmqLink

    path = tmp_path / "ssh.toml"
    path.write_text('[speculation]\ndraft = "none"\n\n' + ssh_hosts.fleet_toml(memory_gb=4.0))
    fleet = load_fleet(path)
    ranges = [tuple(r) for r in plan_fleet(fleet).ranges]
    target = await compile_model(
        fleet.model.name, ranges, fleet.model.precision, fleet.model.shards
    )
    params = GenerationParams(max_tokens=24)
    question = "What is the capital of France?"

    deployment = build_deployment(fleet, ranges, lambda host: str(target.directory))
    report = await SshLauncher(fleet, target.directory, deployment.keys).deploy_all(deployment)
    try:
        assert report.ok, report.summary()
        head, tail = deployment.stages[0], deployment.stages[-1]
        link = ZmqLink(
            head.data_url, tail.result_url, deployment.keys, head.server_key, tail.server_key
        )
        coordinator = Coordinator(link, ChatFormat(target.directory, target.manifest), None)
        assert await coordinator.hello() == 2
        session = await coordinator.open_session()
        remote = await coordinator.chat(session, question, params)
        await link.close()
        # the same fleet file with the hosts made local gives the same greedy tokens
        local_fleet = replace(
            fleet,
            hosts=tuple(
                replace(h, transport="local", address="127.0.0.1", workdir=str(tmp_path / "local"))
                for h in fleet.hosts
            ),
        )
        local_fleet = replace(
            local_fleet,
            hosts=tuple(
                replace(h, base_port=6550 + 10 * i) for i, h in enumerate(local_fleet.hosts)
            ),
        )
        controller = FleetController(local_fleet)
        try:
            local = await controller.ask(question, params)
        finally:
            await controller.stop()
        assert list(remote.token_ids) == list(local.token_ids) and "Paris" in remote.text

        # redeploy: same shard and wheelhouse, so 0 bytes of shard and no reinstall; the old stages
        # are replaced; with prune (`deploy --prune`) another, older shard folder on the hosts goes,
        # the current one stays
        for host in fleet.hosts:
            (Path(host.workdir) / "shards" / "older-split" / "stage_0").mkdir(parents=True)
        again = build_deployment(fleet, ranges, lambda host: str(target.directory))
        second = await SshLauncher(fleet, target.directory, again.keys, prune=True).deploy_all(
            again
        )
        assert second.ok, second.summary()
        for host in second.hosts:
            assert host.shard_push is not None and host.shard_push.bytes_sent == 0
            assert host.paths is not None
            shards = Path(host.paths.shard).parent
            assert [folder.name for folder in shards.iterdir()] == [Path(host.paths.shard).name]
            # reinstalled only when the worker's sources changed in between (other work in this
            # tree)
            assert host.installed == (host.wheelhouse != report.host(host.host).wheelhouse)
            assert not alive(report.host(host.host).pid)
    finally:
        stop = await stop_fleet(fleet)
    assert stop.ok and all(
        p.action in ("terminated", "killed") for h in stop.hosts for p in h.processes
    )
    left = [
        pid
        for host in ssh_hosts.hosts
        for pid in ssh_hosts.namespace_pids(host)
        if "remote_worker" in cmdline(pid)
    ]
    assert not left, f"stage processes left: {left}"


def test_a_failed_host_tells_whether_the_rest_can_run() -> None:
    from fleettui.config.fleet import FLEETS_DIR
    from fleettui.planning.planner import rest_can_run

    office = load_fleet(FLEETS_DIR / "office.toml")
    assert rest_can_run(office, {"pc-b"}).startswith("without pc-b the rest can run it: pc-a [0, ")
    big = replace(office, model=replace(office.model, name="llama-3.1-70b"))
    assert "pc-d [41, 80)" in rest_can_run(big, {"pc-b", "pc-c"})
    assert "does not fit" in rest_can_run(big, {"pc-b", "pc-c", "pc-d"})


@pytest.mark.slow
def test_ask_over_ssh_gives_the_tokens_of_the_embedded_local_fleet(
    ssh_hosts: SshHosts, tmp_path: Path
) -> None:
    """`fleettui FLEET --ask` on SSH hosts (deploy, answer, stop) equals `fleettui
    fleets/local.toml --ask`."""
    import json
    import subprocess
    import sys

    from fleettui.config.fleet import DEFAULT_FLEET
    from fleettui.config.local_cores import share_local_cores
    from fleettui.planning.planner import plan_fleet

    # The same split on both sides: a local host may have a measured cost profile (another test's
    # calibration) that an SSH host has not, and a different split rounds differently at bf16. (The
    # local fleet as it runs: its two stages on their own CPUs, which its profiles are keyed by.)
    text = ssh_hosts.fleet_toml(memory_gb=4.0)
    for index, stage in enumerate(plan_fleet(share_local_cores(load_fleet(DEFAULT_FLEET))).stages):
        text = text.replace(
            f'name = "host{index}"\n',
            f'name = "host{index}"\nlayers = [{stage.start}, {stage.end}]\n',
        )
    path = tmp_path / "office.toml"
    path.write_text(text)
    question = "What is the capital of France?"

    def ask(fleet_file: Path) -> dict:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "fleettui",
                str(fleet_file),
                "--ask",
                question,
                "--json",
                "--no-spec",
                "--max-tokens",
                "24",
            ],
            capture_output=True,
            text=True,
            timeout=1200,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        return json.loads(result.stdout)

    remote, local = ask(path), ask(DEFAULT_FLEET)
    assert remote["fleet"]["stages"] == local["fleet"]["stages"]
    assert remote["token_ids"] == local["token_ids"] and "Paris" in remote["text"]
    left = [
        pid
        for host in ssh_hosts.hosts
        for pid in ssh_hosts.namespace_pids(host)
        if "remote_worker" in cmdline(pid)
    ]
    assert not left, f"stage processes left after --ask: {left}"
