"""Provides `fleettui cache ls|prune`: the compiled shard folders of the local cache, and removing
old ones.

`ls` lists every shard folder with its model, precision, split, size and age, marking those that
recorded deployments use. `prune` keeps the N most recently used folders and every folder a recorded
deployment uses, and removes the rest (and leftovers of interrupted compiles)."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleettui.errors import FleetError
from remote_worker.manifest import format_boundary

NAME = "cache"
HELP = "list (ls) or prune the local cache of compiled shard folders"
DEFAULT_KEEP = 2
# seconds: a folder without a manifest younger than this may still be compiling
INCOMPLETE_GRACE = 86400.0


@dataclass(frozen=True)
class ShardFolder:
    """One compiled shard folder of the cache."""

    path: Path
    model: str
    precision: str
    # layer boundaries, e.g. (0, 23, 30); 12.5 cuts layer 12 between attention and MLP
    split: tuple[str, ...]
    size: int
    used: float  # last use: written, or a cache hit (shards/.used/<name>), seconds since the epoch
    in_use: bool  # a recorded deployment points at it
    complete: bool  # has a readable manifest (an interrupted compile has none)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("ls", "prune"))
    parser.add_argument(
        "--root", type=Path, help="cache root (default: the user cache folder, or [model] shards)"
    )
    parser.add_argument(
        "--keep",
        type=int,
        default=DEFAULT_KEEP,
        help="prune: keep this many most recent folders (default %(default)s)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="prune: say what would be removed, remove nothing"
    )


def _size(path: Path) -> int:
    return sum(
        item.stat().st_size for item in path.rglob("*") if item.is_file() and not item.is_symlink()
    )


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def recorded_paths(folders: list[Path]) -> set[Path]:
    """The local shard folders the deployment records in `folders` use (fleettui.control.store
    records).

    A record of this version names its target, draft and each local stage's shard folder; from a
    record it cannot read (another version) every absolute path counts, so pruning never takes a
    deployed folder."""
    from fleettui.control.store import DeploymentRecord

    found: set[Path] = set()
    for folder in folders:
        for path in folder.glob("*.json") if folder.is_dir() else ():
            try:
                text = path.read_text(encoding="utf-8")
            except OSError:
                continue
            try:
                record = DeploymentRecord.from_json(text)
            except (ValueError, KeyError, TypeError):
                with contextlib.suppress(ValueError):
                    found.update(
                        Path(item) for item in _strings(json.loads(text)) if item.startswith("/")
                    )
                continue
            named = [record.target_dir, record.draft_dir]
            named += [stage.config.shard_dir for stage in record.stages if stage.local]
            found.update(Path(item) for item in named if item)
    return found


def deployment_records() -> list[Path]:
    """Where deployments are recorded: the state folder (and the cache folder of earlier
    versions)."""
    from fleettui.config import paths

    return [paths.deployments_dir(), paths.cache_dir() / "deployments"]


def shard_folders(root: Path, in_use: set[Path]) -> list[ShardFolder]:
    """The shard folders under `root`/shards, most recently used first."""
    shards = root / "shards"
    folders = []
    for path in sorted(shards.iterdir()) if shards.is_dir() else ():
        if not path.is_dir() or path.name.startswith("."):
            continue
        manifest = path / "manifest.json"
        try:
            document = json.loads(manifest.read_text(encoding="utf-8"))
            stages = document.get("stages", [])
            bounds = [(0, False)] + [
                (int(s["layers"]["end"]), bool(s["layers"].get("ends_mid"))) for s in stages
            ]
            split = tuple(format_boundary(bound, mid) for bound, mid in bounds) if stages else ()
            model, precision, complete = (
                str(document.get("model_name", "?")),
                str(document.get("precision", "?")),
                True,
            )
            marker = shards / ".used" / path.name  # the compiler touches it on every cache hit
            used = max(manifest.stat().st_mtime, marker.stat().st_mtime if marker.exists() else 0.0)
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            model, precision, split, complete, used = "?", "?", (), False, path.stat().st_mtime
        resolved = path.resolve()
        folders.append(
            ShardFolder(
                path,
                model,
                precision,
                split,
                _size(path),
                used,
                any(resolved == other or resolved in other.parents for other in in_use),
                complete,
            )
        )
    return sorted(folders, key=lambda folder: folder.used, reverse=True)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def format_listing(root: Path, folders: list[ShardFolder], now: float) -> str:
    lines = [
        f"{root / 'shards'}: {len(folders)} shard folder(s), "
        f"{sum(f.size for f in folders) / 1e9:.2f} GB"
    ]
    lines.append(
        f"{'folder':<18} {'model':<28} {'prec':<5} {'split':<16} {'size':>9} {'age':>7}  use"
    )
    for folder in folders:
        split = ",".join(map(str, folder.split)) or "-"
        mark = "deployed" if folder.in_use else ("" if folder.complete else "incomplete")
        lines.append(
            f"{folder.path.name:<18} {folder.model[:28]:<28} {folder.precision:<5} {split:<16} "
            f"{folder.size / 1e6:>6.0f} MB {_age(now - folder.used):>7}  {mark}"
        )
    for name in ("sources", "wheelhouse"):
        if (root / name).is_dir():
            lines.append(f"{name + '/':<18} {_size(root / name) / 1e6:.0f} MB")
    return "\n".join(lines)


def prune(folders: list[ShardFolder], keep: int, dry_run: bool = False) -> list[ShardFolder]:
    """Remove all but the `keep` most recent complete folders and those in use; returns what
    went."""
    if keep < 0:
        raise FleetError(f"cache prune: --keep {keep} must be 0 or more")
    recent = [folder for folder in folders if folder.complete][:keep]
    settled = time.time() - INCOMPLETE_GRACE  # an incomplete folder may be a compile in progress
    doomed = [
        folder
        for folder in folders
        if folder not in recent and not folder.in_use and (folder.complete or folder.used < settled)
    ]
    if not dry_run:
        for folder in doomed:
            shutil.rmtree(folder.path, ignore_errors=True)
            (folder.path.parent / ".used" / folder.path.name).unlink(missing_ok=True)
    return doomed


def run(args: argparse.Namespace) -> int:
    from fleettui.config import paths

    root = (args.root.expanduser() if args.root else paths.cache_dir()).resolve()
    folders = shard_folders(root, recorded_paths(deployment_records()))
    if args.action == "ls":
        print(format_listing(root, folders, time.time()))
        return 0
    removed = prune(folders, args.keep, args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for folder in removed:
        print(
            f"{verb} {folder.path} ({folder.model} {folder.precision}, {folder.size / 1e6:.0f} MB)"
        )
    kept = len(folders) - len(removed)
    print(
        f"{verb} {len(removed)} folder(s), {sum(f.size for f in removed) / 1e9:.2f} GB; kept {kept}"
    )
    return 0
