"""Compiles a Llama-family LLM into per-stage stateful OpenVINO IR shards described by a manifest."""

from .compiler import COMPILER_VERSION, Progress, compile_shards
from .sources import CompileError

__all__ = ["COMPILER_VERSION", "CompileError", "Progress", "compile_shards"]
