"""Provides what the bench says about its machine: CPU, memory, versions, devices, and how busy
others kept it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


class CpuWitness:
    """How much of the machine other programs used during a measurement (this bench's process tree
    excluded).

    The bench often shares its machine; a row measured while something else ran is slower for that
    reason alone, so every row reports the share of all CPUs that was busy outside this bench."""

    def __init__(self) -> None:
        self.busy, self.ours, self.started = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float]:
        import psutil

        times = psutil.cpu_times()
        busy = sum(
            getattr(times, name, 0.0)
            for name in ("user", "nice", "system", "irq", "softirq", "steal")
        )
        me = psutil.Process()
        own = me.cpu_times()
        ours = own.user + own.system + own.children_user + own.children_system
        for child in me.children(recursive=True):
            try:
                times_of_child = child.cpu_times()
            except psutil.Error:
                continue
            ours += times_of_child.user + times_of_child.system
        return busy, ours, time.monotonic()

    def others(self) -> float:
        """Share (0..1) of all CPUs busy outside this process tree since construction."""
        busy, ours, now = self._read()
        capacity = (now - self.started) * len(os.sched_getaffinity(0))
        return (
            max(0.0, min(1.0, ((busy - self.busy) - (ours - self.ours)) / capacity))
            if capacity > 0
            else 0.0
        )


def machine_info() -> dict[str, Any]:
    """CPU, cores, memory, OS and package versions; OpenVINO's devices from a child process."""
    import platform
    from importlib import metadata

    import psutil

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "logical_cpus": os.cpu_count(),
        "usable_cpus": sorted(os.sched_getaffinity(0)),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next(
            (
                line.split(":", 1)[1].strip()
                for line in cpuinfo.splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        flags = next(
            (
                line.split(":", 1)[1].split()
                for line in cpuinfo.splitlines()
                if line.startswith("flags")
            ),
            [],
        )
        info["cpu_flags"] = [
            f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags
        ]
    except OSError:
        info["cpu"] = platform.processor()
    versions: dict[str, str | None] = {}
    for package in (
        "fleettui",
        "openvino",
        "openvino-genai",
        "openvino-tokenizers",
        "pyzmq",
        "numpy",
    ):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    info["versions"] = versions
    probe = subprocess.run(
        [sys.executable, "-m", "remote_worker.mono", "--probe"], capture_output=True, text=True
    )
    info["openvino_devices"] = (
        json.loads(probe.stdout)["devices"] if probe.returncode == 0 else ["CPU"]
    )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent,
    )
    info["git_commit"] = commit.stdout.strip() or None
    return info
