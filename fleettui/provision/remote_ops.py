"""Operations run by a host's own Python (sent over SSH stdin): preflight, hashes, seal, install,
launch, stop, status.

Stdlib only and Python >= 3.10, POSIX and Windows. The operator runs ``python -`` on the host and
sends this file on stdin followed by one line ``sys.exit(main(["-", OPERATION, JSON]))``, so no
argument crosses the remote shell (sh, PowerShell, cmd) and nothing needs quoting there but the
interpreter's path. The answer is one ``FLEETTUI-RESULT {json}`` line on stdout. It is never
imported by the worker."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MARKER = "FLEETTUI-RESULT "
WINDOWS = os.name == "nt"
WINDOWS_ID = r"SOFTWARE\Microsoft\Cryptography"  # its value MachineGuid names the installation


def venv_python(venv: str) -> str:
    return str(Path(venv) / ("Scripts/python.exe" if WINDOWS else "bin/python"))


def _memory() -> tuple[int, int]:
    """(total, available) bytes of RAM, 0 when unknown."""
    try:
        import psutil  # type: ignore[import-not-found]

        memory = psutil.virtual_memory()
        return int(memory.total), int(memory.available)
    except ImportError:
        pass
    if Path("/proc/meminfo").exists():
        fields = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, value = line.partition(":")
            fields[name] = int(value.split()[0]) * 1024
        return fields.get("MemTotal", 0), fields.get("MemAvailable", fields.get("MemFree", 0))
    if WINDOWS:
        import ctypes

        class Status(ctypes.Structure):
            _fields_ = [("length", ctypes.c_ulong), ("load", ctypes.c_ulong)] + [
                (name, ctypes.c_ulonglong)
                for name in (
                    "total",
                    "available",
                    "page_total",
                    "page_free",
                    "virtual_total",
                    "virtual_free",
                    "x",
                )
            ]

        status = Status()
        status.length = ctypes.sizeof(Status)
        ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status))  # type: ignore[attr-defined]
        return int(status.total), int(status.available)
    return 0, 0


def _cpu_model() -> str:
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def _machine_id() -> str | None:
    """The OS's stable identifier of this installation (systemd / D-Bus machine-id, Windows
    MachineGuid)."""
    if sys.platform == "win32":
        import winreg

        with (
            contextlib.suppress(OSError),
            winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE, WINDOWS_ID) as key,
        ):
            return str(winreg.QueryValueEx(key, "MachineGuid")[0])
        return None
    for name in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        with contextlib.suppress(OSError):
            if found := Path(name).read_text(errors="replace").strip():
                return found
    return None


def _os_name() -> str:
    release = Path("/etc/os-release")
    if release.exists():
        for line in release.read_text(errors="replace").splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.partition("=")[2].strip().strip('"')
    return platform.platform()


def preflight(args: dict[str, Any]) -> dict[str, Any]:
    workdir = Path(os.path.expanduser(args["workdir"])).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    total, available = _memory()
    try:
        import ensurepip  # noqa: F401

        has_ensurepip = True
    except ImportError:
        has_ensurepip = False
    installed = None
    if args.get("venv"):
        venv = os.path.expanduser(args["venv"])
        marker = Path(venv) / "fleettui-wheelhouse.txt"
        if marker.is_file() and Path(venv_python(venv)).exists():
            installed = marker.read_text().strip()
    return {
        "system": platform.system(),
        "os_name": os.name,
        "os": _os_name(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count() or 0,
        "machine_id": _machine_id(),
        "python": list(sys.version_info[:3]),
        "python_executable": sys.executable,
        "libc": list(platform.libc_ver()),
        "workdir": workdir.as_posix(),
        "disk_free": shutil.disk_usage(workdir).free,
        "memory_total": total,
        "memory_available": available,
        "ensurepip": has_ensurepip,
        "installed": installed,
    }


def _path(name: str) -> Path:
    return Path(os.path.expanduser(name))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp_entries(stamp: dict[str, Any] | None) -> dict[str, Any]:
    """The entries of a stage's stamp that are still of the worker's format ({} when absent or
    unreadable).

    The stamp is the worker's own (`remote_worker.manifest.verify_files`, whose format a test holds
    this copy to): for each file of the stage the SHA-256 it matched, then size, mtime, ctime, inode
    and device at that check. Any write changes the ctime, which cannot be set back, so an unchanged
    record spares a read of the file."""
    if not stamp:
        return {}
    try:
        data = json.loads(Path(stamp["file"]).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    files = (
        data.get("files")
        if isinstance(data, dict) and data.get("format") == stamp["format"]
        else None
    )
    return files if isinstance(files, dict) else {}


def _write_stamp(stamp: dict[str, Any], files: dict[str, Any]) -> None:
    """Replace the stamp whole (best effort: a stamp that cannot be written only costs hashes
    later)."""
    path = Path(stamp["file"])
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(
            json.dumps({"format": stamp["format"], "files": files}), encoding="utf-8"
        )
        os.replace(temporary, path)
    except OSError:
        temporary.unlink(missing_ok=True)


def _stage_name(name: str, stamp: dict[str, Any] | None) -> str | None:
    """NAME relative to the stamped folder when it is one of the stage's files, else None."""
    if not stamp:
        return None
    root = stamp["root"].rstrip("/") + "/"
    relative = name[len(root) :] if name.startswith(root) else None
    return relative if relative in stamp["expected"] else None


def _stamp_record(info: os.stat_result, sha: str) -> list[Any]:
    return [sha, info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino, info.st_dev]


def hashes(args: dict[str, Any]) -> dict[str, Any]:
    """Size and SHA-256 of each path that exists (None for the others).

    With a ``stamp`` ({file, root, format, expected: {relative name: SHA-256}}), a stage file whose
    stamp record still matches is not read, and the stamp is rewritten with the stage files found
    intact; with ``recheck`` in it, every file is read (bit rot leaves a file's metadata alone)."""
    stamp = args.get("stamp")
    known = {} if stamp and stamp.get("recheck") else _stamp_entries(stamp)
    intact: dict[str, Any] = {}
    result: dict[str, Any] = {}
    for name in args["paths"]:
        path = _path(name)
        if not path.is_file():
            result[name] = None
            continue
        info = path.stat()  # before the hash: a write during it changes the ctime the record keeps
        relative = _stage_name(name, stamp)
        record = known.get(relative) if relative else None
        sha = (
            record[0]
            if isinstance(record, list) and record[1:] == _stamp_record(info, "")[1:]
            else _sha256(path)
        )
        result[name] = [info.st_size, sha]
        if relative and stamp and sha == stamp["expected"][relative]:
            intact[relative] = _stamp_record(info, sha)
    if stamp and intact != known:
        _write_stamp(stamp, intact)
    return {"files": result}


def seal(args: dict[str, Any]) -> dict[str, Any]:
    """Move each pushed ``name.part`` into place and check its SHA-256 there; a file that differs is
    removed.

    ``renamed``: {final path: expected SHA-256}; with a ``stamp`` (as for `hashes`) the stage files
    found intact are added to the stamp, so neither the next deploy nor the worker's start reads
    them again."""
    stamp = args.get("stamp")
    known = _stamp_entries(stamp)
    mismatched = []
    for name, expected in args["renamed"].items():
        path = _path(name)
        os.replace(_path(name + ".part"), path)
        info = path.stat()
        if _sha256(path) != expected:
            path.unlink()
            mismatched.append(name)
            continue
        relative = _stage_name(name, stamp)
        if relative:
            known[relative] = _stamp_record(info, expected)
    if stamp:
        _write_stamp(
            stamp, {name: record for name, record in known.items() if name in stamp["expected"]}
        )
    return {"mismatched": mismatched}


def _run(command: list[str]) -> tuple[int, str]:
    process = subprocess.run(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False
    )
    return process.returncode, process.stdout


def install(args: dict[str, Any]) -> dict[str, Any]:
    """Create the venv if needed and install the worker from the pushed wheelhouse (no index)."""
    venv, wheelhouse, digest = args["venv"], args["wheelhouse"], args["digest"]
    python = venv_python(venv)
    marker = Path(venv) / "fleettui-wheelhouse.txt"
    if Path(python).exists() and marker.exists() and marker.read_text().strip() == digest:
        return {"installed": False, "python": python}
    if not Path(python).exists():
        code, output = _run([sys.executable, "-m", "venv", venv])
        if code != 0:  # e.g. Debian without python3-venv: no ensurepip
            shutil.rmtree(venv, ignore_errors=True)
            code, output = _run([sys.executable, "-m", "venv", "--without-pip", venv])
            if code != 0:
                return {
                    "error": f"cannot create a venv with {sys.executable}: {output.strip()[-400:]}"
                }
    if _run([python, "-m", "pip", "--version"])[0] != 0:
        wheels = sorted(Path(wheelhouse).glob("pip-*.whl"))
        if not wheels:
            return {"error": "the venv has no pip and the wheelhouse has no pip wheel"}
        pip = str(wheels[-1])
        code, output = _run(
            [python, f"{pip}/pip", "install", "--no-index", "--no-warn-script-location", pip]
        )
        if code != 0:
            return {"error": f"cannot bootstrap pip: {output.strip()[-400:]}"}
    command = [python, "-m", "pip", "install", "--no-index", "--find-links", wheelhouse]
    command += [
        "--disable-pip-version-check",
        "--no-input",
        "--no-warn-script-location",
        args["requirement"],
    ]
    code, output = _run(command)
    if code != 0:
        return {"error": "pip install failed: " + " | ".join(output.strip().splitlines()[-6:])}
    marker.write_text(digest)
    return {"installed": True, "python": python}


def devices(args: dict[str, Any]) -> dict[str, Any]:
    """OpenVINO's devices as seen by the worker's interpreter (run with the venv's Python)."""
    sys.modules.setdefault("openvino_telemetry", None)  # type: ignore[arg-type]  # as remote_worker does
    try:
        import openvino  # type: ignore[import-not-found]
    except ImportError as error:
        return {"error": f"openvino is not importable: {error}"}
    core = openvino.Core()
    names = {}
    for device in core.available_devices:
        try:
            names[device] = str(core.get_property(device, "FULL_DEVICE_NAME"))
        except Exception:  # a device that cannot describe itself is still listed
            names[device] = device
    return {
        "devices": list(core.available_devices),
        "names": names,
        "openvino": openvino.__version__,
    }


def _start_token(pid: int) -> str | None:
    """Something that changes when a pid is reused: the process start time."""
    try:
        import psutil

        return f"{psutil.Process(pid).create_time():.2f}"
    except ImportError:
        pass
    except Exception:
        return None
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    if WINDOWS:
        try:
            import psutil

            return bool(psutil.pid_exists(pid)) and psutil.Process(pid).status() != "zombie"
        except ImportError:
            output = _run(["tasklist", "/FI", f"PID eq {pid}", "/NH"])[1]
            return str(pid) in output
        except Exception:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists():
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False
    return True


def launch(args: dict[str, Any]) -> dict[str, Any]:
    """Start argv detached (own session, output to the log), record pid + start time in the pid
    file."""
    log = Path(args["log"])
    log.parent.mkdir(parents=True, exist_ok=True)
    environment = dict(os.environ)
    environment.update(args.get("env", {}))
    options: dict[str, Any] = {}
    if WINDOWS:  # survive the SSH session: no console, own group, outside the session's job object
        options["creationflags"] = 0x00000008 | 0x00000200 | 0x01000000
    else:
        options["start_new_session"] = True
        cores = args.get("cores") or []
        if cores and hasattr(os, "sched_setaffinity"):
            options["preexec_fn"] = lambda: os.sched_setaffinity(0, cores)
    with open(log, "ab") as output:
        # the log is appended to: an early exit reports only what this run wrote
        written = output.tell()
        process = subprocess.Popen(
            args["argv"],
            cwd=args["cwd"],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            env=environment,
            close_fds=True,
            **options,
        )
    record = {
        "pid": process.pid,
        "start": _start_token(process.pid),
        "deployment": args["deployment"],
        "argv": args["argv"],
        "log": str(log),
        "started": time.time(),
    }
    pidfile = Path(args["pidfile"])
    temporary = pidfile.with_suffix(".tmp")
    temporary.write_text(json.dumps(record))
    os.replace(temporary, pidfile)
    time.sleep(float(args.get("settle", 0.3)))
    code = process.poll()
    if code is not None:
        return {"pid": process.pid, "exited": code, "log_tail": _tail(log, 2000, written)}
    return {"pid": process.pid, "start": record["start"], "log_start": written}


def _record(pidfile: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(pidfile.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("pid"), int) else None


def _ours(record: dict[str, Any], deployment: str | None) -> str | None:
    """Why the recorded process must be left alone, or None when it is the one we started."""
    if deployment is not None and record.get("deployment") != deployment:
        return f"started by another deployment ({record.get('deployment')})"
    if not _alive(record["pid"]):
        return "already exited"
    if record.get("start") is not None and _start_token(record["pid"]) != record["start"]:
        return "pid reused by another process"
    return None


def status(args: dict[str, Any]) -> dict[str, Any]:
    result = {}
    for name in args["pidfiles"]:
        record = _record(_path(name))
        reason = "no pid file" if record is None else _ours(record, args.get("deployment"))
        result[name] = {"pid": record and record["pid"], "alive": reason is None, "reason": reason}
    return {"status": result}


def _signal(pid: int, number: int) -> None:
    """Signal the process and, when it leads its own process group (as launched), its children
    too."""
    try:
        if not WINDOWS and os.getpgid(pid) == pid:
            os.killpg(pid, number)
        else:
            os.kill(pid, number)
    except ProcessLookupError:
        pass


def stop(args: dict[str, Any]) -> dict[str, Any]:
    """Terminate exactly the processes recorded in the pid files (TERM, then KILL after the
    timeout)."""
    timeout = float(args.get("timeout", 10.0))
    result = {}
    for name in args["pidfiles"]:
        pidfile = _path(name)
        record = _record(pidfile)
        if record is None:
            result[name] = {"pid": None, "action": "none", "detail": "no pid file"}
            continue
        pid = record["pid"]
        reason = _ours(record, args.get("deployment"))
        if reason is not None:
            if reason != f"started by another deployment ({record.get('deployment')})":
                pidfile.unlink(missing_ok=True)
            result[name] = {"pid": pid, "action": "none", "detail": reason}
            continue
        _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        action = "terminated"
        if _alive(pid):
            _signal(pid, signal.SIGTERM if WINDOWS else signal.SIGKILL)
            action = "killed"
            deadline = time.monotonic() + 5.0
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        pidfile.unlink(missing_ok=True)
        result[name] = {
            "pid": pid,
            "action": action,
            "detail": "gone" if not _alive(pid) else "still running",
        }
    return {"stopped": result}


def _tail(path: Path, size: int, start: int = 0) -> str:
    """The last `size` bytes of the file, none before offset `start`."""
    try:
        with open(path, "rb") as stream:
            stream.seek(max(start, path.stat().st_size - size))
            return stream.read().decode("utf-8", "replace")
    except OSError:
        return ""


def tail(args: dict[str, Any]) -> dict[str, Any]:
    return {
        "text": _tail(_path(args["path"]), int(args.get("bytes", 65536)), int(args.get("start", 0)))
    }


def prune(args: dict[str, Any]) -> dict[str, Any]:
    """Remove the subfolders of `folder` not named in `keep` (old shard folders); their names and
    bytes."""
    folder = _path(args["folder"])
    keep = set(args.get("keep", []))
    removed, freed = [], 0
    if folder.is_dir():
        for child in sorted(folder.iterdir()):
            if child.name in keep or not child.is_dir() or child.is_symlink():
                continue
            freed += sum(item.stat().st_size for item in child.rglob("*") if item.is_file())
            shutil.rmtree(child)
            removed.append(child.name)
    return {"removed": removed, "bytes": freed, "kept": sorted(keep)}


OPERATIONS = {
    "prune": prune,
    "preflight": preflight,
    "hashes": hashes,
    "seal": seal,
    "install": install,
    "devices": devices,
    "launch": launch,
    "status": status,
    "stop": stop,
    "tail": tail,
}


def main(argv: list[str]) -> int:
    operation, payload = argv[1], json.loads(argv[2]) if len(argv) > 2 else {}
    try:
        result = OPERATIONS[operation](payload)
    except Exception as error:  # reported to the operator as one line
        result = {"error": f"{type(error).__name__}: {error}"}
    sys.stdout.write(MARKER + json.dumps(result) + "\n")
    return 0


if (
    __name__ == "__main__" and len(sys.argv) > 2
):  # also usable as `python remote_ops.py OPERATION JSON`
    sys.exit(main(sys.argv))
