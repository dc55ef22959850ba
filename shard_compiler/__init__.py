"""Compiles a Llama-family LLM into per-stage stateful OpenVINO IR shards described by a
manifest."""

import os

from .compiler import COMPILER_VERSION, Progress, compile_shards, default_cache_root
from .sources import CompileError

# Converting a torch module pulls in PyTorch's inductor, which makes /tmp/torchinductor_<user> and
# never removes it: keep that folder with our other rebuildable artefacts (set before any torch
# import of this package).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(default_cache_root() / "torchinductor"))

__all__ = ["COMPILER_VERSION", "CompileError", "Progress", "compile_shards"]
