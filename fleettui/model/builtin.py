"""Provides a model name's shape: a builtin, a Hugging Face folder or config.json, or a GGUF file's header."""

from __future__ import annotations

from pathlib import Path

from fleettui.errors import PlanError
from fleettui.model.shape import BUILTIN_SHAPES, ModelShape


def shape_for_model(model: str) -> ModelShape | None:
    """The shape of a builtin name, a HF folder, a config.json or a .gguf file; None for a hub id."""
    if model in BUILTIN_SHAPES:
        return BUILTIN_SHAPES[model]
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return ModelShape.from_config_file(path / "config.json")
    if path.is_file() and path.suffix == ".json":
        return ModelShape.from_config_file(path)
    if path.is_file() and path.suffix == ".gguf":
        from fleettui.model.gguf_header import gguf_shape

        return gguf_shape(path)
    if path.exists():
        raise PlanError(f"{path}: neither a model folder with config.json, a config.json nor a .gguf file")
    return None
