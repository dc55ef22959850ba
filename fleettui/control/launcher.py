"""Provides the local launcher: starts stage workers as processes on this machine and stops them cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fleettui.control.deployment import Placement, write_config
from fleettui.runtime.transport import ClientKeys, LinkError, control_request, wait_until_ready

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A worker that did not come up; the message names it and quotes its log."""


@dataclass
class LocalWorker:
    placement: Placement
    process: subprocess.Popen[bytes]
    log_path: Path
    config_path: Path
    pid_path: Path

    def log_tail(self, lines: int = 8) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])


@dataclass
class LocalLauncher:
    """Starts `python -m remote_worker` per placement, each in its own process group."""

    run_dir: Path
    python: str = sys.executable
    workers: dict[str, LocalWorker] = field(default_factory=dict)

    def start(self, placement: Placement) -> LocalWorker:
        config_path = write_config(placement, self.run_dir)
        log_path = self.run_dir / f"{placement.config.name}.log"
        with open(log_path, "ab") as log_file:
            process = subprocess.Popen(
                [self.python, "-m", "remote_worker", "--config", str(config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=_worker_environment(),
            )
        worker = LocalWorker(
            placement, process, log_path, config_path, _record_pid(placement, process, log_path)
        )
        self.workers[placement.config.name] = worker
        log.info("started %s (pid %d), log %s", placement.config.name, process.pid, log_path)
        return worker

    async def wait_ready(self, worker: LocalWorker, keys: ClientKeys | None, timeout: float = 600.0) -> dict:
        """Handshake with the worker's control socket; fails fast if the process exits."""
        name = worker.placement.config.name

        def exited() -> str | None:
            if worker.process.poll() is None:
                return None
            return f"{name} exited with code {worker.process.returncode}: {worker.log_tail()}"

        try:
            return await wait_until_ready(
                worker.placement.control_url, keys, worker.placement.server_key, timeout, exited
            )
        except LinkError as error:
            tail = "" if worker.process.poll() is not None else worker.log_tail()
            raise LaunchError(f"{error} {tail}".strip()) from None

    async def stop(self, keys: ClientKeys | None, grace: float = 5.0) -> list[str]:
        """Ask every worker to shut down, then terminate what is left; returns one line per worker."""
        report = []
        for name, worker in list(self.workers.items()):
            if worker.process.poll() is None:
                await control_request(
                    worker.placement.control_url,
                    {"op": "shutdown"},
                    keys,
                    worker.placement.server_key,
                    timeout=1.0,
                )
            how = "exited"
            try:
                await asyncio.to_thread(worker.process.wait, grace)
            except subprocess.TimeoutExpired:
                how = "terminated"
                _signal_group(worker.process, signal.SIGTERM)
                try:
                    await asyncio.to_thread(worker.process.wait, grace)
                except subprocess.TimeoutExpired:
                    how = "killed"
                    _signal_group(worker.process, signal.SIGKILL)
                    await asyncio.to_thread(worker.process.wait)
            _signal_group(worker.process, signal.SIGKILL)  # stray children of the group, if any
            report.append(f"{name}: pid {worker.process.pid} {how}")
            worker.pid_path.unlink(missing_ok=True)
            del self.workers[name]
        return report

    def detach(self) -> list[str]:
        """Forget the workers without stopping them; their pid files stay for `fleettui --stop`."""
        report = [
            f"{name}: left running as pid {w.process.pid} ({w.pid_path})" for name, w in self.workers.items()
        ]
        self.workers.clear()
        return report

    def kill_all(self) -> None:
        """Synchronous last resort (atexit, signal handlers)."""
        for worker in self.workers.values():
            _signal_group(worker.process, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(5)
        self.workers.clear()


def pid_file(placement: Placement) -> Path:
    """Where a local worker's pid record lives: the same place `fleettui --deploy` / `--stop` use."""
    return Path(placement.host.workdir).expanduser() / "run" / f"{placement.config.name}.pid"


def _record_pid(placement: Placement, process: subprocess.Popen[bytes], log_path: Path) -> Path:
    """Pid, start time and deployment of a started worker, so exactly it can be stopped later."""
    import psutil

    path = pid_file(placement)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        start: str | None = f"{psutil.Process(process.pid).create_time():.2f}"
    except psutil.Error:
        start = None
    record = {
        "pid": process.pid,
        "start": start,
        "deployment": placement.config.deployment,
        "argv": [str(part) for part in process.args],  # type: ignore[union-attr]
        "log": str(log_path),
        "started": time.time(),
    }  # type: ignore[arg-type]
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(record))
    os.replace(temporary, path)
    return path


def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def _worker_environment() -> dict[str, str]:
    environment = dict(os.environ)
    environment.setdefault("PYTHONUNBUFFERED", "1")
    return environment
