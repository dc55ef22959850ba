"""Provides the `fleettui` command: the TUI by default, or headless ask / plan / bench / deploy / stop."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

from fleettui.errors import FleetError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleettui",
        description="Run a large language model on a fleet of ordinary PCs: deploy, monitor and chat.",
    )
    parser.add_argument("fleet", nargs="?", help="fleet TOML file (default: the embedded fleets/local.toml)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--ask", metavar="QUESTION", help="answer one prompt headless through the whole fleet")
    mode.add_argument(
        "--plan", action="store_true", help="show the stage plan (layer ranges, memory) and exit"
    )
    mode.add_argument("--bench", action="store_true", help="measure the fleet against one PC, headless")
    mode.add_argument(
        "--deploy", action="store_true", help="deploy the fleet (SSH hosts too) and leave it running"
    )
    mode.add_argument("--stop", action="store_true", help="stop what the last --deploy started")
    parser.add_argument("--max-tokens", type=int, help="stop after this many new tokens")
    spec = parser.add_mutually_exclusive_group()
    spec.add_argument("--spec-k", type=int, metavar="K", help="speculate K tokens per verify (0..16)")
    spec.add_argument("--no-spec", action="store_true", help="no speculative decoding")
    parser.add_argument("--draft", help="draft override: self-int4 | prompt-lookup | none | PATH")
    parser.add_argument("--temperature", type=float, help="0 = greedy (default from the fleet file)")
    parser.add_argument("--top-p", type=float, help="nucleus sampling threshold")
    parser.add_argument("--seed", type=int, help="sampling seed")
    parser.add_argument(
        "--exact",
        action="store_true",
        help="exact arithmetic: fp32 weights, f32 inference and f32 KV cache on every stage and the draft",
    )
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="FILE",
        help="print JSON (token_ids, stats) instead of text; with --bench, write the rows to FILE",
    )
    parser.add_argument("--quick", action="store_true", help="with --bench: the small smoke-test profile")
    parser.add_argument(
        "--model-config", type=Path, help="with --plan: a Hugging Face config.json to plan for"
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="log to stderr")
    # -- perf (issue 12): one bench group; plan from measured costs --------------------------------
    parser.add_argument(
        "--only",
        metavar="GROUP",
        help="with --bench: one group (anchors, fleet, spec, delay, pcs, scale) and the rows it is paired with",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="with --plan: calibrate the local hosts (cached) and show measured vs predicted per stage",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:  # `fleettui plan FLEET` reads better than `fleettui FLEET --plan`
        argv = [*argv[1:], "--plan"]
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        from fleettui.config.fleet import load_fleet, resolve_fleet

        fleet = load_fleet(resolve_fleet(args.fleet))
        if args.spec_k is not None and not 0 <= args.spec_k <= 16:
            raise FleetError(f"--spec-k: {args.spec_k} is out of range 0..16")
        if args.plan:
            return _plan(fleet, args)
        if args.ask is not None:
            if fleet.model.name.startswith("synthetic:"):  # perf: refuse before compiling anything
                from fleettui.control.controller import SYNTHETIC_REFUSAL

                raise FleetError(SYNTHETIC_REFUSAL.format(model=fleet.model.name))
            return asyncio.run(_ask(fleet, args))
        if args.bench:
            from fleettui.bench.runner import run_bench_cli

            return run_bench_cli(fleet, args)
        if args.deploy or args.stop:
            from fleettui.provision.cli import run_provision_cli

            return run_provision_cli(fleet, args)
        from fleettui.ui.app import run_app

        return run_app(fleet, args)
    except FleetError as error:
        print(f"fleettui: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fleettui: interrupted", file=sys.stderr)
        return 130


def _plan(fleet, args) -> int:  # type: ignore[no-untyped-def]
    from fleettui.planning.planner import format_plan, plan_fleet
    from fleettui.planning.shape import ModelShape

    shape = ModelShape.from_config_file(args.model_config) if args.model_config else None
    if getattr(args, "profile", False):  # perf: measured costs
        from fleettui.planning.plan_profile import run_plan_profile

        return run_plan_profile(fleet, shape)
    print(format_plan(plan_fleet(fleet, shape)))
    return 0


async def _ask(fleet, args) -> int:  # type: ignore[no-untyped-def]
    from fleettui.control.controller import (
        ControllerError,
        FleetController,
        generation_params,
        with_overrides,
    )

    draft = "none" if args.no_spec else args.draft
    fleet = with_overrides(fleet, exact=args.exact, draft=draft, k=args.spec_k)
    params = generation_params(
        fleet, args.max_tokens, args.temperature, args.top_p, args.seed, args.no_spec, args.spec_k
    )
    controller = FleetController(fleet)
    streaming = args.json is None and sys.stdout.isatty()

    def show(_tokens: list[int], delta: str) -> None:
        if streaming and delta:
            print(delta, end="", flush=True)

    try:
        generation = await controller.ask(args.ask, params, show)
    except ControllerError as error:
        print(f"fleettui: {error}", file=sys.stderr)
        return 1
    finally:
        await controller.stop()
    stats = generation.stats
    if args.json is not None:
        assert controller.target is not None
        manifest = controller.target.manifest
        document = {
            "text": generation.text,
            "token_ids": list(generation.token_ids),
            "prompt_tokens": stats.prompt_tokens,
            "stats": {
                "tokens": stats.tokens,
                "seconds": round(stats.seconds, 4),
                "tokens_per_second": round(stats.tokens_per_second, 2),
                "ttft_s": round(stats.ttft, 4),
                "rounds": stats.rounds,
                "drafted": stats.drafted,
                "accepted": stats.accepted,
                "acceptance_rate": stats.acceptance_rate,
                "mean_k": round(stats.mean_k, 2),
                "finish_reason": stats.finish_reason,
            },
            "fleet": {
                "stages": [[s.layers.start, s.layers.end] for s in manifest.stages],
                "precision": manifest.precision,
                "exact": fleet.runtime.exact,
                "draft": fleet.speculation.draft,
                "encryption": fleet.runtime.encryption,
            },
        }
        text = json.dumps(document, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")  # noqa: ASYNC240 - once, after the fleet has stopped
        return 0
    if streaming:
        print()
    else:
        print(generation.text)
    rate = stats.acceptance_rate
    print(
        f"[{stats.tokens} tokens, {stats.tokens_per_second:.1f} tok/s, first token {stats.ttft * 1000:.0f} ms, "
        f"acceptance {'n/a' if rate is None else f'{rate:.0%}'}, mean K {stats.mean_k:.1f}]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
