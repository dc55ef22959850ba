"""Tests for the compiled-model cache on real shards: a second start loads the blob and answers the
same, a blob whose bytes changed is compiled afresh, a held lock or an unusable folder falls back to
a plain compile, and a real worker's ping says where its compiled model came from."""

from __future__ import annotations

import fcntl
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from remote_worker import compile_cache
from remote_worker.engine import StageEngine

pytestmark = pytest.mark.slow

NO_RANGES = np.zeros((0, 2), np.int64)
PROMPT = np.arange(1, 9, dtype=np.int64)


def _shards() -> Path:
    from tests.support.shards import compiled

    return compiled(2, "fp32")


def _engine(cache: Path | None, stage: int = 0) -> StageEngine:
    return StageEngine(
        _shards(), stage, inference_precision="f32", kv_cache_precision="f32", cache_dir=cache
    )


def _hidden(engine: StageEngine) -> np.ndarray:
    engine.open(1)
    return engine.step(1, 0, 0, NO_RANGES, PROMPT).copy()


def _blobs(cache: Path) -> list[Path]:
    return sorted(cache.glob("*/*.blob"))


def test_a_second_start_loads_the_compiled_model_and_answers_bit_identically(
    tmp_path: Path,
) -> None:
    plain = _hidden(_engine(None))
    first = _engine(tmp_path / "compiled")
    assert not first.loaded_from_cache
    (blob,) = _blobs(tmp_path / "compiled")
    recorded = json.loads((blob.parent / compile_cache.RECORD).read_text())
    assert recorded == {blob.name: [blob.stat().st_size, blob.stat().st_mtime_ns]}
    second = _engine(tmp_path / "compiled")
    assert second.loaded_from_cache
    assert np.array_equal(_hidden(first), plain) and np.array_equal(_hidden(second), plain)
    # another stage: its own folder, compiled alongside
    other = _engine(tmp_path / "compiled", stage=1)
    assert not other.loaded_from_cache and len(_blobs(tmp_path / "compiled")) == 2


def test_a_blob_whose_bytes_changed_is_compiled_afresh_never_loaded(tmp_path: Path) -> None:
    cache = tmp_path / "compiled"
    plain = _hidden(_engine(None))
    _engine(cache)
    (blob,) = _blobs(cache)
    blob.chmod(0o600)
    time.sleep(0.05)  # a later write (the file system's clock ticks every few milliseconds)
    with open(blob, "r+b") as stream:  # garbage in the middle: OpenVINO itself would load it
        stream.seek(blob.stat().st_size // 2)
        stream.write(b"\x5a" * 4096)
    again = _engine(cache)
    assert not again.loaded_from_cache
    assert np.array_equal(_hidden(again), plain)
    assert _engine(cache).loaded_from_cache  # the fresh blob was recorded


def test_a_held_lock_or_an_unusable_folder_compiles_without_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "compiled"
    _engine(cache)
    (folder,) = [path for path in cache.iterdir() if path.is_dir()]
    monkeypatch.setattr(compile_cache, "LOCK_SECONDS", 0.5)
    with open(folder / ".lock", "a") as holder:  # another worker mid-compile (or frozen there)
        fcntl.flock(holder, fcntl.LOCK_EX)
        started = time.monotonic()
        waited = _engine(cache)
        assert time.monotonic() - started < 60
    assert not waited.loaded_from_cache
    assert "another worker held it" in caplog.text
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    assert not _engine(blocked).loaded_from_cache
    assert "compiling without it" in caplog.text


def _ping(port: int) -> dict[str, object]:
    context = zmq.Context()
    try:
        socket = context.socket(zmq.REQ)
        socket.linger = 0
        socket.rcvtimeo = 5000
        socket.connect(f"tcp://127.0.0.1:{port}")
        socket.send_json({"op": "ping"})
        return dict(socket.recv_json())
    finally:
        context.destroy(linger=0)


def test_a_restarted_worker_says_it_loaded_its_compiled_model_from_the_shard_folder(
    tmp_path: Path,
) -> None:
    from tests.support.workers import stage_config

    shard = tmp_path / "shard"  # a private copy: the compiled/ folder this test sees is its own
    shard.mkdir()
    for name in ("manifest.json", "stage_1"):
        subprocess.run(["cp", "-r", str(_shards() / name), str(shard / name)], check=True)
    answers = []
    for _ in range(2):
        config = stage_config("last", shard, 1)
        path = tmp_path / "stage.json"
        path.write_text(config.to_json())
        log = tmp_path / "worker.log"
        with open(log, "w") as errors:
            worker = subprocess.Popen(
                [sys.executable, "-m", "remote_worker", "--config", str(path)],
                stdout=subprocess.PIPE,
                stderr=errors,
                text=True,
            )
        try:
            assert worker.stdout is not None
            line = worker.stdout.readline()
            assert line.startswith("READY"), log.read_text()
            # before READY: the first answer does not pay it
            assert "warmed up in" in log.read_text()
            answers.append(_ping(config.control_port))
        finally:
            worker.terminate()
            worker.communicate(timeout=60)
    assert [answer["compiled_from_cache"] for answer in answers] == [False, True]
    assert all(isinstance(answer["compile_seconds"], float) for answer in answers)
    assert all(answer["warm_up_seconds"] > 0 for answer in answers)
    assert len(_blobs(shard / "compiled")) == 1
