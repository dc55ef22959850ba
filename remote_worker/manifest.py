"""Provides the shard directory contract: the manifest that documents compiled pipeline-stage
shards."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Collection, Iterable
from dataclasses import MISSING, dataclass, field, fields
from itertools import pairwise
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
# a worker's compiled-model cache inside the shard folder (not in the manifest)
COMPILED_FOLDER = "compiled"
# each stage's stamp of the files it found intact (not in the manifest either)
VERIFIED_FOLDER = "verified"
STAMP_FORMAT = 1
PRECISIONS = ("fp32", "fp16", "int8", "int4")
TENSOR_DTYPES = ("i64", "i32", "f32")


class ManifestError(Exception):
    """A shard directory or manifest that cannot be trusted; the message names the file or field."""


@dataclass(frozen=True)
class LayerRange:
    """Half-open range of decoder layers [start, end): the layers whose KV cache the stage holds.

    A boundary may cut a layer between its attention and its MLP (a *mid cut*, exact: the same ops,
    only the graph is cut): then the stage before it ends mid layer (`ends_mid`: layer end-1 stops
    after its attention) and the stage after it starts mid layer (`starts_mid`: it runs the MLP of
    layer start-1 first)."""

    start: int
    end: int
    starts_mid: bool = False
    ends_mid: bool = False

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ManifestError(f"layer range {name}: expected an integer, got {value!r}")
        for name in ("starts_mid", "ends_mid"):
            if not isinstance(getattr(self, name), bool):
                raise ManifestError(f"layer range {name}: expected true or false")
        if self.start < 0 or self.end <= self.start:
            raise ManifestError(
                f"layer range [{self.start}, {self.end}): must satisfy 0 <= start < end"
            )
        if self.starts_mid and self.start == 0:
            raise ManifestError("layer range starting at 0 cannot start mid layer")

    def __len__(self) -> int:
        return self.end - self.start

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.start <= layer < self.end

    @property
    def is_first(self) -> bool:
        return self.start == 0

    def is_last_of(self, num_layers: int) -> bool:
        return self.end == num_layers

    def __str__(self) -> str:
        return (
            f"[{format_boundary(self.start, self.starts_mid)}, "
            f"{format_boundary(self.end, self.ends_mid)})"
        )


def format_boundary(layer: int, mid: bool) -> str:
    """A stage boundary as written in a split: 13, or 12.5 for the cut inside layer 12 (before KV
    layer 13)."""
    return f"{layer - 1}.5" if mid else str(layer)


def boundary_value(layer: int, mid: bool) -> float:
    """A stage boundary as a number for display: 13, or 12.5 for the cut inside layer 12."""
    return layer - 0.5 if mid else layer


def format_bounds(bounds: Iterable[int], mid_cuts: Collection[int]) -> list[str]:
    """Boundaries as the shard compiler's `--split` takes them: those in MID_CUTS as N.5."""
    return [format_boundary(bound, bound in mid_cuts) for bound in bounds]


def parse_boundary(text: str) -> tuple[int, bool]:
    """(KV boundary, mid) of a split boundary written as 13 or 12.5; ManifestError otherwise."""
    whole, dot, fraction = text.strip().partition(".")
    if not whole.isdigit() or (dot and fraction != "5"):
        raise ManifestError(
            f"boundary {text!r}: expected a layer number, or N.5 to cut inside layer N"
        )
    return (int(whole) + 1, True) if dot else (int(whole), False)


@dataclass(frozen=True)
class TensorSpec:
    """One named input or output tensor of a stage IR; string dimensions are symbolic (e.g. "n")."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]
    meaning: str

    def __post_init__(self) -> None:
        if self.dtype not in TENSOR_DTYPES:
            raise ManifestError(
                f"tensor {self.name!r}: dtype {self.dtype!r} is not one of "
                f"{', '.join(TENSOR_DTYPES)}"
            )


@dataclass(frozen=True)
class StageSpec:
    """One compiled stage: its layers, IR file, tensors, KV state variables and file hashes."""

    index: int
    layers: LayerRange
    num_layers: int
    ir: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    state_names: tuple[str, ...]
    files: dict[str, str] = field(default_factory=dict)

    @property
    def is_first(self) -> bool:
        return self.layers.is_first

    @property
    def is_last(self) -> bool:
        return self.layers.is_last_of(self.num_layers)


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs to serve and check a set of compiled shards."""

    format_version: int
    model_name: str
    source: str
    source_hash: str
    compiler_version: str
    cache_key: str
    precision: str
    weight_group_size: int | None
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tokenizer: str
    chat_template: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    stages: tuple[StageSpec, ...]
    shared_files: dict[str, str]
    created_at: str
    # seeded random weights of a real architecture: for timing only, never chat
    synthetic: bool = False

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ManifestError(
                f"precision: {self.precision!r} is not one of {', '.join(PRECISIONS)}"
            )
        if not self.stages:
            raise ManifestError("stages: at least one stage is required")
        expected_start = 0
        for position, stage in enumerate(self.stages):
            if stage.index != position:
                raise ManifestError(
                    f"stages[{position}].index: expected {position}, got {stage.index}"
                )
            if stage.layers.start != expected_start:
                raise ManifestError(
                    f"stages[{position}].layers: {stage.layers} does not start at {expected_start}"
                )
            if stage.num_layers != self.num_layers:
                raise ManifestError(
                    f"stages[{position}].num_layers: {stage.num_layers} != {self.num_layers}"
                )
            if stage.layers.starts_mid != (
                position > 0 and self.stages[position - 1].layers.ends_mid
            ):
                raise ManifestError(
                    f"stages[{position}].layers: {stage.layers} does not meet the stage before it"
                )
            expected_start = stage.layers.end
        if self.stages[-1].layers.ends_mid:
            raise ManifestError(
                f"stages[{len(self.stages) - 1}].layers: the last stage cannot end mid layer"
            )
        if expected_start != self.num_layers:
            raise ManifestError(
                f"stages: layers end at {expected_start}, the model has {self.num_layers}"
            )

    @property
    def splits(self) -> tuple[int, ...]:
        """Stage boundaries, e.g. (0, 10, 20, 30)."""
        return (0, *(stage.layers.end for stage in self.stages))

    @property
    def mid_cuts(self) -> tuple[int, ...]:
        """The boundaries that cut the layer before them between its attention and its MLP."""
        return tuple(stage.layers.start for stage in self.stages if stage.layers.starts_mid)

    def to_dict(self) -> dict[str, Any]:
        plain: dict[str, Any] = _plain(self)
        return plain

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str, origin: str = MANIFEST_NAME) -> Manifest:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ManifestError(f"{origin}: not valid JSON ({error})") from None
        return cls.from_dict(data, origin)

    @classmethod
    def from_dict(cls, data: Any, origin: str = MANIFEST_NAME) -> Manifest:
        values = _fields(cls, data, origin)
        if values["format_version"] != FORMAT_VERSION:
            raise ManifestError(
                f"{origin}: format_version {values['format_version']!r} is not supported (expected "
                f"{FORMAT_VERSION})"
            )
        values["eos_token_ids"] = tuple(_list(values["eos_token_ids"], f"{origin}: eos_token_ids"))
        values["stages"] = tuple(
            _stage(item, f"{origin}: stages[{position}]")
            for position, item in enumerate(_list(values["stages"], f"{origin}: stages"))
        )
        values["shared_files"] = _hashes(values["shared_files"], f"{origin}: shared_files")
        if not isinstance(values.get("synthetic", False), bool):
            raise ManifestError(f"{origin}: synthetic must be true or false")
        if values["rope_scaling"] is not None and not isinstance(values["rope_scaling"], dict):
            raise ManifestError(f"{origin}: rope_scaling must be an object or null")
        _check_types(cls, values, origin)
        try:
            return cls(**values)
        except ManifestError as error:
            raise ManifestError(f"{origin}: {error}") from None


_SCALAR_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "str": (str,),
    "float": (float, int),
    "int | None": (int, type(None)),
}


def _check_types(cls: type, values: dict[str, Any], origin: str) -> None:
    for item in fields(cls):
        allowed = _SCALAR_TYPES.get(str(item.type))
        if allowed is None or item.name not in values:
            continue
        value = values[item.name]
        if isinstance(value, bool) or not isinstance(value, allowed):
            raise ManifestError(f"{origin}: {item.name}: expected {item.type}, got {value!r}")
    if "rope_theta" in values:
        values["rope_theta"] = float(values["rope_theta"])


def _fields(cls: type, data: Any, origin: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ManifestError(f"{origin}: expected a JSON object")
    names = [item.name for item in fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ManifestError(f"{origin}: unknown key {unknown[0]!r}")
    optional = {item.name for item in fields(cls) if item.default is not MISSING}
    missing = [name for name in names if name not in data and name not in optional]
    if missing:
        raise ManifestError(f"{origin}: missing key {missing[0]!r}")
    return {name: data[name] for name in names if name in data}


def _list(value: Any, origin: str) -> list[Any]:
    if not isinstance(value, list):
        raise ManifestError(f"{origin}: expected a list")
    return value


def _hashes(value: Any, origin: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(key, str) and isinstance(digest, str) and len(digest) == 64
        for key, digest in value.items()
    ):
        raise ManifestError(
            f"{origin}: expected an object mapping relative paths to SHA-256 hex digests"
        )
    for key in value:
        if Path(key).is_absolute() or ".." in Path(key).parts:
            raise ManifestError(
                f"{origin}: path {key!r} must be relative and inside the shard directory"
            )
    return dict(value)


def _tensor(data: Any, origin: str) -> TensorSpec:
    values = _fields(TensorSpec, data, origin)
    values["shape"] = tuple(_list(values["shape"], f"{origin}.shape"))
    if not all(
        isinstance(dim, (int, str)) and not isinstance(dim, bool) for dim in values["shape"]
    ):
        raise ManifestError(f"{origin}.shape: dimensions must be integers or names")
    _check_types(TensorSpec, values, origin)
    try:
        return TensorSpec(**values)
    except ManifestError as error:
        raise ManifestError(f"{origin}: {error}") from None


def _stage(data: Any, origin: str) -> StageSpec:
    values = _fields(StageSpec, data, origin)
    layers = _fields(LayerRange, values["layers"], f"{origin}.layers")
    try:
        values["layers"] = LayerRange(**layers)
    except ManifestError as error:
        raise ManifestError(f"{origin}.layers: {error}") from None
    for key in ("inputs", "outputs"):
        values[key] = tuple(
            _tensor(item, f"{origin}.{key}[{position}]")
            for position, item in enumerate(_list(values[key], f"{origin}.{key}"))
        )
    values["state_names"] = tuple(_list(values["state_names"], f"{origin}.state_names"))
    if not all(isinstance(name, str) for name in values["state_names"]):
        raise ManifestError(f"{origin}.state_names: expected strings")
    values["files"] = _hashes(values["files"], f"{origin}.files")
    _check_types(StageSpec, values, origin)
    if values["ir"] not in values["files"]:
        raise ManifestError(f"{origin}.ir: {values['ir']!r} is not listed in files")
    return StageSpec(**values)


def _plain(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return {item.name: _plain(getattr(value, item.name)) for item in fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def load_manifest(directory: Path) -> Manifest:
    """Read and validate DIRECTORY/manifest.json (no file hashes are checked here; see
    verify_stage)."""
    path = Path(directory) / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError(f"{path}: missing (not a compiled shard directory)") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ManifestError(f"{path}: unreadable ({error})") from None
    return Manifest.from_json(text, str(path))


def write_manifest(directory: Path, manifest: Manifest) -> Path:
    """Write DIRECTORY/manifest.json atomically and return its path."""
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    handle, temporary = tempfile.mkstemp(prefix=".manifest-", dir=directory)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(manifest.to_json())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def verify_files(
    directory: Path, hashes: dict[str, str], stamp: Path | None = None, trust: bool = True
) -> int:
    """Check that every listed file exists under DIRECTORY and has the recorded SHA-256; returns how
    many files were hashed.

    With a `stamp` (a JSON file) a file whose SHA-256 was checked before and whose size,
    modification and inode-change times, inode and device are unchanged since is not read again: any
    write through the file system changes its ctime, which no one can set back. Worth it for a
    restart of a large model, whose stage files would otherwise be hashed on every relaunch. The
    stamp lives in the shard folder, so whoever could forge it could as well edit the manifest
    there. A deploy from the operator reads and writes the same stamp on the host
    (`fleettui.provision.remote_ops`, `hashes` and `seal`), so the worker's first start after a push
    hashes nothing the push checked. Writing it is best effort. With `trust` False every file is
    hashed and the stamp rewritten (`fleettui deploy --recheck`: bit rot leaves a file's metadata
    alone, which no stamp can see)."""
    known = _read_stamp(stamp) if stamp is not None and trust else {}
    checked: dict[str, list[Any]] = {}
    hashed = 0
    for relative, expected in hashes.items():
        path = Path(directory) / relative
        if not path.is_file():
            raise ManifestError(f"{relative}: missing from {directory}")
        info = path.stat()  # before the hash: a write during it changes the ctime the stamp records
        identity = [
            expected,
            info.st_size,
            info.st_mtime_ns,
            info.st_ctime_ns,
            info.st_ino,
            info.st_dev,
        ]
        if known.get(relative) != identity:
            found = sha256_file(path)
            hashed += 1
            if found != expected:
                raise ManifestError(
                    f"{relative}: SHA-256 mismatch (expected {expected[:8]}…, found {found[:8]}…)"
                )
        checked[relative] = identity
    if stamp is not None and checked != known:
        _write_stamp(stamp, checked)
    return hashed


def _read_stamp(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    files = (
        data.get("files") if isinstance(data, dict) and data.get("format") == STAMP_FORMAT else None
    )
    return files if isinstance(files, dict) else {}


def _write_stamp(path: Path, files: dict[str, list[Any]]) -> None:
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", dir=path.parent, suffix=".tmp", delete=False
        ) as stream:
            temporary = stream.name
            json.dump({"format": STAMP_FORMAT, "files": files}, stream)
        # whole or not at all: stages sharing the folder each write their own
        os.replace(temporary, path)
    except OSError:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)


def verify_stage(
    directory: Path, manifest: Manifest, index: int, stamp: bool = True, trust: bool = True
) -> int:
    """Check every file of stage INDEX against the manifest, raising ManifestError on the first
    problem; returns how many files were hashed (`stamp`: skip those unchanged since a check unless
    not `trust`, see `verify_files`)."""
    if not 0 <= index < len(manifest.stages):
        raise ManifestError(f"stage {index}: the manifest has stages 0..{len(manifest.stages) - 1}")
    path = Path(directory) / VERIFIED_FOLDER / f"stage_{index}.json" if stamp else None
    return verify_files(directory, manifest.stages[index].files, path, trust)


def verify_all(directory: Path, manifest: Manifest, stamp: bool = False) -> int:
    """Check the shared (tokenizer) files and every stage's files, raising ManifestError on the
    first problem; returns how many files were hashed (`stamp`: skip those unchanged since a check,
    see `verify_files`)."""
    shared = Path(directory) / VERIFIED_FOLDER / "shared.json" if stamp else None
    hashed = verify_files(directory, manifest.shared_files, shared)
    return hashed + sum(
        verify_stage(directory, manifest, index, stamp) for index in range(len(manifest.stages))
    )


def even_split(num_layers: int, stages: int) -> tuple[LayerRange, ...]:
    """Split NUM_LAYERS into STAGES contiguous ranges; the remainder goes to the earliest stages."""
    if stages < 1:
        raise ManifestError(f"stages: {stages} must be at least 1")
    if stages > num_layers:
        raise ManifestError(f"stages: {stages} is more than the model's {num_layers} layers")
    base, remainder = divmod(num_layers, stages)
    ranges = []
    start = 0
    for index in range(stages):
        end = start + base + (1 if index < remainder else 0)
        ranges.append(LayerRange(start, end))
        start = end
    return tuple(ranges)


def ranges_from_splits(
    splits: list[int] | tuple[int, ...], num_layers: int, mid_cuts: Collection[int] = ()
) -> tuple[LayerRange, ...]:
    """Turn boundaries like (0, 10, 20, 30) into layer ranges, checking they cover [0, num_layers).

    A boundary in `mid_cuts` cuts the layer before it between its attention and its MLP."""
    points = list(splits)
    if len(points) < 2 or points[0] != 0 or points[-1] != num_layers:
        raise ManifestError(
            f"split {','.join(map(str, points))}: must start at 0 and end at {num_layers}"
        )
    if any(later <= earlier for earlier, later in pairwise(points)):
        raise ManifestError(
            f"split {','.join(map(str, points))}: boundaries must strictly increase"
        )
    stray = sorted(set(mid_cuts) - set(points[1:-1]))
    if stray:
        raise ManifestError(
            f"mid cut {format_boundary(stray[0], True)}: not a boundary between two stages"
        )
    return tuple(
        LayerRange(start, end, start in mid_cuts, end in mid_cuts)
        for start, end in pairwise(points)
    )
