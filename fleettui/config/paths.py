"""Provides where fleettui keeps its files, by the platform's convention (platformdirs; XDG_* on
Linux).

- cache (rebuildable): compiled shards `<cache>/shards/<key>`, the wheelhouse `<cache>/wheelhouse`;
- state (must survive, private): deployment records with CurveZMQ secret keys `<state>/deployments`
  (0700/0600);
- logs: worker logs of local stages and the TUI's persistent log `<log>`;
- runtime (ephemeral, per process): run folders of workers started for one command, removed on exit.

Read once at the edge like the fleet file: functions, not module constants, so a test's XDG_*
applies."""

from __future__ import annotations

import os
from pathlib import Path

APP = "fleettui"


def _dirs():  # type: ignore[no-untyped-def]
    import platformdirs

    return platformdirs.PlatformDirs(APP, appauthor=False)


def cache_dir() -> Path:
    """Rebuildable artefacts: shards, wheelhouse (XDG_CACHE_HOME/fleettui on Linux)."""
    return Path(_dirs().user_cache_dir)


def state_dir() -> Path:
    """Deployment records (hold secret keys): created 0700 (XDG_STATE_HOME/fleettui on Linux)."""
    return private_dir(Path(_dirs().user_state_dir))


def log_dir() -> Path:
    """Logs of local workers and of the TUI (XDG_STATE_HOME/fleettui/log on Linux)."""
    path = Path(_dirs().user_log_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


def deployments_dir() -> Path:
    return private_dir(state_dir() / "deployments")


def private_dir(path: Path) -> Path:
    """`path` created if missing and readable by its owner only."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` atomically, mode 0600 from the first byte (it may hold a secret
    key)."""
    private_dir(path.parent)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(temporary, path)
