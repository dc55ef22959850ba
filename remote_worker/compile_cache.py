"""Provides the compiled-model cache of a stage: OpenVINO's own model cache (CACHE_DIR), a folder
per setting.

A worker that starts again on the same shard and settings (a relaunch after a crash, a PC that
rebooted) loads the compiled model instead of compiling it. OpenVINO keys each blob by the model,
the device and the compile properties, and recompiles over a truncated blob, but it loads a blob
whose bytes were changed in place; so each blob's size and modification time are recorded right
after the compile wrote it (`blobs.json`), and before a compile every blob that does not match its
record (or has none: its writer died first) is deleted. That costs nothing at start, where a hash of
the blob would cost as much as the compile it saves on large models; a blob is the worker's own
output, never sent over a network (the shard's files, which are, keep their SHA-256 check). Each
stage file, device, property set and OpenVINO version has its own folder; workers compiling into one
folder take turns (a file lock given up after `LOCK_SECONDS`: a worker frozen mid-compile must not
hang the next one, which then compiles without the cache), and a compile that fails with the cache
is tried once without it."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LOCK_SECONDS = 120.0
RECORD = "blobs.json"


def compile_model(
    core: Any,
    model: Any,
    device: str,
    properties: dict[str, object],
    root: Path | None,
    name: str,
) -> tuple[Any, bool]:
    """(compiled model, whether it came from the cache under ROOT); ROOT None compiles without a
    cache.

    NAME is the model's file in the shard: with the device, the properties and the OpenVINO version
    it names the model's own subfolder, so other stages compile alongside. Raises RuntimeError as
    `core.compile_model` does when even the plain compile fails."""
    folder = None if root is None else root / _key(name, device, properties)
    if folder is not None and not _can_export(core, device):
        logger.info("%s cannot export a compiled model; compiling without a cache", device)
        folder = None
    if folder is not None:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            logger.warning(
                "compile cache %s: %s; compiling without it", folder, error.strerror or error
            )
            folder = None
    if folder is not None:
        with _turn(folder / ".lock", LOCK_SECONDS) as mine:
            if mine:
                _drop_unrecorded(folder)
                try:
                    compiled = core.compile_model(
                        model, device, {**properties, "CACHE_DIR": str(folder)}
                    )
                except RuntimeError as error:
                    logger.warning(
                        "compile with the cache %s failed (%s); compiling without it",
                        folder,
                        first_line(error),
                    )
                else:
                    loaded = _loaded_from_cache(compiled)
                    if not loaded:
                        _record(folder)
                    return compiled, loaded
            else:
                logger.warning(
                    "compile cache %s: another worker held it for %.0f s; compiling without it",
                    folder,
                    LOCK_SECONDS,
                )
    return core.compile_model(model, device, properties), False


def _key(name: str, device: str, properties: dict[str, object]) -> str:
    import openvino as ov

    text = json.dumps(
        [name, device, sorted((k, str(v)) for k, v in properties.items()), ov.get_version()]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _can_export(core: Any, device: str) -> bool:
    """Whether the device can export and import a compiled model (what OpenVINO's model cache
    needs)."""
    try:
        return "EXPORT_IMPORT" in set(core.get_property(device, "OPTIMIZATION_CAPABILITIES"))
    except RuntimeError:  # AUTO and some plugins do not answer: let OpenVINO decide
        return True


def first_line(error: BaseException) -> str:
    """The error's first line of text, or its type's name when it has none."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _loaded_from_cache(compiled: Any) -> bool:
    try:
        return bool(compiled.get_property("LOADED_FROM_CACHE"))
    except RuntimeError:  # a plugin that does not report it
        return False


def _stamp(blob: Path) -> list[int]:
    status = blob.stat()
    return [status.st_size, status.st_mtime_ns]


def _recorded(folder: Path) -> dict[str, list[int]]:
    try:
        data = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return dict(data) if isinstance(data, dict) else {}


def _drop_unrecorded(folder: Path) -> None:
    """Delete every blob whose size or modification time is not the one recorded for it."""
    recorded = _recorded(folder)
    for blob in sorted(folder.glob("*.blob")):
        if recorded.get(blob.name) == _stamp(blob):
            continue
        logger.warning(
            "compile cache: %s changed since it was written; compiling afresh", blob.name
        )
        with contextlib.suppress(OSError):
            blob.unlink()


def _record(folder: Path) -> None:
    """Record the folder's blobs after a compile wrote one (atomically; a failure only costs the
    next start a compile)."""
    blobs = {blob.name: _stamp(blob) for blob in folder.glob("*.blob")}
    temporary = folder / f"{RECORD}.{os.getpid()}.tmp"
    try:
        temporary.write_text(json.dumps(blobs, indent=1, sort_keys=True))
        os.replace(temporary, folder / RECORD)
    except OSError as error:
        logger.warning(
            "compile cache %s: cannot record the blobs: %s", folder, error.strerror or error
        )
        with contextlib.suppress(OSError):
            temporary.unlink()


@contextlib.contextmanager
def _turn(path: Path, seconds: float) -> Iterator[bool]:
    """Hold an exclusive lock on PATH while the block runs; yields False if it stayed taken for
    SECONDS.

    The lock dies with its holder's process. Without POSIX locks (Windows, one stage per PC) the
    block runs unlocked."""
    try:
        import fcntl
    except ImportError:
        yield True
        return
    try:
        handle = open(path, "a")  # noqa: SIM115 - held for the block
    except OSError:
        yield False
        return
    with handle:
        deadline = time.monotonic() + seconds
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.05)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
