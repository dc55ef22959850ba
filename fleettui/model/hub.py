"""Provides a Hugging Face hub id's config.json for planning (fetched with huggingface_hub when
online)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from fleettui.errors import PlanError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_id(name: str) -> bool:
    """`owner/name` that is not a local path."""
    return (
        bool(HUB_ID.fullmatch(name))
        and not name.endswith((".gguf", ".json"))
        and not Path(name).exists()
    )


def _first_reason(error: BaseException) -> str:
    """The most telling line of a hub error (not the retry chatter)."""
    text = str(error).strip()
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("Retrying")]
    reason = lines[0] if lines else type(error).__name__
    if "Name or service not known" in text or "Temporary failure in name resolution" in text:
        return "no network: the hub's name does not resolve"
    return reason[:200]


def _download(repository: str, filename: str) -> str:
    from huggingface_hub import hf_hub_download

    return str(hf_hub_download(repository, filename, etag_timeout=10))


def hub_config(repository: str, downloader: Callable[[str, str], str] | None = None) -> Path:
    """The local path of `repository`'s config.json (the hub's own cache; offline: what it already
    holds).

    Raises PlanError with one line when it cannot be had (offline, unknown or gated id).
    """
    fetch = downloader or _download
    try:
        return Path(fetch(repository, "config.json"))
    except ImportError:
        raise PlanError(
            f"{repository}: planning a hub id needs huggingface_hub (pip install huggingface-hub), "
            "or pass its config.json with --model-config"
        ) from None
    except Exception as error:  # offline, unknown id, gated model: one line for the user
        raise PlanError(
            f"{repository}: cannot fetch config.json from the Hugging Face hub "
            f"({_first_reason(error)}); "
            "offline, pass the model's config.json with --model-config or use a local model folder"
        ) from None
