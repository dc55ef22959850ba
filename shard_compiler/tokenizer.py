"""Provides the tokenizer export: tokenizer.json straight from the source, plus OpenVINO GenAI
tokenizer IRs."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .sources import CompileError, ModelConfig, ModelSource, gguf_metadata

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenizerInfo:
    chat_template: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    # why the OpenVINO GenAI tokenizer IRs could not be written, if they were not
    genai_error: str | None


def _load(source: ModelSource) -> Any:
    from transformers import AutoTokenizer

    try:
        if source.kind == "gguf":
            # Straight from the GGUF every time: a save_pretrained/reload round trip breaks this
            # tokenizer.
            return AutoTokenizer.from_pretrained(
                str(source.path.parent), gguf_file=source.path.name
            )
        return AutoTokenizer.from_pretrained(str(source.path))
    except Exception as error:  # transformers raises many types here
        raise CompileError(
            f"{source.path}: cannot load the tokenizer ({type(error).__name__}: {error})"
        ) from None


def _backend(source: ModelSource, loaded: Any) -> Any:
    """The fast tokenizer's backend, with the GGUF's own bos/decoder settings applied."""
    from tokenizers import Tokenizer, decoders, processors

    backend = Tokenizer.from_str(loaded.backend_tokenizer.to_str())
    if source.kind == "gguf":
        meta = gguf_metadata(source.path, ["tokenizer.ggml.model", "tokenizer.ggml.add_bos_token"])
        bos = loaded.bos_token
        if meta["tokenizer.ggml.model"] == "gpt2":
            backend.decoder = decoders.ByteLevel()
            if not meta["tokenizer.ggml.add_bos_token"]:
                # transformers' GGUF loader adds a bos-prepending template the GGUF does not ask
                # for.
                backend.post_processor = processors.ByteLevel(trim_offsets=False)
        elif meta["tokenizer.ggml.add_bos_token"] and bos is not None:
            # ... and drops the one a SentencePiece GGUF (Gemma) does ask for: a raw prompt starts
            # with bos.
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A",
                pair=f"{bos} $A $B",
                special_tokens=[(bos, int(loaded.bos_token_id))],
            )
    return backend


def _token(backend: Any, token_id: int | None) -> str | None:
    return None if token_id is None else backend.id_to_token(token_id)


def export_tokenizer(
    source: ModelSource, config: ModelConfig, raw_config: dict[str, Any], directory: Path
) -> TokenizerInfo:
    """Write DIRECTORY/tokenizer.json (+ tokenizer_config.json, config.json,
    generation_config.json, GenAI IRs)."""
    directory.mkdir(parents=True, exist_ok=True)
    loaded = _load(source)
    backend = _backend(source, loaded)
    backend.save(str(directory / "tokenizer.json"))
    chat_template = loaded.chat_template if isinstance(loaded.chat_template, str) else ""
    bos, pad = config.bos_token_id, config.pad_token_id
    eos = config.eos_token_ids
    if not eos and loaded.eos_token_id is not None:
        eos = (int(loaded.eos_token_id),)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _token(backend, bos),
        "eos_token": _token(backend, eos[0] if eos else None),
        "pad_token": _token(backend, pad),
        "unk_token": loaded.unk_token,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
        "chat_template": chat_template,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (directory / "config.json").write_text(json.dumps(raw_config, indent=2, default=str))
    generation = {
        "bos_token_id": bos,
        "eos_token_id": list(eos) if len(eos) > 1 else (eos[0] if eos else None),
    }
    generation["pad_token_id"] = pad
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    genai_error = _export_genai(backend, tokenizer_config, directory)
    return TokenizerInfo(chat_template, bos, tuple(eos), pad, genai_error)


def export_tokenizer_cached(
    source: ModelSource,
    config: ModelConfig,
    raw_config: dict[str, Any],
    directory: Path,
    cache: Path,
) -> TokenizerInfo:
    """export_tokenizer done once into CACHE (per source and compiler version), then copied to
    DIRECTORY."""
    import shutil

    info_path = cache / "tokenizer-info.json"
    if not info_path.is_file():
        building = cache.with_name(f"{cache.name}.tmp-{os.getpid()}")
        shutil.rmtree(building, ignore_errors=True)
        info = export_tokenizer(source, config, raw_config, building)
        (building / "tokenizer-info.json").write_text(json.dumps(asdict(info)))
        shutil.rmtree(cache, ignore_errors=True)
        building.rename(cache)
    data = json.loads(info_path.read_text())
    data["eos_token_ids"] = tuple(data["eos_token_ids"])
    shutil.copytree(cache, directory, ignore=shutil.ignore_patterns("tokenizer-info.json"))
    return TokenizerInfo(**data)


def _export_genai(backend: Any, tokenizer_config: dict[str, Any], directory: Path) -> str | None:
    """OpenVINO GenAI tokenizer/detokenizer IRs from the very same backend; returns why not, on
    failure."""
    try:
        import openvino as ov
        from openvino_tokenizers import convert_tokenizer
        from transformers import PreTrainedTokenizerFast

        settings = {
            key: value
            for key, value in tokenizer_config.items()
            if key.endswith("_token") and value
        }
        fast = PreTrainedTokenizerFast(tokenizer_object=backend, **settings)
        fast.chat_template = tokenizer_config["chat_template"] or None
        tokenizer, detokenizer = convert_tokenizer(fast, with_detokenizer=True)
        ov.save_model(tokenizer, str(directory / "openvino_tokenizer.xml"))
        ov.save_model(detokenizer, str(directory / "openvino_detokenizer.xml"))
        return None
    except Exception as error:  # optional artefact: report, do not fail the compile
        logger.warning("OpenVINO GenAI tokenizer IRs not written: %s", error)
        return f"{type(error).__name__}: {error}"
