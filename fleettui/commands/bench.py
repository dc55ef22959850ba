"""Provides `fleettui bench FLEET`: measure the fleet against one PC, headless."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleettui.commands import options
from fleettui.control.running import run as run_loop
from fleettui.errors import FleetError

if TYPE_CHECKING:
    from fleettui.config.fleet import Fleet

NAME = "bench"
HELP = "measure the fleet against one PC, headless"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_fleet(parser)
    parser.add_argument("--quick", action="store_true", help="the small smoke-test profile")
    parser.add_argument(
        "--json", metavar="FILE", help="write the rows as JSON to FILE (- for stdout)"
    )
    parser.add_argument(
        "--exact", action="store_true", help="exact arithmetic (fp32, f32 inference and KV)"
    )
    spec = parser.add_mutually_exclusive_group()
    spec.add_argument(
        "--spec-k", type=int, metavar="K", help="speculate K tokens per verify (0..16)"
    )
    spec.add_argument("--no-spec", action="store_true", help="no speculative decoding")
    parser.add_argument("--max-tokens", type=int, help="tokens per user")
    parser.add_argument(
        "--rounds",
        type=int,
        metavar="N",
        help="interleaved rounds per group (full: 3, more for close pairs; quick: 1)",
    )
    parser.add_argument(
        "--only",
        metavar="GROUP",
        help="one group (anchors, fleet, spec, delay, pcs, scale, batch, grammar) and the rows it "
        "is paired with",
    )
    parser.add_argument(
        "--soak",
        type=float,
        nargs="?",
        const=600.0,
        metavar="SECONDS",
        help="soak test instead: exact answers for SECONDS (600) while a random worker is killed "
        "every minute",
    )
    parser.add_argument(
        "--kill-every", type=float, default=60.0, metavar="S", help="soak: seconds between kills"
    )
    parser.add_argument(
        "--rebalance",
        type=float,
        nargs="?",
        const=0.4,
        metavar="SHARE",
        help="tok/s before and after the last stage is held to SHARE of its CPU (0.4), then after "
        "auto rebalance",
    )
    parser.add_argument(
        "--startup",
        type=int,
        nargs="?",
        const=3,
        metavar="ROUNDS",
        help="each stage worker's start to ready, compile cache off / first start / restart, "
        "ROUNDS (3) rounds",
    )
    parser.add_argument(
        "--prefill",
        type=int,
        nargs="?",
        const=2000,
        metavar="TOKENS",
        help="a TOKENS-token prompt's first token, alone and beside a generating user, pipelined "
        "vs serial prefill",
    )


def run(args: argparse.Namespace) -> int:
    options.settings(args)  # validates --spec-k
    if args.soak is not None:
        return run_soak_cli(options.load(args), args)
    if args.rebalance is not None:
        return run_rebalance_cli(options.load(args), args)
    if args.startup is not None:
        return run_startup_cli(options.load(args), args)
    if args.prefill is not None:
        return run_prefill_cli(options.load(args), args)
    return run_bench_cli(options.load(args), args)


def run_soak_cli(fleet: Fleet, args: argparse.Namespace) -> int:
    """`fleettui bench FLEET --soak [SECONDS] [--kill-every S]`: exit 1 when any answer was lost
    or differed."""
    from fleettui.bench.soak import soak
    from fleettui.control.settings import with_overrides

    if args.soak <= 0 or args.kill_every <= 0:
        raise FleetError("--soak and --kill-every: seconds must be positive")
    fleet = with_overrides(fleet, exact=True, draft="none" if args.no_spec else None)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    report = run_loop(
        lambda: soak(
            fleet,
            args.soak,
            kill_every=args.kill_every,
            max_tokens=options.tokens(args, 48),
            on_line=say,
        )
    )
    print(report.summary())
    return 1 if report.errors or report.mismatches else 0


def run_rebalance_cli(fleet: Fleet, args: argparse.Namespace) -> int:
    """`fleettui bench FLEET --rebalance [SHARE]`: exit 1 when no better split was applied."""
    from fleettui.bench.rebalance_bench import rebalance_bench
    from fleettui.control.settings import with_overrides

    if not 0.05 <= args.rebalance < 1.0:
        raise FleetError(f"--rebalance: share {args.rebalance} must be in 0.05..0.99")
    fleet = with_overrides(fleet, exact=args.exact, draft="none" if args.no_spec else None)
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    try:
        report = run_loop(
            lambda: rebalance_bench(
                fleet, tokens=options.tokens(args, 64), share=args.rebalance, on_line=say
            )
        )
    except ValueError as error:
        raise FleetError(f"--rebalance: {error}") from None
    print(report.summary())
    return 0 if report.split_after else 1


def run_startup_cli(fleet: Fleet, args: argparse.Namespace) -> int:
    """`fleettui bench FLEET --startup [ROUNDS]`: exit 1 when a restart did not load its compiled
    model."""
    from fleettui.bench.startup import startup_bench

    if not 1 <= args.startup <= 20:
        raise FleetError(f"--startup: {args.startup} rounds, 1..20")
    report = _headless(
        fleet, args, lambda plain, say: startup_bench(plain, args.startup, on_line=say)
    )
    return 0 if all(start.from_cache for start in report.starts if start.mode == "again") else 1


def run_prefill_cli(fleet: Fleet, args: argparse.Namespace) -> int:
    """`fleettui bench FLEET --prefill [TOKENS]`: exit 1 when the arms' answers differ under
    --exact."""
    from fleettui.bench.prefill_bench import prefill_bench

    if not 200 <= args.prefill <= 16_000:
        raise FleetError(f"--prefill: {args.prefill} prompt tokens, 200..16000")
    report = _headless(
        fleet, args, lambda plain, say: prefill_bench(plain, args.prefill, on_line=say)
    )
    return 1 if args.exact and not report.same_tokens else 0


def _headless(
    fleet: Fleet, args: argparse.Namespace, measure: Callable[[Fleet, Callable[[str], None]], Any]
) -> Any:
    """Run one measurement on FLEET without speculation (`--exact` honoured), progress on stderr,
    and print its report's summary; returns the report."""
    from fleettui.control.settings import with_overrides

    plain = with_overrides(fleet, exact=args.exact, draft="none")
    report = run_loop(lambda: measure(plain, lambda line: print(line, file=sys.stderr, flush=True)))
    print(report.summary())
    return report


class Progress:
    """One line per row on stderr: `[i/n] name ... result`."""

    def __init__(self, total: int) -> None:
        from fleettui.commands.progress import ProgressReporter

        self.total = total
        self.index = 0
        # compiles and worker starts: periodic plain lines
        self.reporter = ProgressReporter(tty=False)

    def __call__(self, text: str, row: bool = False, result: bool = False) -> None:
        if row:
            self.index += 1
            print(f"[{self.index}/{self.total}] {text} ...", end="", file=sys.stderr, flush=True)
        elif result:
            print(f" {text}", file=sys.stderr, flush=True)
        else:
            print(f"  - {text}", file=sys.stderr, flush=True)


def run_bench_cli(fleet: Fleet, args: argparse.Namespace) -> int:
    """`fleettui bench FLEET [--quick] [--only GROUP] [--json FILE|-] [--exact] [--spec-k K |
    --no-spec] [--max-tokens N]`."""
    from fleettui.bench.report import document, dumps, format_table, format_targets, plot, targets
    from fleettui.bench.rows import GROUPS, measurement_count, plan_rows
    from fleettui.bench.runner import FULL_REPEATS, FULL_TOKENS, PROMPTS, QUICK_TOKENS, run_bench
    from fleettui.control.settings import with_overrides

    fleet = with_overrides(fleet, exact=args.exact, draft="none" if args.no_spec else None)
    tokens = options.tokens(args, QUICK_TOKENS if args.quick else FULL_TOKENS)
    only = getattr(args, "only", None)
    if only is not None and only not in GROUPS:
        raise FleetError(f"--only: {only!r} is not one of {', '.join(GROUPS)}")
    specs = plan_rows(fleet, args.quick, args.spec_k, args.no_spec, only)
    if not specs:
        raise FleetError(
            f"--only {only}: the {'quick' if args.quick else 'full'} profile has no such rows"
        )
    repeats = 1 if args.quick else FULL_REPEATS
    if args.rounds is not None:
        if not 1 <= args.rounds <= 20:
            raise FleetError(f"--rounds: {args.rounds} is out of range 1..20")
        repeats = args.rounds
    progress = Progress(measurement_count(specs, repeats))
    started = time.perf_counter()
    try:
        rows, machine = run_loop(lambda: run_bench(fleet, specs, tokens, progress, repeats))
    finally:
        progress.reporter.close()
    settings = {
        "profile": "quick" if args.quick else "full",
        "only": only,
        "tokens_per_user": tokens,
        "repeats": repeats,
        "command": " ".join(["fleettui", *sys.argv[1:]]),
        "fleet": str(fleet.path) if fleet.path else None,
        "model": fleet.model.name,
        "weights": fleet.model.precision,
        "exact": fleet.runtime.exact,
        "draft": fleet.speculation.draft,
        "prompts": list(PROMPTS),
        "ignore_eos": True,
        "wall_seconds": round(time.perf_counter() - started, 1),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    doc = document(rows, machine, settings)
    report = sys.stderr if args.json == "-" else sys.stdout
    load = machine.get("load_average_at_start", [0.0])[0]
    print(
        f"\n{fleet.model.name}, {tokens} tokens per user, EOS ignored; precision = "
        "weights/inference/KV; "
        f"per-stage split in ms per generated token; {len(machine['usable_cpus'])} CPUs, load "
        "average "
        f"{load:.1f} at the start; 'others' = share of all CPUs busy outside this bench during the "
        "row",
        file=report,
    )
    print(format_table(rows), file=report)
    print("\ntargets:\n" + format_targets(targets(rows)), file=report)
    print("\n" + plot(rows), file=report)
    if args.json == "-":
        print(dumps(doc))
    elif args.json:
        Path(args.json).write_text(dumps(doc) + "\n")
        print(f"\nJSON written to {args.json}", file=report)
    return 1 if any(row.status.startswith("failed") for row in rows) else 0
