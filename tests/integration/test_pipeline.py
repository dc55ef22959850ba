"""Integration tests of the runtime with the real parts: real shards of the real model, real ZeroMQ
stage processes, exact arithmetic settings (fp32 weights, f32 inference, f32 KV cache, f32 wire).

Every pipeline — any number of stages, speculation on or off, any number of interleaved users — must
give greedy tokens identical to the unsplit model."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from fleettui.config.fleet import DEFAULT_FLEET, Fleet, Host, load_fleet
from fleettui.config.local_cores import share_local_cores
from fleettui.control.controller import FleetController, with_overrides
from fleettui.control.deployment import free_port_block
from fleettui.planning.planner import plan_fleet
from fleettui.runtime.generation import GenerationParams

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TOKENS = 48
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip, briefly.",
]


def make_fleet(
    cache: Path, stages: int, draft: str, k: int | str = "auto", encryption: str = "curve"
) -> Fleet:
    base = load_fleet(DEFAULT_FLEET)
    hosts = tuple(Host(name=f"stage-{i}", base_port=free_port_block()) for i in range(stages))
    fleet = replace(
        base,
        hosts=hosts,
        model=replace(base.model, shards=cache),
        runtime=replace(base.runtime, encryption=encryption),
    )
    fleet = with_overrides(fleet, exact=True, draft=draft)
    return replace(fleet, speculation=replace(fleet.speculation, k=k))


async def run_prompts(
    fleet: Fleet, prompts: list[str], interleaved: bool
) -> tuple[list[list[int]], dict]:
    controller = FleetController(fleet)
    try:
        coordinator = await controller.start()
        sessions = [await coordinator.open_session() for _ in prompts]
        params = GenerationParams(max_tokens=TOKENS)
        calls = [coordinator.chat(s, p, params) for s, p in zip(sessions, prompts, strict=False)]
        if interleaved:
            generations = await asyncio.gather(*calls)
        else:
            generations = [await call for call in calls]
        pids = list(controller.worker_pids().values())
        info = {
            "pids": pids,
            "stats": [g.stats for g in generations],
            "texts": [g.text for g in generations],
        }
        info["spans"] = [str(stage.layers) for stage in controller.target.manifest.stages]  # type: ignore[union-attr]
        return [list(g.token_ids) for g in generations], info
    finally:
        await controller.stop()


@pytest.fixture(scope="session")
def reference(shard_cache: Path) -> list[list[int]]:
    """Greedy tokens of the unsplit model in this process (no fleet, no worker, no coordinator)."""
    from shard_compiler.compiler import compile_shards
    from tests.support.shards import ChainRunner, chat_ids

    unsplit = compile_shards(
        "smollm2-135m-instruct", stages=1, precision="fp32", cache_root=shard_cache
    )
    runner = ChainRunner(unsplit, exact=True)
    return [
        runner.greedy(chat_ids(unsplit, prompt), TOKENS, stop_at_eos=True) for prompt in PROMPTS
    ]


@pytest.mark.parametrize(
    ("stages", "draft", "k", "users"),
    [
        # one stage: the worker generates in runs (its tokens fed back by itself)
        (
            1,
            "none",
            "auto",
            1,
        ),
        (1, "none", "auto", 3),
        (1, "prompt-lookup", "auto", 2),  # runs between speculative rounds
        (2, "none", "auto", 3),
        (3, "none", "auto", 1),
        (3, "self-int4", 3, 3),
        (2, "self-int4", "auto", 1),
        (2, "prompt-lookup", 4, 3),
    ],
)
def test_exact_pipeline_matches_unsplit_model(
    shard_cache: Path, reference: list[list[int]], stages: int, draft: str, k: int | str, users: int
) -> None:
    fleet = make_fleet(shard_cache, stages, draft, k)
    tokens, info = asyncio.run(run_prompts(fleet, PROMPTS[:users], interleaved=users > 1))
    assert tokens == reference[:users]
    if draft == "self-int4" and k == 3:
        stats = info["stats"]
        assert sum(s.drafted for s in stats) > 0
        assert 0 < sum(s.accepted for s in stats) <= sum(s.drafted for s in stats)
    for pid in info["pids"]:  # clean shutdown: every worker process is gone
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize(
    ("stages", "draft", "k", "users", "spans"),
    [
        (2, "none", "auto", 3, ["[0, 18.5)", "[18.5, 30)"]),
        (3, "self-int4", 3, 2, ["[0, 12.5)", "[12.5, 25)", "[25, 30)"]),
    ],
)
def test_stages_cut_inside_a_layer_match_the_unsplit_model(
    shard_cache: Path,
    reference: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    stages: int,
    draft: str,
    k: int | str,
    users: int,
    spans: list[str],
) -> None:
    """Measured costs under which whole layers balance badly (a head worth 7 layers): the planner
    cuts a layer between its attention and its MLP, and the deployed pipeline still gives the
    unsplit model's tokens."""
    from fleettui.planning import profiles
    from fleettui.planning.costs import MeasuredCosts

    costs = MeasuredCosts(layer_ms=0.3, head_ms=2.1, call_ms=0.2)
    monkeypatch.setattr(profiles, "fleet_costs", lambda fleet, **_: [costs] * len(fleet.hosts))
    fleet = make_fleet(shard_cache, stages, draft, k)
    fleet = replace(fleet, resilience=replace(fleet.resilience, calibrate="off"))
    tokens, info = asyncio.run(run_prompts(fleet, PROMPTS[:users], interleaved=users > 1))
    assert info["spans"] == spans
    assert tokens == reference[:users]
    if draft == "self-int4":
        assert sum(s.accepted for s in info["stats"]) > 0


def test_a_long_prompt_prefilled_with_chunks_in_flight_is_exact(shard_cache: Path) -> None:
    """A ~900-token prompt goes down 3 stages as 7 unscored chunks, up to one per stage in flight,
    beside a short one of another user: both answers are the unsplit model's greedy tokens."""
    from shard_compiler.compiler import compile_shards
    from tests.support.shards import ChainRunner, chat_ids

    facts = ". ".join(
        f"Fact {index}: the {index}th lamp is {('red', 'green', 'blue')[index % 3]}"
        for index in range(90)
    )
    prompts = [f"{facts}. Which colour is the 40th lamp?", PROMPTS[0]]
    unsplit = compile_shards(
        "smollm2-135m-instruct", stages=1, precision="fp32", cache_root=shard_cache
    )
    runner = ChainRunner(unsplit, exact=True)
    expected = []
    for prompt in prompts:
        runner.reset()
        expected.append(runner.greedy(chat_ids(unsplit, prompt), TOKENS, stop_at_eos=True))
    assert len(chat_ids(unsplit, prompts[0])) > 800
    tokens, _ = asyncio.run(
        run_prompts(make_fleet(shard_cache, 3, "none"), prompts, interleaved=True)
    )
    assert tokens == expected


def test_plaintext_links_work_and_match(shard_cache: Path, reference: list[list[int]]) -> None:
    fleet = make_fleet(shard_cache, 2, "none", encryption="plaintext")
    tokens, _ = asyncio.run(run_prompts(fleet, PROMPTS[:1], interleaved=False))
    assert tokens == reference[:1]


def test_ask_cli_json_gives_the_unsplit_tokens(
    shard_cache: Path, reference: list[list[int]], tmp_path: Path
) -> None:
    fleet_file = tmp_path / "fleet.toml"
    ports = [free_port_block(), free_port_block()]
    fleet_file.write_text(
        f'[model]\nname = "smollm2-135m-instruct"\nprecision = "int4"\nshards = "{shard_cache}"\n'
        '[speculation]\ndraft = "self-int4"\nk = 2\n'
        f'[[hosts]]\nname = "a"\nbase_port = {ports[0]}\n[[hosts]]\nname = "b"\nbase_port = '
        f"{ports[1]}\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fleettui",
            str(fleet_file),
            "--ask",
            PROMPTS[0],
            "--exact",
            "--json",
            "--max-tokens",
            str(TOKENS),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["token_ids"] == reference[0]
    # as the controller plans it: --exact (fp32 weights), local stages on their own CPUs, whose
    # costs the deploy measured when this machine had no profile for them
    planned = plan_fleet(
        share_local_cores(with_overrides(load_fleet(fleet_file), exact=True))
    ).ranges
    assert document["fleet"]["stages"] == [list(r) for r in planned] and len(planned) == 2
    assert document["fleet"]["exact"] is True
    assert "Paris" in document["text"]


def test_bad_fleet_file_is_one_line_and_exit_2(tmp_path: Path) -> None:
    fleet_file = tmp_path / "broken.toml"
    fleet_file.write_text(
        '[model]\nname = "smollm2-135m-instruct"\nprecison = "int4"\n[[hosts]]\nname = "a"\n'
    )
    result = subprocess.run(
        [sys.executable, "-m", "fleettui", str(fleet_file), "--ask", "hi"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "broken.toml:3" in lines[0] and "precison" in lines[0]


def test_ask_reads_the_prompt_from_stdin_after_a_system_message(
    shard_cache: Path, tmp_path: Path
) -> None:
    """`--ask -` reads stdin and `--system` comes first in the chat template: the unsplit model's
    greedy tokens."""
    from fleettui.runtime.chat_format import compile_template, render_template
    from remote_worker.manifest import load_manifest
    from shard_compiler.compiler import compile_shards
    from tests.support.shards import ChainRunner

    system, prompt = "You answer in French.", "What is the capital of Italy?\nOne word."
    unsplit = compile_shards(
        "smollm2-135m-instruct", stages=1, precision="fp32", cache_root=shard_cache
    )
    manifest = load_manifest(unsplit)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    text = render_template(compile_template(manifest.chat_template), messages, True)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(unsplit / manifest.tokenizer / "tokenizer.json"))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    expected = ChainRunner(unsplit, exact=True).greedy(ids, 16, stop_at_eos=True)
    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text(
        f'[model]\nname = "smollm2-135m-instruct"\nshards = "{shard_cache}"\n[speculation]\ndraft '
        '= "none"\n'
        f'[[hosts]]\nname = "a"\nbase_port = {free_port_block()}\n'
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fleettui",
            str(fleet_file),
            "--ask",
            "-",
            "--system",
            system,
            "--exact",
            "--json",
            "--max-tokens",
            "16",
        ],
        input=prompt + "\n",
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["prompt_tokens"] == len(ids)
    assert document["token_ids"] == expected
    # not a terminal: progress as plain lines on stderr (the first ask compiles for over a minute)
    progress = result.stderr.splitlines()
    assert any(line.startswith("compile shards: done ") for line in progress), result.stderr
    assert any(line.startswith("start workers: done 1/1") for line in progress), result.stderr


def test_drafting_ahead_over_slow_hops_is_exact(
    shard_cache: Path, reference: list[list[int]]
) -> None:
    """200 ms per hop (the bench's user-space delay proxies on every data link): the next round's
    draft is proposed, and its verify sent behind the round in flight, while a round crosses the
    wires; it becomes the next round when the round accepted it all. The draft is the unsplit fp32
    model (it agrees with the target, so rounds ahead are taken); two interleaved users still get
    the unsplit model's greedy tokens. (At 80 ms a hop a CI machine without bf16, its two cores
    shared by both stages and the fp32 draft, drafted at 125 ms a token: K + 1 = 4 drafts did not
    fit in the 0.25 s the wires were idle, so none was started ahead. The delay is what makes
    drafting ahead pay, so it is the test's premise, not its speed.)"""
    from fleettui.bench.hop_delay import HopDelay
    from shard_compiler.compiler import compile_shards

    unsplit = compile_shards(
        "smollm2-135m-instruct", stages=1, precision="fp32", cache_root=shard_cache
    )
    fleet = make_fleet(shard_cache, 2, str(unsplit), 3)

    async def run() -> tuple[list[list[int]], dict[str, int], str]:
        controller = FleetController(fleet)
        with HopDelay(200) as hops:
            try:
                coordinator = await controller.start(endpoint_map=hops, attach=False, record=False)
                sessions = [await coordinator.open_session() for _ in PROMPTS[1:]]
                params = GenerationParams(max_tokens=TOKENS)
                generations = await asyncio.gather(
                    *(
                        coordinator.chat(s, p, params)
                        for s, p in zip(sessions, PROMPTS[1:], strict=True)
                    )
                )
                counts = dataclasses.asdict(coordinator.ahead_counts)
                seen = (
                    f"{counts}, draft {coordinator.ahead_cost.per_token} s a token, wires idle "
                    f"{coordinator.wire_idle} s"
                )
            finally:
                await controller.stop()
        return [list(g.token_ids) for g in generations], counts, seen

    tokens, counts, seen = asyncio.run(run())
    assert tokens == reference[1:]
    assert counts["pipelined"] > 0, seen


def test_runs_cut_short_for_prompt_lookup_are_exact(shard_cache: Path) -> None:
    """A reply that repeats itself: the 2-stage pipeline generates in runs, the runs are watched for
    prompt lookup, cut short where its drafts are worth a verify, and the tokens made until the
    Cancel's Ack are read as the reply's own. Greedy output still equals the unsplit model's."""
    from shard_compiler.compiler import compile_shards
    from tests.support.shards import ChainRunner, chat_ids

    prompt, count = "Repeat this line five times: the quick brown fox jumps over the lazy dog.", 96
    unsplit = compile_shards(
        "smollm2-135m-instruct", stages=1, precision="fp32", cache_root=shard_cache
    )
    expected = ChainRunner(unsplit, exact=True).greedy(
        chat_ids(unsplit, prompt), count, stop_at_eos=True
    )
    fleet = make_fleet(shard_cache, 2, "prompt-lookup", "auto")

    async def run() -> tuple[list[int], int, int]:
        controller = FleetController(fleet)
        try:
            coordinator = await controller.start()
            session = await coordinator.open_session()
            generation = await coordinator.chat(session, prompt, GenerationParams(max_tokens=count))
            return list(generation.token_ids), generation.stats.accepted, coordinator.runs_cut
        finally:
            await controller.stop()

    tokens, accepted, cut = asyncio.run(run())
    assert tokens == expected
    assert cut > 0 and accepted > 0, (cut, accepted)
