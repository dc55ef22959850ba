"""Resumable, verified SFTP push: unchanged files cost 0 bytes, partial ones continue where they
stopped.

For each file the host reports size and SHA-256 of ``name`` and ``name.part``. A file whose hash
already matches is skipped. A remote prefix (a ``.part`` left by an interrupted push, or a truncated
file) whose hash matches the same prefix of the local file is continued from its end; anything else
starts over. Data goes to ``name.part``; the host moves it into place and checks its hash there
(``seal``), removing a file that differs. With a stage's stamp (`RemoteStamp`) the host reads no
file that is unchanged since it was last found intact, by a deploy or by the worker's own start."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from fleettui.errors import ProvisionError
from fleettui.provision.events import PushResult
from fleettui.provision.remote import RemoteShell, run_operation

logger = logging.getLogger(__name__)

CHUNK = 4 << 20  # bytes per SFTP write call (asyncssh splits it into parallel requests)
_hash_cache: dict[tuple[str, int, int], str] = {}

Progress = Callable[[int, int, str], None]  # bytes done, bytes total, current file


@dataclass(frozen=True)
class FileToPush:
    local: Path
    remote: str  # absolute remote path with forward slashes
    sha256: str | None = None  # known and checked already (a shard's manifest); else hashed here


@dataclass(frozen=True)
class RemoteStamp:
    """A stage's stamp on the host (the worker's `verified/stage_N.json`) and the files it may
    hold."""

    file: str
    root: str  # the remote shard folder the names are relative to
    expected: dict[str, str]  # relative name -> SHA-256 (the manifest's files of the stage)
    format: int
    # read every file again, trusting no record (`deploy --recheck`), then stamp
    recheck: bool = False

    def payload(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "root": self.root,
            "expected": self.expected,
            "format": self.format,
            "recheck": self.recheck,
        }


def local_sha256(path: Path, size: int | None = None) -> str:
    """SHA-256 of a local file (or of its first ``size`` bytes); whole-file hashes are cached by
    mtime."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if size is None and key in _hash_cache:
        return _hash_cache[key]
    digest = hashlib.sha256()
    remaining = stat.st_size if size is None else size
    with open(path, "rb") as stream:
        while remaining > 0:
            chunk = stream.read(min(1 << 20, remaining))
            if not chunk:
                break
            digest.update(chunk)
            remaining -= len(chunk)
    if size is None:
        _hash_cache[key] = digest.hexdigest()
    return digest.hexdigest()


def _sha256_of(item: FileToPush) -> str:
    return item.sha256 if item.sha256 is not None else local_sha256(item.local)


def tree_files(
    local_dir: Path, remote_dir: str, relative: Sequence[str] | None = None
) -> list[FileToPush]:
    """Every file under ``local_dir`` (or just the given relative paths / folders) mapped under
    ``remote_dir``."""
    roots = [local_dir / name for name in relative] if relative is not None else [local_dir]
    files: list[FileToPush] = []
    for root in roots:
        if not root.exists():
            raise FileNotFoundError(root)
        paths = (
            [root] if root.is_file() else sorted(path for path in root.rglob("*") if path.is_file())
        )
        for path in paths:
            remote = PurePosixPath(remote_dir) / path.relative_to(local_dir).as_posix()
            files.append(FileToPush(path, str(remote)))
    return files


async def push_files(
    sftp: Any,
    connection: Any,
    shell: RemoteShell,
    python: str,
    files: Sequence[FileToPush],
    *,
    host: str,
    step: str,
    progress: Progress | None = None,
    stamp: RemoteStamp | None = None,
) -> PushResult:
    """Push ``files`` to the host; only missing or different bytes travel. Raises ProvisionError."""
    started = time.monotonic()
    sizes = [item.local.stat().st_size for item in files]
    hashes = await asyncio.gather(*(asyncio.to_thread(_sha256_of, item) for item in files))
    stamped = {"stamp": stamp.payload()} if stamp else {}
    queried = [name for item in files for name in (item.remote, item.remote + ".part")]
    remote = (
        await run_operation(
            connection, shell, python, "hashes", {"paths": queried, **stamped}, host=host, step=step
        )
    )["files"]
    total = sum(sizes)
    plan: list[tuple[FileToPush, int, str, int]] = []  # file, size, hash, resume offset
    done = 0
    for item, size, digest in zip(files, sizes, hashes, strict=True):
        final, partial = remote.get(item.remote), remote.get(item.remote + ".part")
        if final and final[0] == size and final[1] == digest:
            done += size
            continue
        offset = 0
        for candidate, is_final in ((partial, False), (final, True)):
            if candidate and offset < candidate[0] <= size:
                prefix = await asyncio.to_thread(local_sha256, item.local, candidate[0])
                if prefix == candidate[1]:
                    offset = candidate[0]
                    if is_final:
                        await sftp.posix_rename(item.remote, item.remote + ".part")
        plan.append((item, size, digest, offset))
    resumed = sum(offset for _, _, _, offset in plan)
    done += resumed
    sent = 0
    directories = sorted({str(PurePosixPath(item.remote).parent) for item, _, _, _ in plan})
    for directory in directories:
        await sftp.makedirs(directory, exist_ok=True)
    last_report = 0.0
    transfer_started = time.monotonic()
    for item, _size, _digest, offset in plan:
        if progress:
            progress(done, total, item.local.name)
        mode = "r+b" if offset else "wb"
        async with sftp.open(item.remote + ".part", mode) as remote_file:
            if offset:
                await remote_file.truncate(offset)
            stream = await asyncio.to_thread(open, item.local, "rb")
            try:
                stream.seek(offset)
                position = offset
                while chunk := await asyncio.to_thread(stream.read, CHUNK):
                    await remote_file.write(chunk, position)
                    position += len(chunk)
                    sent += len(chunk)
                    done += len(chunk)
                    now = time.monotonic()
                    if progress and now - last_report > 0.1:
                        progress(done, total, item.local.name)
                        last_report = now
            finally:
                stream.close()
    transfer_seconds = time.monotonic() - transfer_started
    if plan:
        renamed = {item.remote: digest for item, _, digest, _ in plan}
        answer = await run_operation(
            connection, shell, python, "seal", {"renamed": renamed, **stamped}, host=host, step=step
        )
        if answer["mismatched"]:
            name = PurePosixPath(answer["mismatched"][0]).name
            raise ProvisionError(
                host, step, f"SHA-256 mismatch after pushing {name}: removed, retry"
            )
    if progress:
        progress(total, total, "")
    seconds = time.monotonic() - started
    logger.debug(
        "%s: %s: push took %.2f s, of which %.2f s writing", host, step, seconds, transfer_seconds
    )
    logger.info(
        "%s: %s: %d of %d files, %d bytes sent (%d resumed)",
        host,
        step,
        len(plan),
        len(files),
        sent,
        resumed,
    )
    return PushResult(len(files), len(plan), sent, total, resumed, transfer_seconds)
