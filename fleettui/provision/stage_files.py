"""A stage's files for a push: which ones, their SHA-256 (checked against the shard's manifest), the
content-addressed folder they go to on the host, and the host's stamp of the stage."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

from fleettui.provision.transfer import FileToPush, RemoteStamp, local_sha256, tree_files
from remote_worker.manifest import (
    STAMP_FORMAT,
    VERIFIED_FOLDER,
    ManifestError,
    load_manifest,
    verify_stage,
)


@dataclass(frozen=True)
class ShardAssignment:
    """A host's stage: the local compiled shard folder and the stage index inside it."""

    directory: Path
    stage: int
    # relative paths to push; default: manifest.json and stage_{i}/
    files: tuple[str, ...] | None = None


def shard_files(shard: ShardAssignment) -> tuple[str, ...]:
    """The relative paths a stage needs from its shard folder."""
    if shard.files is not None:
        return shard.files
    # a worker verifies and loads only its own stage
    wanted = (
        "manifest.json",
        f"stage_{shard.stage}",
    )
    return tuple(name for name in wanted if (shard.directory / name).exists())


def shard_bytes(shard: ShardAssignment) -> int:
    """The bytes of the files a push of SHARD sends (what the host's disk must hold)."""
    return sum(
        item.local.stat().st_size for item in tree_files(shard.directory, "", shard_files(shard))
    )


def checked_stage(shard: ShardAssignment, recheck: bool = False) -> dict[str, str]:
    """The SHA-256 of each file of the stage, from its manifest, after checking the local copies
    (with the local stamp the workers keep there, so files intact since a check are not read, unless
    `recheck`); {} for a folder whose manifest cannot be read (its files are hashed as any). Raises
    ManifestError when a file differs."""
    try:
        manifest = load_manifest(shard.directory)
    except ManifestError:
        return {}
    verify_stage(shard.directory, manifest, shard.stage, trust=not recheck)
    return dict(manifest.stages[shard.stage].files)


def stage_push(
    shard: ShardAssignment, shards_folder: str, recheck: bool = False
) -> tuple[str, list[FileToPush], RemoteStamp | None]:
    """The remote folder (under SHARDS_FOLDER, named by the files' hashes), the files to push there
    and the stage's stamp on the host; raises ManifestError when a local file differs from the
    manifest.

    With the files checked against the manifest here and the host's copy checked with the worker's
    stamp, an unchanged redeploy reads no file of the stage on either side; `recheck` reads them all
    on both."""
    known = checked_stage(shard, recheck)
    local = [
        replace(item, sha256=known.get(item.remote) or local_sha256(item.local))
        for item in tree_files(shard.directory, "", shard_files(shard))
    ]
    digest = hashlib.sha256()
    for item in local:
        digest.update(f"{item.remote}\0{item.sha256}\0".encode())
    remote = f"{shards_folder.rstrip('/')}/{digest.hexdigest()[:16]}"
    files = [replace(item, remote=f"{remote}/{item.remote}") for item in local]
    if not known:
        return remote, files, None
    stamp_file = f"{remote}/{VERIFIED_FOLDER}/stage_{shard.stage}.json"
    stamp = RemoteStamp(stamp_file, remote, known, STAMP_FORMAT, recheck)
    return remote, files, stamp
