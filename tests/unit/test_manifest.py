"""Tests the shard manifest contract: round trip, strict parsing, hash verification and even
splits."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from remote_worker.manifest import (
    MANIFEST_NAME,
    LayerRange,
    Manifest,
    ManifestError,
    even_split,
    format_boundary,
    load_manifest,
    parse_boundary,
    ranges_from_splits,
    verify_all,
    verify_stage,
    write_manifest,
)
from tests.support.manifests import fake_manifest


def test_round_trip_through_the_directory(tmp_path: Path) -> None:
    manifest = fake_manifest(tmp_path)
    path = write_manifest(tmp_path, manifest)
    assert path == tmp_path / MANIFEST_NAME
    loaded = load_manifest(tmp_path)
    assert loaded == manifest
    assert loaded.stages[0].is_first and not loaded.stages[0].is_last
    assert loaded.stages[1].is_last and not loaded.stages[1].is_first
    assert loaded.splits == (0, 16, 30)
    assert Manifest.from_json(manifest.to_json()) == manifest
    verify_all(tmp_path, loaded)


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda data: data.update(surprise=1), "unknown key 'surprise'"),
        (lambda data: data.pop("vocab_size"), "missing key 'vocab_size'"),
        (lambda data: data.update(format_version=99), "format_version 99"),
        (lambda data: data.update(precision="int3"), "precision: 'int3'"),
        (lambda data: data.update(num_layers="30"), "num_layers"),
        (lambda data: data["stages"][0].update(extra=True), "stages[0]: unknown key 'extra'"),
        (lambda data: data["stages"][1]["layers"].update(start=17), "does not start at 16"),
        (lambda data: data["stages"][0]["inputs"][0].update(dtype="f64"), "dtype 'f64'"),
        (
            lambda data: data["stages"][0]["files"].update({"../escape": "0" * 64}),
            "must be relative",
        ),
        (lambda data: data["stages"][1]["layers"].update(end=29), "layers end at 29"),
    ],
)
def test_strict_parsing_names_the_problem(tmp_path: Path, mutate, expected: str) -> None:  # type: ignore[no-untyped-def]
    data = json.loads(fake_manifest(tmp_path).to_json())
    mutate(data)
    with pytest.raises(ManifestError, match=re.escape(expected)):
        Manifest.from_dict(data)


def test_missing_and_corrupt_manifest_files(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="manifest.json: missing"):
        load_manifest(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        load_manifest(tmp_path)


def test_hash_mismatch_and_missing_file(tmp_path: Path) -> None:
    manifest = fake_manifest(tmp_path)
    write_manifest(tmp_path, manifest)
    verify_stage(tmp_path, manifest, 0)
    (tmp_path / "stage_1" / "openvino_model.bin").write_text("tampered")
    with pytest.raises(
        ManifestError,
        match=r"^stage_1/openvino_model\.bin: SHA-256 mismatch \(expected \w{8}…, found \w{8}…\)$",
    ):
        verify_stage(tmp_path, manifest, 1)
    verify_stage(tmp_path, manifest, 0)
    (tmp_path / "stage_0" / "openvino_model.xml").unlink()
    with pytest.raises(ManifestError, match=r"^stage_0/openvino_model\.xml: missing"):
        verify_stage(tmp_path, manifest, 0)
    with pytest.raises(ManifestError, match="stage 5"):
        verify_stage(tmp_path, manifest, 5)


def test_layer_range_is_half_open() -> None:
    layers = LayerRange(10, 20)
    assert len(layers) == 10 and 10 in layers and 20 not in layers
    assert not layers.is_first and layers.is_last_of(20) and not layers.is_last_of(30)
    assert LayerRange(0, 1).is_first
    for start, end in ((5, 5), (-1, 3), (4, 2)):
        with pytest.raises(ManifestError):
            LayerRange(start, end)


def test_even_split_gives_the_remainder_to_early_stages() -> None:
    assert even_split(30, 1) == (LayerRange(0, 30),)
    assert even_split(30, 3) == (LayerRange(0, 10), LayerRange(10, 20), LayerRange(20, 30))
    assert [len(item) for item in even_split(30, 4)] == [8, 8, 7, 7]
    assert [len(item) for item in even_split(7, 7)] == [1] * 7
    for stages in (0, 31):
        with pytest.raises(ManifestError):
            even_split(30, stages)


def test_splits_must_cover_the_model() -> None:
    assert ranges_from_splits([0, 10, 30], 30) == (LayerRange(0, 10), LayerRange(10, 30))
    for splits in ([0, 10], [1, 30], [0, 20, 10, 30], [0, 10, 10, 30]):
        with pytest.raises(ManifestError):
            ranges_from_splits(splits, 30)


def test_a_boundary_may_cut_a_layer_between_its_attention_and_its_mlp(tmp_path: Path) -> None:
    ranges = ranges_from_splits([0, 13, 30], 30, mid_cuts=[13])
    assert ranges == (LayerRange(0, 13, ends_mid=True), LayerRange(13, 30, starts_mid=True))
    assert [str(item) for item in ranges] == ["[0, 12.5)", "[12.5, 30)"]
    assert len(ranges[0]) == 13  # the KV cache of layer 12 stays with its attention
    assert parse_boundary("12.5") == (13, True) and parse_boundary("13") == (13, False)
    assert format_boundary(13, True) == "12.5" and format_boundary(13, False) == "13"
    for text in ("12.25", "x", "-1", "3."):
        with pytest.raises(ManifestError, match="N.5 to cut inside layer N"):
            parse_boundary(text)
    for cuts in ([0], [30], [12]):  # only a boundary between two stages can cut a layer
        with pytest.raises(ManifestError, match="not a boundary between two stages"):
            ranges_from_splits([0, 13, 30], 30, mid_cuts=cuts)
    with pytest.raises(ManifestError, match="cannot start mid layer"):
        LayerRange(0, 3, starts_mid=True)
    with pytest.raises(ManifestError, match="expected true or false"):
        LayerRange(1, 3, starts_mid=1)  # type: ignore[arg-type]
    # the manifest keeps the cut (and old manifests without the keys still load as whole layers)
    manifest = fake_manifest(tmp_path)
    whole = json.loads(manifest.to_json())
    for stage in whole["stages"]:
        del stage["layers"]["starts_mid"], stage["layers"]["ends_mid"]
    assert Manifest.from_dict(whole).stages == manifest.stages and manifest.mid_cuts == ()
    data = json.loads(manifest.to_json())
    data["stages"][0]["layers"]["ends_mid"] = True
    with pytest.raises(
        ManifestError, match=r"stages\[1\]\.layers: \[16, 30\) does not meet the stage before it"
    ):
        Manifest.from_dict(data)
    data["stages"][1]["layers"]["starts_mid"] = True
    assert Manifest.from_dict(data).mid_cuts == (16,)
    assert str(Manifest.from_dict(data).stages[1].layers) == "[15.5, 30)"
    data["stages"][1]["layers"]["ends_mid"] = True
    with pytest.raises(ManifestError, match="the last stage cannot end mid layer"):
        Manifest.from_dict(data)


def test_stage_tensors_are_plain_json(tmp_path: Path) -> None:
    data = json.loads(fake_manifest(tmp_path).to_json())
    stage = data["stages"][1]
    assert stage["layers"] == {"start": 16, "end": 30, "starts_mid": False, "ends_mid": False}
    assert stage["inputs"][0] == {
        "name": "hidden_states",
        "dtype": "f32",
        "shape": [1, "n", 576],
        "meaning": "hidden",
    }
    assert replace(fake_manifest(tmp_path), pad_token_id=2).pad_token_id == 2


def test_a_stage_checked_before_is_not_hashed_again_until_a_file_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart skips the SHA-256 of files unchanged since their check (several seconds a stage on
    a large model); any write, even one that keeps the size and sets the modification time back, is
    hashed again."""
    import os

    from remote_worker import manifest as module

    manifest = fake_manifest(tmp_path)
    write_manifest(tmp_path, manifest)
    files = len(manifest.stages[1].files)
    assert verify_stage(tmp_path, manifest, 1) == files  # the first check hashes every file
    assert (tmp_path / module.VERIFIED_FOLDER / "stage_1.json").is_file()
    hashed: list[Path] = []
    real = module.sha256_file
    monkeypatch.setattr(module, "sha256_file", lambda path: hashed.append(path) or real(path))
    assert verify_stage(tmp_path, manifest, 1) == 0 and hashed == []
    # without the stamp: every file
    assert verify_stage(tmp_path, manifest, 1, stamp=False) == files

    weights = tmp_path / "stage_1" / "openvino_model.bin"
    before = weights.stat()
    weights.write_bytes(bytes(len(weights.read_bytes())))  # same size, other bytes ...
    # ... and the old modification time
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(ManifestError, match=r"^stage_1/openvino_model\.bin: SHA-256 mismatch"):
        verify_stage(tmp_path, manifest, 1)
    with pytest.raises(ManifestError, match="SHA-256 mismatch"):  # a failed check is never stamped
        verify_stage(tmp_path, manifest, 1)


def test_an_unreadable_or_unwritable_stamp_only_costs_the_hashes(tmp_path: Path) -> None:
    from remote_worker import manifest as module

    manifest = fake_manifest(tmp_path)
    write_manifest(tmp_path, manifest)
    files = len(manifest.stages[0].files)
    stamp = tmp_path / module.VERIFIED_FOLDER / "stage_0.json"
    stamp.parent.mkdir()
    for garbage in (
        "{not json",
        '{"format": 99, "files": {}}',
        '["a list"]',
        '{"format": 1, "files": 3}',
    ):
        stamp.write_text(garbage)
        assert verify_stage(tmp_path, manifest, 0) == files
        assert verify_stage(tmp_path, manifest, 0) == 0  # rewritten as a valid stamp
    stamp.unlink()
    stamp.mkdir()  # cannot be replaced by a file: verified every time, nothing left behind
    assert verify_stage(tmp_path, manifest, 0) == files
    assert verify_stage(tmp_path, manifest, 0) == files
    assert [p.name for p in stamp.parent.iterdir()] == ["stage_0.json"]


def test_the_whole_shard_checked_before_is_not_hashed_again(tmp_path: Path) -> None:
    """The compiler's cache check (`verify_all`, at every fleet start) uses the stamps too, the
    tokenizer's files included; a file changed since is hashed again and refused."""
    manifest = fake_manifest(tmp_path)
    write_manifest(tmp_path, manifest)
    files = len(manifest.shared_files) + sum(len(stage.files) for stage in manifest.stages)
    assert verify_all(tmp_path, manifest, stamp=True) == files
    assert verify_all(tmp_path, manifest, stamp=True) == 0
    assert verify_all(tmp_path, manifest) == files  # without stamps: every file, as before
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("[]")  # same size, other bytes
    with pytest.raises(ManifestError, match=r"^tokenizer/tokenizer\.json: SHA-256 mismatch"):
        verify_all(tmp_path, manifest, stamp=True)


def test_a_check_that_trusts_no_stamp_finds_bit_rot_it_cannot_see(tmp_path: Path) -> None:
    """`deploy --recheck`: bytes that rot without a write leave the stamp's record true; a check
    that trusts no stamp reads every file again, refuses the rotten one, and stamps what it found
    intact."""
    from remote_worker.manifest import VERIFIED_FOLDER
    from tests.support.manifests import rot_behind_the_stamp

    manifest = fake_manifest(tmp_path)
    write_manifest(tmp_path, manifest)
    files = len(manifest.stages[1].files)
    assert verify_stage(tmp_path, manifest, 1) == files
    assert verify_stage(tmp_path, manifest, 1, trust=False) == files  # every file, stamp or not
    assert verify_stage(tmp_path, manifest, 1) == 0  # ... and stamped again
    rot_behind_the_stamp(
        tmp_path, "stage_1/openvino_model.bin", tmp_path / VERIFIED_FOLDER / "stage_1.json"
    )
    assert verify_stage(tmp_path, manifest, 1) == 0  # what the stamp cannot see
    with pytest.raises(ManifestError, match=r"^stage_1/openvino_model\.bin: SHA-256 mismatch"):
        verify_stage(tmp_path, manifest, 1, trust=False)
