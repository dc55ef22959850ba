"""Chat sampling defaults: the model's recommendation when nothing is set, greedy under --exact,
overrides win."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from fleettui.config.fleet import load_fleet
from fleettui.config.recommended import GREEDY, model_key, recommended_sampling
from fleettui.control.settings import generation_params, with_overrides

HOST = '[[hosts]]\nname = "a"\n'


def fleet_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(text + HOST)
    return path


def test_model_names_of_one_model_share_a_key() -> None:
    for name in (
        "smollm2-135m-instruct",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "/models/SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct-f16.gguf",
    ):
        assert model_key(name) == "smollm2-135m-instruct", name
    smollm = recommended_sampling("HuggingFaceTB/SmolLM2-360M-Instruct")
    assert (smollm.temperature, smollm.top_p) == (0.2, 0.9)
    assert recommended_sampling("Qwen/Qwen2.5-0.5B-Instruct").top_k == 20
    assert recommended_sampling("llama-3.1-8b") == GREEDY  # a base model: no chat recommendation
    assert recommended_sampling("someone/unknown-model") == GREEDY


def test_a_model_folder_brings_its_own_generation_config(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 40})
    )
    found = recommended_sampling(str(folder))
    assert (found.temperature, found.top_p, found.top_k, found.repetition_penalty) == (
        0.6,
        0.95,
        40,
        1.0,
    )
    (folder / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.7, "repetition_penalty": 1.05})
    )
    assert recommended_sampling(str(folder)).repetition_penalty == 1.05
    (folder / "generation_config.json").write_text(
        json.dumps({"do_sample": False, "temperature": 0.6})
    )
    assert recommended_sampling(str(folder)) == GREEDY


def test_unset_sampling_takes_the_models_recommendation_with_a_fixed_seed(tmp_path: Path) -> None:
    fleet = load_fleet(fleet_file(tmp_path, ""))
    assert fleet.sessions.temperature is None and fleet.sessions.top_p is None
    params = generation_params(fleet)
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.2, 0.9, 0, 0)
    assert params.repetition_penalty == 1.1 and params.penalized  # the 135M model loops without it
    assert generation_params(fleet) == params  # reproducible: same seed every time


def test_exact_stays_greedy_unless_asked(tmp_path: Path) -> None:
    fleet = with_overrides(load_fleet(fleet_file(tmp_path, "")), exact=True)
    params = generation_params(fleet)
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 1.0, 0)
    assert not params.penalized  # exact greedy: no repetition penalty either
    assert generation_params(fleet, temperature=0.5).temperature == 0.5


def test_fleet_file_and_command_line_override_the_model(tmp_path: Path) -> None:
    fleet = load_fleet(fleet_file(tmp_path, "[sessions]\ntemperature = 0\nseed = 7\n"))
    params = generation_params(fleet)
    # greedy, as the file says
    assert (params.temperature, params.top_p, params.seed) == (
        0.0,
        1.0,
        7,
    )
    assert not params.penalized  # plain greedy: the model's penalty follows the model's temperature
    fleet = load_fleet(fleet_file(tmp_path, "[sessions]\ntop_p = 0.5\n"))
    assert (generation_params(fleet).temperature, generation_params(fleet).top_p) == (0.2, 0.5)
    assert generation_params(fleet, temperature=1.0, top_p=0.7, seed=3) == replace(
        generation_params(fleet),
        temperature=1.0,
        top_p=0.7,
        seed=3,
        top_k=0,
        repetition_penalty=1.0,
    )
