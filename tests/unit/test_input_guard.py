"""Real `fleettui` processes: undecodable text is refused in one line before anything starts, and an
unexpected exception is one line, a traceback in the log file, its processes stopped and exit 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
FLEETTUI = ROOT / ".venv" / "bin" / "fleettui"
LATIN1 = b"caf\xe9 \xff\xfe"


def environment(home: Path) -> dict[str, str]:
    """Fresh cache and state folders: whatever a command compiles or starts leaves a file there."""
    return {
        **os.environ,
        "XDG_CACHE_HOME": str(home / "cache"),
        "XDG_STATE_HOME": str(home / "state"),
    }


def files_under(folder: Path) -> list[Path]:
    return [path for path in folder.rglob("*") if path.is_file()] if folder.exists() else []


def test_latin1_on_stdin_is_one_line_exit_2_and_nothing_starts(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(FLEETTUI), "ask", "fleets/local.toml", "-"],
        input=LATIN1,
        capture_output=True,
        cwd=ROOT,
        env=environment(tmp_path),
        timeout=60,
    )
    lines = result.stderr.decode().splitlines()
    assert result.returncode == 2, result.stderr
    assert lines == [
        "fleettui: stdin: not valid UTF-8: byte 0xe9 at byte offset 3 (invalid continuation byte); "
        "give --encoding if the text is in another encoding (e.g. latin-1)"
    ]
    assert result.stdout == b""
    # no shard was compiled, no worker wrote its log, no deployment was recorded
    assert files_under(tmp_path / "cache") == [] and files_under(tmp_path / "state") == []


def test_undecodable_argv_bytes_name_the_flag_and_an_unknown_encoding_is_refused(
    tmp_path: Path,
) -> None:
    system = subprocess.run(
        [
            FLEETTUI.as_posix().encode(),
            b"ask",
            b"fleets/local.toml",
            b"hi",
            b"--system",
            b"be \xe9brief",
        ],
        capture_output=True,
        cwd=ROOT,
        env=environment(tmp_path),
        timeout=60,
    )
    assert system.returncode == 2
    assert system.stderr.decode().splitlines() == [
        "fleettui: --system: not valid UTF-8: byte 0xe9 at byte offset 3"
    ]
    codec = subprocess.run(
        [str(FLEETTUI), "ask", "fleets/local.toml", "-", "--encoding", "klingon"],
        input=b"hi",
        capture_output=True,
        cwd=ROOT,
        env=environment(tmp_path),
        timeout=60,
    )
    assert codec.returncode == 2
    assert codec.stderr.decode().splitlines() == [
        "fleettui: --encoding: unknown encoding 'klingon' (e.g. utf-8, latin-1, cp1252)"
    ]
    assert files_under(tmp_path / "cache") == [] and files_under(tmp_path / "state") == []


# A command with a bug: it starts a process of its own, then fails with an exception nobody
# expected.
BUGGY = """
import subprocess, sys
import fleettui.commands.plan as plan
def run(args):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.pid, flush=True)
    raise ZeroDivisionError("a bug in a command")
plan.run = run
from fleettui.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_unexpected_exception_is_one_line_with_the_log_file_stops_its_processes_and_exits_1(
    tmp_path: Path,
) -> None:
    env = environment(tmp_path)
    script = tmp_path / "buggy.py"
    script.write_text(BUGGY)
    result = subprocess.run(
        [sys.executable, str(script), "plan", "fleets/local.toml"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    child = int(result.stdout.split()[0])
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert result.returncode == 1
    log = tmp_path / "state" / "fleettui" / "log" / "errors.log"
    assert result.stderr.splitlines() == [
        "fleettui: internal error: ZeroDivisionError: a bug in a command; stopped 1 process(es) it "
        "had started "
        f"(traceback in {log}; --debug shows it)"
    ]
    kept = log.read_text()
    assert (
        "fleettui plan fleets/local.toml" in kept
        and 'raise ZeroDivisionError("a bug in a command")' in kept
    )
    assert "Traceback (most recent call last)" in kept
    debug = subprocess.run(
        [sys.executable, str(script), "plan", "fleets/local.toml", "--debug"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert debug.returncode == 1
    assert debug.stderr.startswith("Traceback (most recent call last)")
    assert debug.stderr.splitlines()[-1].startswith(
        "fleettui: internal error: ZeroDivisionError: a bug in a command"
    )
