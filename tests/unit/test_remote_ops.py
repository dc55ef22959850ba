"""The host-side operations that need no SSH to test: a pushed file's seal and the stage stamp it
shares with the worker (`fleettui.provision.remote_ops`, run by the host's own Python; here called
in process)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from fleettui.provision import remote_ops
from remote_worker.manifest import STAMP_FORMAT, VERIFIED_FOLDER, verify_stage, write_manifest
from tests.support.manifests import fake_manifest


def test_a_pushed_file_that_differs_is_removed_and_named(tmp_path: Path) -> None:
    """What arrived is checked where it lands: a wrong file is removed, never left for a worker
    to find."""
    good, bad = tmp_path / "good.bin", tmp_path / "bad.bin"
    Path(f"{good}.part").write_bytes(b"weights")
    Path(f"{bad}.part").write_bytes(b"garbage")
    expected = hashlib.sha256(b"weights").hexdigest()
    answer = remote_ops.seal({"renamed": {str(good): expected, str(bad): expected}})
    assert answer == {"mismatched": [str(bad)]}
    assert good.read_bytes() == b"weights" and not bad.exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["good.bin"]


def test_the_seal_stamps_only_the_stage_files_the_worker_checks(tmp_path: Path) -> None:
    manifest = fake_manifest(tmp_path)
    write_manifest(tmp_path, manifest)
    expected = dict(manifest.stages[0].files)
    stamp = {
        "file": str(tmp_path / VERIFIED_FOLDER / "stage_0.json"),
        "root": str(tmp_path),
        "expected": expected,
        "format": STAMP_FORMAT,
    }
    for name in [*expected, "manifest.json"]:  # as pushed: every file arrives as a .part
        (tmp_path / name).rename(tmp_path / f"{name}.part")
    renamed = {str(tmp_path / name): sha for name, sha in expected.items()}
    renamed[str(tmp_path / "manifest.json")] = hashlib.sha256(
        (tmp_path / "manifest.json.part").read_bytes()
    ).hexdigest()
    assert remote_ops.seal({"renamed": renamed, "stamp": stamp}) == {"mismatched": []}
    assert verify_stage(tmp_path, manifest, 0) == 0  # the worker's start reads none of them
    # the host's next query answers from the stamp: every stage file, without the manifest (not the
    # stage's)
    queried = [str(tmp_path / name) for name in [*expected, "manifest.json"]]
    answer = remote_ops.hashes({"paths": queried, "stamp": stamp})["files"]
    assert {name: answer[str(tmp_path / name)][1] for name in expected} == expected
