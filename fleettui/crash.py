"""Provides the top-level guard's report of an unexpected exception: one line, the traceback in a
log file."""

from __future__ import annotations

import contextlib
import datetime
import sys
import traceback

from fleettui.errors import one_line

CRASH_LOG = "errors.log"
EXIT_BUG = 1


def stop_children() -> list[int]:
    """Terminate the processes this one started and still runs (local workers, compile helpers);
    their pids."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=10)
    for child in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(alive, timeout=5)
    return [child.pid for child in children]


def report_crash(error: BaseException, argv: list[str], debug: bool) -> int:
    """Stop what the command started, keep the traceback (stderr with `debug`, else the log file),
    say one line, and return the exit code of a bug (1)."""
    details = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    stopped = stop_children()
    summary = (
        one_line(f"{type(error).__name__}: {error}".splitlines()[0])
        if str(error)
        else type(error).__name__
    )
    note = f"; stopped {len(stopped)} process(es) it had started" if stopped else ""
    if debug:
        print(details, end="", file=sys.stderr)
        print(f"fleettui: internal error: {summary}{note}", file=sys.stderr)
        return EXIT_BUG
    where = _keep(details, argv)
    print(
        f"fleettui: internal error: {summary}{note} (traceback in {where}; --debug shows it)",
        file=sys.stderr,
    )
    return EXIT_BUG


def _keep(details: str, argv: list[str]) -> str:
    """Append the traceback to the log folder's errors.log; where it went (or why it could not)."""
    from fleettui.config.paths import log_dir

    try:
        path = log_dir() / CRASH_LOG
        stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        with open(path, "a", encoding="utf-8", errors="backslashreplace") as log:
            log.write(f"--- {stamp} fleettui {' '.join(argv)}\n{details}")
        return str(path)
    except Exception as failure:  # the report itself must not fail: say where it could not go
        return f"nowhere ({type(failure).__name__}: {failure})"
