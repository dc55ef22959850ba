"""Provides compile_shards: plan, cache lookup, per-stage build/convert/compress/save and the
manifest."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from remote_worker.manifest import (
    FORMAT_VERSION,
    LayerRange,
    Manifest,
    ManifestError,
    StageSpec,
    TensorSpec,
    even_split,
    load_manifest,
    ranges_from_splits,
    sha256_file,
    verify_all,
    write_manifest,
)

from . import sources
from .cache_root import default_cache_root
from .compress import PRECISIONS, group_size
from .sources import CompileError, ModelConfig

logger = logging.getLogger(__name__)

COMPILER_VERSION = "3"
IR_NAME = "openvino_model.xml"


@dataclass(frozen=True)
class Progress:
    """One progress event: stage index (None for whole-job steps), step name, fraction of the job
    done."""

    stage: int | None
    step: str
    fraction: float
    message: str = ""


@dataclass(frozen=True)
class Plan:
    source: sources.ModelSource
    source_hash: str
    raw_config: dict[str, Any]
    config: ModelConfig
    ranges: tuple[LayerRange, ...]
    precision: str
    group_size: int | None
    cache_key: str
    inject_beam_idx: bool


def _ranges(
    stages: int | Sequence[int], num_layers: int, mid_cuts: Collection[int] = ()
) -> tuple[LayerRange, ...]:
    try:
        splits = (
            [0, *(r.end for r in even_split(num_layers, stages))]
            if isinstance(stages, int)
            else list(stages)
        )
        return ranges_from_splits(splits, num_layers, mid_cuts)
    except ManifestError as error:
        raise CompileError(str(error)) from None


def plan(
    model: str,
    stages: int | Sequence[int],
    precision: str,
    cache_root: Path,
    inject_beam_idx: bool = True,
    mid_cuts: Collection[int] = (),
) -> Plan:
    """Resolve everything that determines the output (cheap: no weights are loaded)."""
    if precision not in PRECISIONS:
        raise CompileError(f"precision {precision!r}: not one of {', '.join(PRECISIONS)}")
    source = sources.resolve(model, cache_root)
    digest = sources.source_hash(source, cache_root)
    raw = sources.raw_config(source, cache_root, digest)
    config = sources.model_config(source, raw)
    ranges = _ranges(stages, config.num_layers, mid_cuts)
    group = group_size(config, precision)
    splits = [0, *(item.end for item in ranges)]
    material: list[Any] = [digest, splits, precision, group, COMPILER_VERSION, inject_beam_idx]
    if mid_cuts:  # only then: every whole-layer compile keeps the key it had
        material.append(sorted(mid_cuts))
    key_material = json.dumps(material, separators=(",", ":"))
    cache_key = hashlib.sha256(key_material.encode()).hexdigest()[:16]
    return Plan(source, digest, raw, config, ranges, precision, group, cache_key, inject_beam_idx)


def cached(directory: Path, cache_key: str) -> Manifest | None:
    """The manifest in DIRECTORY if it is for CACHE_KEY and every file hash verifies, else None."""
    if not (directory / "manifest.json").is_file():
        return None
    try:
        manifest = load_manifest(directory)
        if manifest.cache_key != cache_key:
            logger.info(
                "%s holds another compile (key %s); rebuilding", directory, manifest.cache_key
            )
            return None
        # files intact since their last check are not read again
        verify_all(directory, manifest, stamp=True)
        return manifest
    except ManifestError as error:
        logger.warning("cached shards in %s are not valid (%s); rebuilding", directory, error)
        return None


class PeakMemory:
    """Samples this process's RSS in a thread; .peak is the highest value seen (bytes)."""

    def __init__(self, interval: float = 0.05) -> None:
        import psutil

        self._process = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self.peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


def _tensors(
    plan_: Plan, layers: LayerRange, inject_beam_idx: bool
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    config = plan_.config
    hidden = TensorSpec(
        "hidden_states",
        "f32",
        (1, "n", config.hidden_size),
        "hidden states from the previous stage",
    )
    first = TensorSpec("input_ids", "i64", (1, "n"), "token ids of the n new tokens")
    inputs = [
        first if layers.is_first else hidden,
        TensorSpec(
            "attention_mask",
            "i64",
            (1, "cache_len + n"),
            "1 = attend; covers every physical cache slot (0 for rejected ones) then the n new "
            "tokens",
        ),
        TensorSpec("position_ids", "i64", (1, "n"), "logical positions of the n new tokens (RoPE)"),
    ]
    if inject_beam_idx:
        inputs.append(
            TensorSpec("beam_idx", "i32", (1,), "always [0]; enables the fused KV-cache path")
        )
    if layers.is_last_of(config.num_layers):
        output = TensorSpec(
            "logits", "f32", (1, "n", config.vocab_size), "next-token logits for each new token"
        )
    else:
        output = TensorSpec(
            "output_hidden_states",
            "f32",
            (1, "n", config.hidden_size),
            "hidden states for the next stage",
        )
    return tuple(inputs), (output,)


def _build_stage(
    plan_: Plan, reader: Any, index: int, directory: Path, report: Callable[[str, float], None]
) -> StageSpec:
    import openvino as ov
    import torch

    from .compress import compress
    from .stateful import inject_beam_idx, make_stateful
    from .trace import StageModule, convert

    layers = plan_.ranges[index]
    config = plan_.config
    report("load", 0.0)
    module = StageModule(config, reader, layers).eval()
    report("trace", 0.2)
    with torch.no_grad():
        model = convert(module, config, layers)
    del module
    gc.collect()
    report("stateful", 0.5)
    if plan_.inject_beam_idx:
        inject_beam_idx(model, layers)
    state_names = make_stateful(model, layers, config.num_kv_heads, config.head_dim)
    report("compress", 0.6)
    model = compress(model, config, plan_.precision, plan_.group_size)
    report("save", 0.9)
    stage_dir = directory / f"stage_{index}"
    stage_dir.mkdir()
    ov.save_model(model, str(stage_dir / IR_NAME), compress_to_fp16=plan_.precision == "fp16")
    del model
    gc.collect()
    relative = [f"stage_{index}/{IR_NAME}", f"stage_{index}/{Path(IR_NAME).with_suffix('.bin')}"]
    files = {name: sha256_file(directory / name) for name in relative}
    inputs, outputs = _tensors(plan_, layers, plan_.inject_beam_idx)
    return StageSpec(
        index, layers, config.num_layers, relative[0], inputs, outputs, state_names, files
    )


def _release_memory() -> None:
    """Hand freed heap back to the OS between stages, so one stage's peak does not carry into the
    next."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _shared_hashes(directory: Path) -> dict[str, str]:
    return {
        str(path.relative_to(directory)): sha256_file(path)
        for path in sorted((directory / "tokenizer").rglob("*"))
        if path.is_file()
    }


def _replace(built: Path, target: Path) -> None:
    """Move the finished BUILT directory into TARGET, replacing any stale one."""
    if target.exists():
        stale = target.with_name(f"{target.name}.stale-{int(time.time() * 1000)}")
        target.rename(stale)
        built.rename(target)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        built.rename(target)


def compile_shards(
    model: str,
    stages: int | Sequence[int] = 1,
    precision: str = "int4",
    out: Path | str | None = None,
    progress: Callable[[Progress], None] | None = None,
    force: bool = False,
    cache_root: Path | str | None = None,
    inject_beam_idx: bool = True,
    mid_cuts: Collection[int] = (),
) -> Path:
    """Compile MODEL into per-stage OpenVINO shards and return the shard directory.

    STAGES is a stage count (even split) or the boundaries (0, 10, 20, 30); a boundary in MID_CUTS
    cuts the layer before it between its attention and its MLP (13 in MID_CUTS: layer 12 is split).
    An unchanged request whose output verifies is a no-op. Raises CompileError with a one-line
    message on bad input."""
    root = Path(cache_root).expanduser() if cache_root is not None else default_cache_root()
    root.mkdir(parents=True, exist_ok=True)
    notify = progress or (lambda event: None)
    job = plan(model, stages, precision, root, inject_beam_idx, mid_cuts)
    target = Path(out).expanduser() if out is not None else root / "shards" / job.cache_key
    if not force and _hit(target, job.cache_key, out is None, notify):
        return target
    # One compile at a time per cache: a second command (another terminal, a parallel test) asking
    # for the same shards waits and then finds them, instead of building a copy and renaming the
    # folder away from under the first one's stages; two compiles of a big model at once would also
    # double the peak memory.
    with _compile_lock(root, notify):
        if not force and _hit(target, job.cache_key, out is None, notify):
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=f"{target.name}.tmp-", dir=target.parent))
        try:
            _compile_into(job, building, notify, root)
            _replace(building, target)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
    notify(Progress(None, "done", 1.0, str(target)))
    return target


def _hit(target: Path, cache_key: str, in_cache: bool, notify: Callable[[Progress], None]) -> bool:
    """TARGET already holds this compile, verified; notes the use and reports it."""
    if cached(target, cache_key) is None:
        return False
    if in_cache:  # only the cache's own folders are listed and pruned by `fleettui cache`
        _record_use(target)
    notify(Progress(None, "cached", 1.0, str(target)))
    return True


@contextlib.contextmanager
def _compile_lock(root: Path, notify: Callable[[Progress], None]) -> Iterator[None]:
    """Hold ROOT/compile.lock (an OS file lock: released when the holder exits, even by kill -9)."""
    from filelock import FileLock, Timeout

    lock = FileLock(root / "compile.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        notify(Progress(None, "waiting", 0.0, "another compile into this cache is running"))
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _record_use(target: Path) -> None:
    """Last use of a shard folder, for `fleettui cache ls|prune`: <folder>/../.used/<name>
    (outside the folder)."""
    with contextlib.suppress(OSError):
        marker = target.parent / ".used" / target.name
        marker.parent.mkdir(exist_ok=True)
        marker.touch()


def _compile_into(
    job: Plan, directory: Path, notify: Callable[[Progress], None], root: Path
) -> None:
    from .tokenizer import TokenizerInfo, export_tokenizer_cached

    count = len(job.ranges)
    fresh = (
        job.source.kind == "gguf"
        and not (root / "sources" / job.source_hash / "model.safetensors").is_file()
    )
    if fresh:  # a tensor type nothing can read fails the compile before anything is written
        sources.check_gguf_tensors(job.source.path)
    if job.source.synthetic:  # random weights: no tokenizer, no chat template (chat refuses it)
        config = job.config
        info = TokenizerInfo(
            "", config.bos_token_id, config.eos_token_ids, config.pad_token_id, None
        )
    else:
        notify(Progress(None, "tokenizer", 0.0, str(job.source.path)))
        tokenizer_cache = root / "sources" / job.source_hash / f"tokenizer-v{COMPILER_VERSION}"
        info = export_tokenizer_cached(
            job.source, job.config, job.raw_config, directory / "tokenizer", tokenizer_cache
        )
        if info.genai_error:
            logger.warning("GenAI tokenizer IRs missing: %s", info.genai_error)
    notify(
        Progress(
            None, "weights", 0.02, "dequantising the GGUF once into the cache" if fresh else ""
        )
    )
    if not job.source.synthetic:
        sources.weights_directory(job.source, root, job.source_hash)  # once, before the stages
    specs = []
    for index in range(count):

        def report(step: str, part: float, index: int = index) -> None:
            notify(
                Progress(
                    index, step, 0.05 + 0.95 * (index + part) / count, f"layers {job.ranges[index]}"
                )
            )

        started = time.perf_counter()
        with PeakMemory() as memory:
            # A fresh reader per stage: its memory-mapped pages are released with it.
            reader = sources.weight_reader(job.source, root, job.source_hash)
            specs.append(_build_stage(job, reader, index, directory, report))
        seconds = time.perf_counter() - started
        _release_memory()
        size = sum((directory / name).stat().st_size for name in specs[-1].files)
        message = (
            f"{seconds:.1f} s, peak RSS {memory.peak / 2**20:.0f} MiB, IR {size / 2**20:.1f} MiB"
        )
        logger.info("stage %d %s: %s", index, job.ranges[index], message)
        notify(Progress(index, "stage done", 0.05 + 0.95 * (index + 1) / count, message))
    config = job.config
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        model_name=job.source.name,
        source=job.source.description,
        source_hash=job.source_hash,
        compiler_version=COMPILER_VERSION,
        cache_key=job.cache_key,
        precision=job.precision,
        weight_group_size=job.group_size,
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        num_attention_heads=config.num_attention_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rope_theta=config.rope_theta,
        rope_scaling=config.rope_scaling,
        max_position_embeddings=config.max_position_embeddings,
        tokenizer="" if job.source.synthetic else "tokenizer",
        chat_template=info.chat_template,
        bos_token_id=info.bos_token_id,
        eos_token_ids=info.eos_token_ids,
        pad_token_id=info.pad_token_id,
        stages=tuple(specs),
        shared_files=_shared_hashes(directory),
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        synthetic=job.source.synthetic,
    )
    write_manifest(directory, manifest)
