"""Provides the per-hop overhead budget: a 1-stage fleet against the in-process engine on the same
IR.

    python -m fleettui.bench.hop_budget [MODEL] [--tokens 300] [--rounds 3] [--shards DIR]

Interleaved rounds (fleet, then `remote_worker.mono` on the very shard the fleet serves), decode ms
per token after the first token for each, their difference (what one hop — ZeroMQ, CURVE, asyncio,
the worker's Python path — adds per token) and the coordinator process's own CPU ms per token. MODEL
defaults to the synthetic tiny Llama, where fixed overhead dominates compute; any model name the
fleet file takes works."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

PROMPT = list(range(3, 43))


async def measure(
    model: str, tokens: int, rounds: int, shards: Path | None
) -> list[dict[str, float]]:
    from fleettui.bench.baseline import run_children
    from fleettui.config.fleet import DEFAULT_FLEET, Host, load_fleet
    from fleettui.control.controller import FleetController
    from fleettui.control.deployment import free_port_block
    from fleettui.errors import child_failure
    from fleettui.runtime.generation import GenerationParams

    base = load_fleet(DEFAULT_FLEET)
    fleet = replace(
        base,
        hosts=(Host(name="hop", base_port=free_port_block()),),
        model=replace(base.model, name=model, shards=shards or base.model.shards),
        speculation=replace(base.speculation, draft="none"),
    )
    controller = FleetController(fleet)  # its run and log folders go with stop()
    results = []
    try:
        coordinator = await controller.start(attach=False, record=False)
        assert controller.target is not None
        shard = str(controller.target.directory)
        params = GenerationParams(max_tokens=tokens, ignore_eos=True, spec_k=0)
        warm = await coordinator.open_session()
        await coordinator.generate(warm, PROMPT, replace(params, max_tokens=16))
        await coordinator.close_session(warm)
        for _ in range(rounds):
            session = await coordinator.open_session()
            started, cpu = time.perf_counter(), os.times()
            generation = await coordinator.generate(session, PROMPT, params)
            wall, after = time.perf_counter() - started, os.times()
            await coordinator.close_session(session)
            count = len(generation.token_ids)
            command = [
                sys.executable,
                "-m",
                "remote_worker.mono",
                "--shard",
                shard,
                "--prompt-ids",
                ",".join(map(str, PROMPT)),
                "--tokens",
                str(tokens),
                "--json",
            ]
            [(code, out, err)] = await run_children([command])  # killed with this task (a signal)
            if code != 0:
                raise RuntimeError(f"remote_worker.mono failed: {child_failure(err, code)}")
            mono = json.loads(out.strip().splitlines()[-1])
            fleet_ms = 1000 * (wall - generation.stats.ttft) / (count - 1)
            mono_ms = 1000 * (mono["seconds"] - mono["ttft_s"]) / (mono["tokens"] - 1)
            coordinator_ms = 1000 * ((after.user - cpu.user) + (after.system - cpu.system)) / count
            results.append(
                {
                    "fleet_ms": fleet_ms,
                    "mono_ms": mono_ms,
                    "extra_ms": fleet_ms - mono_ms,
                    "coordinator_cpu_ms": coordinator_ms,
                }
            )
            print(
                f"fleet {fleet_ms:.2f} ms/token (coordinator CPU {coordinator_ms:.2f}), in-process "
                f"{mono_ms:.2f}: "
                f"the hop adds {fleet_ms - mono_ms:+.2f} ms/token",
                flush=True,
            )
    finally:
        await controller.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    from fleettui.control.running import run as run_loop
    from fleettui.errors import Interrupted

    parser = argparse.ArgumentParser(
        prog="python -m fleettui.bench.hop_budget", description=__doc__.splitlines()[0]
    )
    parser.add_argument("model", nargs="?", default="synthetic:llama-tiny")
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shards", type=Path, help="shard cache root (default: the fleet's)")
    arguments = parser.parse_args(argv)
    try:  # a signal stops the fleet and the mono child before the exit
        results = run_loop(
            lambda: measure(arguments.model, arguments.tokens, arguments.rounds, arguments.shards)
        )
    except Interrupted as error:
        return error.code
    extra = sorted(r["extra_ms"] for r in results)
    print(
        f"median extra per token over {len(extra)} interleaved rounds: "
        f"{extra[len(extra) // 2]:+.2f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
