"""Provides a model name's shape: a builtin, a Hugging Face folder or config.json, or a GGUF
file's header."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from fleettui.errors import PlanError
from fleettui.model.shape import BUILTIN_SHAPES, SYNTHETIC_PREFIX, ModelShape, synthetic_shape


def shape_for_model(model: str, online: bool = False) -> ModelShape | None:
    """The shape of a builtin name, a HF folder, a config.json, a .gguf file or (online) a hub id.

    A hub id gives None unless `online`: then its config.json is fetched with huggingface_hub
    (PlanError with one line when offline). Loading a fleet file never goes online; planning does.
    """
    if model.startswith(SYNTHETIC_PREFIX):
        return synthetic_shape(model)
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
        raise PlanError(
            f"{path}: neither a model folder with config.json, a config.json nor a .gguf file"
        )
    from fleettui.model.hub import hub_config, is_hub_id

    if online and is_hub_id(model):
        return replace(ModelShape.from_config_file(hub_config(model)), name=model)
    return None


# publishers' config.json files, kept as data (README there)
PUBLISHED_DIR = Path(__file__).parent / "published"


def published_config(name: str) -> Path | None:
    """The stored config.json of a published model by NAME (`qwen3-8b`, `gemma-3-27b` ...), or
    None."""
    path = PUBLISHED_DIR / f"{name}.json"
    return path if path.is_file() else None


def published_names() -> list[str]:
    return sorted(path.stem for path in PUBLISHED_DIR.glob("*.json"))
