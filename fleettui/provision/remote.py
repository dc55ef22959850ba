"""The remote-command layer: how to start the host's Python through its login shell, and run one
operation.

Every remote action is an operation of ``remote_ops.py`` run by the host's own interpreter: the
command line is just ``PYTHON -`` and the program, with its arguments as Python literals, goes over
stdin. A shell class therefore only knows how to name the interpreter: ``PosixShell`` (sh, bash,
dash) is used and tested; ``PowerShell`` (Windows OpenSSH with PowerShell as its DefaultShell)
builds ``& 'python.exe' -``.

What a Windows host still needs beyond this class (remote_ops already handles venv layout, memory,
detached creation flags and ``win_amd64`` wheels):
- SFTP paths: Windows OpenSSH names ``C:/Users/x`` as ``/C:/Users/x``; map preflight's workdir for
  SFTP.
- Detach: OpenSSH puts session processes in a job object killed on disconnect;
  CREATE_BREAKAWAY_FROM_JOB is used, and where the job forbids breakaway, start through ``schtasks``
  or WMI ``Win32_Process.Create``.
- Stop and pid reuse: no SIGTERM; ask the worker's control socket to shut down, then
  TerminateProcess; the start-time token needs psutil, so run status/stop with the venv's Python
  there.
- Config secrecy: NTFS ignores mode 0600; restrict the config with ``icacls /inheritance:r /grant:r
  USER:F``.
- Firewall: inbound stage ports need a ``New-NetFirewallRule`` (admin); preflight should test and
  report it."""

from __future__ import annotations

import json
import logging
import shlex
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Protocol

from fleettui.errors import ProvisionError

logger = logging.getLogger(__name__)

OPS_SOURCE_PATH = Path(__file__).with_name("remote_ops.py")
MARKER = "FLEETTUI-RESULT "


class RemoteShell(ABC):
    """Builds command lines for one family of remote shells."""

    name: str

    @abstractmethod
    def quote(self, text: str) -> str:
        """One literal argument."""

    @abstractmethod
    def program(self, path: str) -> str:
        """An executable path as the first word of a command (``~/`` expanded by the shell)."""

    def python_operation(
        self, python: str, operation: str, payload: dict[str, Any]
    ) -> tuple[str, str]:
        """(command line, stdin) that run one operation of ``remote_ops.py``: the program and its
        arguments travel on stdin as Python source, so only the interpreter's path meets the
        shell."""
        call = f"\nsys.exit(main(['-', {operation!r}, {json.dumps(payload)!r}]))\n"
        return f"{self.program(python)} -", ops_source() + call


class PosixShell(RemoteShell):
    """sh-compatible shells (Linux, macOS, WSL)."""

    name = "posix"

    def quote(self, text: str) -> str:
        return shlex.quote(text)

    def program(self, path: str) -> str:
        if path.startswith("~/"):
            return '"$HOME"/' + shlex.quote(path[2:])
        return shlex.quote(path)


class PowerShell(RemoteShell):
    """Windows OpenSSH with PowerShell as the default shell (command building only; see the
    module notes)."""

    name = "powershell"

    def quote(self, text: str) -> str:
        return "'" + text.replace("'", "''") + "'"

    def program(self, path: str) -> str:
        if path.startswith("~/"):
            return "& (Join-Path $HOME " + self.quote(path[2:]) + ")"
        return "& " + self.quote(path)


class _Runner(Protocol):
    async def run(self, command: str, *, input: str, check: bool) -> Any: ...  # noqa: A002


_ops_source: str | None = None


def ops_source() -> str:
    """The text of remote_ops.py, sent as the program on stdin."""
    global _ops_source
    if _ops_source is None:
        _ops_source = OPS_SOURCE_PATH.read_text(encoding="utf-8")
    return _ops_source


async def run_operation(
    connection: _Runner,
    shell: RemoteShell,
    python: str,
    operation: str,
    payload: dict[str, Any],
    *,
    host: str,
    step: str,
) -> dict[str, Any]:
    """Run one remote operation; its JSON answer, or ProvisionError naming host and step."""
    command, program = shell.python_operation(python, operation, payload)
    logger.debug("%s: %s (%s)", host, command, operation)
    result = await connection.run(command, input=program, check=False)
    stdout = (
        result.stdout
        if isinstance(result.stdout, str)
        else (result.stdout or b"").decode("utf-8", "replace")
    )
    stderr = (
        result.stderr
        if isinstance(result.stderr, str)
        else (result.stderr or b"").decode("utf-8", "replace")
    )
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARKER):
            answer = json.loads(line[len(MARKER) :])
            if isinstance(answer, dict) and "error" in answer:
                raise ProvisionError(host, step, str(answer["error"]))
            return dict(answer)
    detail = (stderr.strip() or stdout.strip() or f"exit status {result.exit_status}").splitlines()
    if result.exit_status == 127 or any("not found" in line for line in detail[-2:]):
        raise ProvisionError(host, step, f"cannot run {python!r} on the host: {detail[-1]}")
    raise ProvisionError(host, step, f"{operation} failed: {' | '.join(detail[-3:])}")
