"""Two processes (or test workers) asking one cache for the same shards at once compile them
once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from shard_compiler import compiler


@pytest.mark.slow
def test_a_second_compile_of_the_same_shards_waits_and_finds_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[Path] = []
    inside = threading.Event()

    def fake_compile(job: compiler.Plan, directory: Path, notify: object, root: Path) -> None:
        inside.set()
        # until the second caller waits for this build (or the test fails)
        deadline = time.monotonic() + 120
        while "waiting" not in steps[1] and not built and time.monotonic() < deadline:
            time.sleep(0.05)
        (directory / "built").write_text(job.cache_key)
        built.append(directory)

    def fake_cached(directory: Path, cache_key: str) -> object:
        marker = directory / "built"
        return object() if marker.is_file() and marker.read_text() == cache_key else None

    monkeypatch.setattr(compiler, "_compile_into", fake_compile)
    monkeypatch.setattr(compiler, "cached", fake_cached)
    steps: list[list[str]] = [[], []]
    results: list[Path | None] = [None, None]

    def run(index: int) -> None:
        results[index] = compiler.compile_shards(
            "smollm2-135m-instruct",
            stages=2,
            precision="fp32",
            cache_root=tmp_path,
            progress=lambda event: steps[index].append(event.step),
        )

    first = threading.Thread(target=run, args=(0,))
    first.start()
    assert inside.wait(60)
    second = threading.Thread(target=run, args=(1,))
    second.start()
    first.join(60)
    second.join(60)
    assert len(built) == 1  # compiled once
    assert results[0] == results[1] and results[0] is not None and (results[0] / "built").is_file()
    assert steps[0] == ["done"] and steps[1] == ["waiting", "cached"]
    leftovers = [
        p.name for p in results[0].parent.iterdir() if p.name not in {results[0].name, ".used"}
    ]
    assert leftovers == []  # no half-built or stale copy beside it
