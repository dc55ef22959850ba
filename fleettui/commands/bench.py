"""Provides `fleettui bench FLEET`: measure the fleet against one PC, headless."""

from __future__ import annotations

import argparse

from fleettui.commands import options

NAME = "bench"
HELP = "measure the fleet against one PC, headless"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    options.add_fleet(parser)
    parser.add_argument("--quick", action="store_true", help="the small smoke-test profile")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON to FILE (- for stdout)")
    parser.add_argument("--exact", action="store_true", help="exact arithmetic (fp32, f32 inference and KV)")
    spec = parser.add_mutually_exclusive_group()
    spec.add_argument("--spec-k", type=int, metavar="K", help="speculate K tokens per verify (0..16)")
    spec.add_argument("--no-spec", action="store_true", help="no speculative decoding")
    parser.add_argument("--max-tokens", type=int, help="tokens per user")


def run(args: argparse.Namespace) -> int:
    from fleettui.bench.runner import run_bench_cli

    options.settings(args)  # validates --spec-k
    return run_bench_cli(options.load(args), args)
