"""Provides the tests' view of stage worker processes: those below a process (this test run, a
controller)."""

from __future__ import annotations

import psutil


def worker_children(process: psutil.Process | None = None) -> list[psutil.Process]:
    """The `remote_worker` processes below `process` (default: this one); none when it is gone."""
    try:
        children = (process or psutil.Process()).children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for child in children:
        try:
            if "remote_worker" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found
