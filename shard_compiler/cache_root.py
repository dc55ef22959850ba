"""Provides the compiler's default cache root (what compiles and packaged models share when none
is given)."""

from __future__ import annotations

from pathlib import Path


def default_cache_root() -> Path:
    """The user cache folder by the platform's convention (XDG_CACHE_HOME/fleettui on Linux).

    The same folder as fleettui.config.paths.cache_dir() (same app name); shard_compiler does not
    import fleettui."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("fleettui", appauthor=False))
