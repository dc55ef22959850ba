"""The offline wheelhouse: a wheel of only ``remote_worker`` plus its dependencies for one target,
built once.

The operator's machine can reach the package registry; the PCs need not. For each target (Python
version, OS, CPU architecture, glibc) a folder of wheels is prepared with ``pip wheel`` (the worker,
from a generated pyproject that contains nothing but ``remote_worker``) and ``pip download``
(openvino, numpy, pyzmq, psutil and pip itself), cached under a key of the worker's sources, the
requirements and the target. Hosts install from it with ``pip install --no-index``."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fleettui.errors import ProvisionError
from fleettui.provision.events import Preflight

logger = logging.getLogger(__name__)

WORKER_DISTRIBUTION = "fleettui-remote-worker"
# None: exact pin
WORKER_DEPENDENCIES = {
    "openvino": None,
    "numpy": ">=1.26",
    "pyzmq": ">=26",
    "psutil": ">=5.9",
}


def default_cache() -> Path:
    """Where wheelhouses are cached: <user cache>/wheelhouse (XDG_CACHE_HOME/fleettui/wheelhouse
    on Linux)."""
    from fleettui.config import paths

    return paths.cache_dir() / "wheelhouse"


_locks: dict[str, asyncio.Lock] = {}


@dataclass(frozen=True)
class Target:
    """What a host's interpreter accepts: Python version, OS, machine and C library."""

    python: tuple[int, int]
    system: str  # Linux | Windows | Darwin
    machine: str  # x86_64 | AMD64 | aarch64 ...
    libc: tuple[str, str] = ("", "")

    @classmethod
    def from_preflight(cls, preflight: Preflight) -> Target:
        return cls(preflight.python[:2], preflight.system, preflight.machine, preflight.libc)

    @classmethod
    def here(cls) -> Target:
        import platform

        return cls(sys.version_info[:2], platform.system(), platform.machine(), platform.libc_ver())

    def platforms(self) -> list[str]:
        """pip ``--platform`` tags this target accepts (manylinux tags expanded down to 2.17)."""
        machine = self.machine.lower()
        if self.system == "Linux":
            machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
            tags = []
            if self.libc[0] == "glibc" and self.libc[1]:
                major, minor = (int(part) for part in self.libc[1].split(".")[:2])
                tags += [f"manylinux_{major}_{glibc}_{machine}" for glibc in range(minor, 16, -1)]
            return tags + [f"manylinux2014_{machine}", f"linux_{machine}"]
        if self.system == "Windows":
            return ["win_amd64" if machine in ("amd64", "x86_64") else f"win_{machine}"]
        raise ProvisionError(
            "wheelhouse", "target", f"no wheelhouse recipe for {self.system} {self.machine}"
        )

    def key(self) -> str:
        return f"cp{self.python[0]}{self.python[1]}-{self.platforms()[0]}"


@dataclass(frozen=True)
class Wheelhouse:
    """A ready folder of wheels; ``digest`` changes whenever any wheel does."""

    directory: Path
    digest: str
    requirement: str  # what to ``pip install --no-index`` on the host
    files: tuple[Path, ...]


def worker_source() -> Path:
    """The ``remote_worker`` package folder (found without importing it)."""
    spec = importlib.util.find_spec("remote_worker")
    if spec is None or not spec.submodule_search_locations:
        raise ProvisionError(
            "wheelhouse", "build", "the remote_worker package is not installed here"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _source_files(source: Path) -> list[Path]:
    return sorted(
        path
        for path in source.rglob("*")
        if path.is_file()
        and "__pycache__" not in path.parts
        and path.suffix not in (".pyc", ".pyo")
    )


def _tree_digest(source: Path) -> str:
    digest = hashlib.sha256()
    for path in _source_files(source):
        digest.update(
            path.relative_to(source).as_posix().encode() + b"\0" + path.read_bytes() + b"\0"
        )
    return digest.hexdigest()


def worker_requirements(target: Target) -> list[str]:
    """openvino pinned to the operator's version; the rest pinned too when the target runs our
    Python."""
    same_python = target.python == sys.version_info[:2]
    requirements = []
    for name, spec in WORKER_DEPENDENCIES.items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed and (spec is None or same_python):
            requirements.append(f"{name}=={installed}")
        else:
            requirements.append(name + (spec or ""))
    return requirements


_PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{name}"
version = "{version}"
description = "fleettui pipeline stage worker (remote_worker only)"
requires-python = ">=3.10"
dependencies = {dependencies}

[tool.setuptools.packages.find]
include = ["remote_worker*"]
"""


async def _pip(arguments: list[str], step: str) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pip",
        "--disable-pip-version-check",
        "--no-input",
        *arguments,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await process.communicate()
    if process.returncode != 0:
        lines = output.decode("utf-8", "replace").strip().splitlines()
        raise ProvisionError(
            "wheelhouse", step, " | ".join(lines[-4:]) or f"pip exited {process.returncode}"
        )


async def build_wheelhouse(
    target: Target,
    cache: Path | None = None,
    source: Path | None = None,
    requirements: list[str] | None = None,
    on_step: Callable[[str], None] | None = None,
) -> Wheelhouse:
    """The cached wheelhouse for ``target``, building it first when needed (concurrent callers share
    it).

    ``on_step`` hears what the build is doing ("building the worker wheel", "downloading ...").
    """
    say = on_step or (lambda text: None)
    cache = cache or default_cache()
    source = source or worker_source()
    requirements = worker_requirements(target) if requirements is None else requirements
    source_digest = _tree_digest(source)
    identity = json.dumps([source_digest, requirements, target.key(), target.platforms()]).encode()
    key = f"{target.key()}-{hashlib.sha256(identity).hexdigest()[:16]}"
    # one per event loop
    lock = _locks.setdefault(f"{id(asyncio.get_running_loop())}-{key}", asyncio.Lock())
    async with lock:
        directory = cache / key
        done = directory / "wheelhouse.json"
        if done.is_file():
            record = json.loads(done.read_text())
            files = tuple(directory / name for name in record["files"])
            if all(path.is_file() for path in files):
                return Wheelhouse(directory, record["digest"], record["requirement"], files)
        shutil.rmtree(directory, ignore_errors=True)
        building = cache / f".{key}.partial"
        shutil.rmtree(building, ignore_errors=True)
        building.mkdir(parents=True)
        _require_build_backend()
        version = f"{_fleettui_version()}+h{source_digest[:12]}"
        with tempfile.TemporaryDirectory(prefix="fleettui-worker-") as temporary:
            project = Path(temporary)
            shutil.copytree(
                source,
                project / "remote_worker",
                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
            )
            (project / "pyproject.toml").write_text(
                _PYPROJECT.format(
                    name=WORKER_DISTRIBUTION, version=version, dependencies=json.dumps(requirements)
                )
            )
            logger.info("building the %s wheel from %s", WORKER_DISTRIBUTION, source)
            say(f"building the {WORKER_DISTRIBUTION} wheel (1/2)")
            await _pip(
                [
                    "wheel",
                    "--no-deps",
                    "--no-build-isolation",
                    "--wheel-dir",
                    str(building),
                    str(project),
                ],
                "build",
            )
        platforms = [argument for tag in target.platforms() for argument in ("--platform", tag)]
        version_tag = f"{target.python[0]}{target.python[1]}"
        logger.info("downloading %s for %s", ", ".join(requirements), target.key())
        say(f"downloading {len(requirements) + 1} packages for {target.key()} (2/2)")
        await _pip(
            [
                "download",
                "--only-binary=:all:",
                "--dest",
                str(building),
                "--python-version",
                version_tag,
                "--implementation",
                "cp",
                *platforms,
                "pip",
                *requirements,
            ],
            "download",
        )
        names = sorted(path.name for path in building.iterdir() if path.suffix == ".whl")
        digest = hashlib.sha256()
        for name in names:
            digest.update(
                name.encode() + b"\0" + hashlib.sha256((building / name).read_bytes()).digest()
            )
        requirement = f"{WORKER_DISTRIBUTION}=={version}"
        (building / "wheelhouse.json").write_text(
            json.dumps(
                {
                    "digest": digest.hexdigest(),
                    "requirement": requirement,
                    "files": names,
                    "target": target.key(),
                }
            )
        )
        building.rename(directory)
        _prune(cache, target, keep=directory)
        return Wheelhouse(
            directory, digest.hexdigest(), requirement, tuple(directory / name for name in names)
        )


def _require_build_backend() -> None:
    """The worker wheel is built without isolation (offline-friendly): setuptools must be
    installed here."""
    if importlib.util.find_spec("setuptools") is None:
        raise ProvisionError(
            "wheelhouse",
            "build",
            f"building the worker wheel needs setuptools in {sys.executable}'s environment: "
            "pip install 'setuptools>=68' (a declared dependency of fleettui)",
        )


def _prune(cache: Path, target: Target, keep: Path) -> None:
    """Drop older wheelhouses of the same target (the worker's sources changed since)."""
    for old in cache.glob(f"{target.key()}-*"):
        if old != keep and old.is_dir():
            logger.info("removing the outdated wheelhouse %s", old)
            shutil.rmtree(old, ignore_errors=True)


def _fleettui_version() -> str:
    try:
        return importlib.metadata.version("fleettui").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0"
