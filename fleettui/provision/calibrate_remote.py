"""Times compiled stages on an SSH host: the worker installed as a deploy installs it, the stages
pushed to the host's content-addressed shard folder, and `python -m remote_worker.profile` run there
by the worker's Python.

The timing runs in the foreground of the SSH channel with `--until-stdin-closes`: a cancelled
calibration or a dropped connection closes its standard input and the remote process ends at once,
so nothing is left computing on the host. The pushed calibration split stays in the host's shard
folder (a later calibration of the same split pushes nothing; `deploy --prune` removes it with the
other unused folders)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import asyncssh

from fleettui.config.fleet import Host
from fleettui.errors import PlanError, ProvisionError
from fleettui.provision.deploy import VENV_BYTES, DeployOptions, EventHandler, HostSession
from fleettui.provision.stage_files import ShardAssignment, shard_bytes

TIMEOUT = 1800.0  # a calibration of a big model's stages on a slow PC still ends well within this


def calibration_push(shard_dir: Path, stages: Sequence[int]) -> ShardAssignment:
    """The files a host needs to time STAGES of SHARD_DIR: the manifest and those stages'
    folders."""
    return ShardAssignment(
        shard_dir, stages[0], ("manifest.json", *(f"stage_{index}" for index in stages))
    )


async def time_remote(
    host: Host,
    shard_dir: Path,
    stages: Sequence[int],
    arguments: Sequence[str],
    options: DeployOptions | None = None,
    on_event: EventHandler | None = None,
    timeout: float = TIMEOUT,
) -> dict[str, Any]:
    """STAGES of SHARD_DIR timed on HOST by `remote_worker.profile` with ARGUMENTS (its options
    other than `--shard` and `--stages`): {"stages": the profile's per-stage records, "identity":
    which PC answered (`Preflight.identity`)}. PlanError naming the host and step."""
    options = options or DeployOptions()
    session = HostSession(host, on_event)
    step = "connect"
    try:
        await session.open(options.connect_timeout)
        push = calibration_push(shard_dir, stages)
        step = "preflight"
        found = await session.run_preflight(
            needed_disk=shard_bytes(push) + (VENV_BYTES if options.install else 0)
        )
        python = host.python
        if options.install:
            step = "install"
            await session.install_worker(options)
            python = session.venv_python()
        step = "shard"
        remote, _ = await session.push_shard(push)
        step = "calibrate"
        command = [
            "-m",
            "remote_worker.profile",
            "--shard",
            remote,
            "--stages",
            ",".join(map(str, stages)),
            *arguments,
            "--until-stdin-closes",
        ]
        session.emit(
            "calibrate", f"timing stages {', '.join(map(str, stages))} of {shard_dir.name}"
        )
        line = await _run_profile(session, python, command, timeout)
        return {"stages": list(json.loads(line)["stages"]), "identity": found.identity()}
    except ProvisionError as error:
        raise PlanError(f"profile of {host.name}: {error.step}: {error.reason}") from None
    except (OSError, asyncssh.Error, ValueError, KeyError) as error:
        reason = getattr(error, "reason", None) or str(error) or type(error).__name__
        raise PlanError(f"profile of {host.name}: {step}: {reason}") from None
    finally:
        await session.close()


async def _run_profile(
    session: HostSession, python: str, command: list[str], timeout: float
) -> str:
    """The last line the remote profile printed; ProvisionError with its last stderr line when it
    fails. Its standard input stays open while it runs and closes when this returns or is
    cancelled."""
    shell = session.shell
    line = " ".join([shell.program(python), *(shell.quote(part) for part in command)])
    process = await session.connection.create_process(line)
    try:
        # stdin stays open (no input is sent)
        completed = await process.wait(check=False, timeout=timeout)
    except asyncssh.TimeoutError:
        raise ProvisionError(
            session.host.name, "calibrate", f"no result within {timeout:.0f} s"
        ) from None
    finally:
        # closes its stdin: a remote profile still running stops (--until-stdin-closes)
        process.close()
    stdout, stderr = str(completed.stdout or ""), str(completed.stderr or "")
    if completed.exit_status != 0 or not stdout.strip():
        status = (
            completed.exit_signal[0]
            if completed.exit_signal
            else f"exit status {completed.exit_status}"
        )
        lines = [line.strip() for line in stderr.splitlines() if line.strip()]
        profile = [line for line in lines if line.startswith("profile: ")]  # its own one-line error
        raise ProvisionError(
            session.host.name, "calibrate", (profile or lines or [status])[-1][:300]
        )
    return str(stdout.strip().splitlines()[-1])
