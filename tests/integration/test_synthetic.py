"""Tests of synthetic models: a real architecture's shape with seeded random weights, compiled and
run like a real model through real ZeroMQ workers, labelled synthetic, refused for chat."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fleettui.config.fleet import DEFAULT_FLEET, Host, load_fleet
from fleettui.control.controller import FleetController, with_overrides
from fleettui.control.deployment import free_port_block
from fleettui.errors import PlanError
from fleettui.model.builtin import shape_for_model
from fleettui.model.shape import SYNTHETIC_SHAPES, ModelShape, synthetic_shape
from fleettui.planning.planner import plan_fleet
from fleettui.runtime.generation import GenerationParams
from remote_worker.manifest import Manifest, load_manifest
from shard_compiler import synthetic
from shard_compiler.sources import CompileError, resolve

ROOT = Path(__file__).resolve().parents[2]
MODEL = "synthetic:llama-tiny"


def test_planner_shapes_match_the_compiler_configs() -> None:
    assert set(SYNTHETIC_SHAPES) == set(synthetic.ARCHITECTURES)
    for name, shape in SYNTHETIC_SHAPES.items():
        from_config = ModelShape.from_config(synthetic.config(f"synthetic:{name}"), name=name)
        assert from_config == replace(shape, name=name)


def test_names_and_layer_override() -> None:
    shape = shape_for_model("synthetic:llama-3.2-1b@4")
    assert (
        shape is not None
        and shape.num_layers == 4
        and shape.hidden == 2048
        and shape.vocab == 128256
    )
    assert synthetic_shape("synthetic:llama-3.1-8b").num_layers == 32
    assert synthetic.config("synthetic:llama-3.1-8b@3")["num_hidden_layers"] == 3
    assert resolve("synthetic:llama-3.2-1b@4").name == "synthetic-llama-3.2-1b-l4"
    for bad in ("synthetic:llama-9", "synthetic:llama-tiny@0", "synthetic:llama-tiny@5"):
        with pytest.raises(PlanError):
            synthetic_shape(bad)
        with pytest.raises(CompileError):
            resolve(bad)


def test_weights_are_seeded_and_shaped() -> None:
    weights = synthetic.SyntheticWeights(synthetic.config(MODEL))
    first = weights.get("model.layers.1.mlp.up_proj.weight")
    assert tuple(first.shape) == (768, 256)
    assert np.array_equal(first.numpy(), weights.get("model.layers.1.mlp.up_proj.weight").numpy())
    assert not np.array_equal(
        first.numpy(), weights.get("model.layers.2.mlp.up_proj.weight").numpy()
    )
    assert "lm_head.weight" in weights and "model.layers.4.mlp.up_proj.weight" not in weights


def test_manifest_without_the_synthetic_key_still_loads(tmp_path: Path) -> None:
    from tests.support.manifests import fake_manifest

    manifest = fake_manifest(tmp_path)
    data = manifest.to_dict()
    assert data["synthetic"] is False
    del data["synthetic"]
    assert Manifest.from_dict(data).synthetic is False
    data["synthetic"] = "yes"
    with pytest.raises(Exception, match="synthetic"):
        Manifest.from_dict(data)


def _fleet(cache: Path, stages: int):  # type: ignore[no-untyped-def]
    base = load_fleet(DEFAULT_FLEET)
    hosts = tuple(Host(name=f"stage-{i}", base_port=free_port_block()) for i in range(stages))
    fleet = replace(base, hosts=hosts, model=replace(base.model, name=MODEL, shards=cache))
    return with_overrides(fleet, exact=True, draft="none")


async def _generate(cache: Path, stages: int, prompt: list[int]) -> tuple[list[int], object, str]:
    controller = FleetController(_fleet(cache, stages))
    try:
        coordinator = await controller.start()
        session = await coordinator.open_session()
        generation = await coordinator.generate(
            session, prompt, GenerationParams(max_tokens=24, ignore_eos=True)
        )
        with pytest.raises(RuntimeError) as refused:
            await coordinator.chat(session, "hello", GenerationParams(max_tokens=4))
        assert controller.target is not None
        return list(generation.token_ids), controller.target.manifest, str(refused.value)
    finally:
        await controller.stop()


@pytest.mark.slow
def test_two_stage_synthetic_pipeline_equals_one_stage(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    cache = tmp_path_factory.mktemp("synthetic-cache")
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, 4096, 40)]
    one, manifest_one, refusal = asyncio.run(_generate(cache, 1, prompt))
    two, manifest_two, _ = asyncio.run(_generate(cache, 2, prompt))
    assert len(one) == 24 and two == one
    assert len(set(one)) > 1  # random weights still give a varied, deterministic continuation
    assert manifest_one.synthetic and manifest_two.synthetic  # type: ignore[attr-defined]
    assert len(manifest_two.stages) == 2 and manifest_two.tokenizer == ""  # type: ignore[attr-defined]
    assert "synthetic" in refusal and "\n" not in refusal
    shards = [p for p in (cache / "shards").iterdir() if (p / "manifest.json").is_file()]
    assert all(json.loads((p / "manifest.json").read_text())["synthetic"] is True for p in shards)
    assert all(load_manifest(p).model_name == "synthetic-llama-tiny" for p in shards)


def test_plan_and_ask_on_a_synthetic_model(tmp_path: Path) -> None:
    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text(
        '[model]\nname = "synthetic:llama-3.2-1b@4"\n[[hosts]]\nname = "a"\n[[hosts]]\nname = "b"\n'
    )
    planned = plan_fleet(load_fleet(fleet_file))
    assert sum(stage.count for stage in planned.stages) == 4
    done = subprocess.run(
        [sys.executable, "-m", "fleettui", str(fleet_file), "--ask", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "synthetic" in lines[0] and "not chat" in lines[0]
    for command in (
        ["serve", str(fleet_file), "--port", "0"],
        ["tui", str(fleet_file)],
    ):  # nor served
        refused = subprocess.run(
            [sys.executable, "-m", "fleettui", *command],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert (
            refused.returncode == 2
            and "not chat" in refused.stderr
            and len(refused.stderr.splitlines()) == 1
        )
    shown = subprocess.run(
        [sys.executable, "-m", "fleettui", "plan", str(fleet_file)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert shown.returncode == 0 and "synthetic" in shown.stdout


@pytest.mark.slow
def test_startup_first_answers_run_on_a_synthetic_model(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`bench --startup` asks a fresh fleet twice in token ids, so a model with no tokenizer is
    measured too (it once asked in chat and died with a traceback on the 1B shape)."""
    from fleettui.bench.startup import _first_answers
    from fleettui.control.running import run

    fleet = _fleet(tmp_path_factory.mktemp("synthetic-startup"), 2)
    first, following = run(lambda: _first_answers(fleet))
    assert first > 0 and following > 0
