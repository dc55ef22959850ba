"""Provides the `serve` bench group: HTTP streaming vs the direct controller, and the prefix-reuse
TTFT gain.

Usable on its own: `python -m fleettui.bench.serve_bench [FLEET] [--exact] [--max-tokens N] [--json
FILE]`. One fleet, one asyncio loop: the coordinator, the uvicorn server and the streaming HTTP
client (httpx) share it, as they would share a machine; the client's own parsing is counted as
server overhead."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fleettui.runtime.chat_format import ChatMessage
from fleettui.runtime.generation import GenerationParams

PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue, then list 3 primes.",
)
CONVERSATION = (
    "Name a famous painter.",
    "What is one of their best known works?",
    "Where can I see it?",
    "Summarise our conversation in one sentence.",
)


@dataclass(frozen=True)
class OverheadRow:
    prompt: str
    tokens: int
    direct_tok_s: float
    http_tok_s: float
    direct_ttft_ms: float
    http_ttft_ms: float

    @property
    def ratio(self) -> float:
        return self.http_tok_s / self.direct_tok_s if self.direct_tok_s else 0.0


@dataclass(frozen=True)
class ReuseRow:
    turn: int
    prompt_tokens: int
    cached_tokens: int
    reuse_ttft_ms: float
    cold_ttft_ms: float

    @property
    def gain(self) -> float:
        return self.cold_ttft_ms / self.reuse_ttft_ms if self.reuse_ttft_ms else 0.0


async def _direct(fleet: Any, prompt: str, tokens: int) -> tuple[int, float, float]:
    """(tokens, seconds, ttft) of one prompt in a fresh session straight through the coordinator."""
    started = time.perf_counter()
    first: list[float] = []

    def on_tokens(ids: list[int], delta: str) -> None:
        if delta and not first:
            first.append(time.perf_counter() - started)

    session = await fleet.open_session(0)
    try:
        ids = fleet.encode_chat([ChatMessage("user", prompt)])
        generation = await fleet.generate(
            session, ids, GenerationParams(max_tokens=tokens), on_tokens
        )
    finally:
        await fleet.close_session(session)
    return generation.stats.tokens, time.perf_counter() - started, first[0] if first else 0.0


async def _stream(
    http: Any, model: str, messages: list[dict[str, str]], tokens: int
) -> tuple[str, dict[str, Any], float, float]:
    """(text, usage, seconds, ttft) of one streaming chat completion, timed at the client."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft = 0.0
    parts: list[str] = []
    usage: dict[str, Any] = {}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    if not parts:
                        ttft = time.perf_counter() - started
                    parts.append(content)
    return "".join(parts), usage, time.perf_counter() - started, ttft


async def run_serve_bench(fleet_config: Any, tokens: int = 128, repeats: int = 2) -> dict[str, Any]:
    """Start the fleet, put two servers in front (no pool / pool), measure both tables; stops the
    fleet."""
    import httpx

    from fleettui.control.controller import FleetController
    from fleettui.serve.app import FleetServer
    from fleettui.serve.command import serve_http
    from fleettui.serve.fleet import ControllerFleet

    controller = FleetController(fleet_config)
    tasks: list[asyncio.Task[None]] = []
    stop = asyncio.Event()
    try:
        await controller.start()
        fleet = ControllerFleet(controller)
        model = fleet.model_info().name
        urls: dict[str, str] = {}
        both_ready = asyncio.Event()
        servers = {
            "cold": FleetServer(fleet, max_sessions=4, max_idle=0),
            "pooled": FleetServer(fleet, max_sessions=4, max_idle=8),
        }
        for name, server in servers.items():

            def ready(url: str, name: str = name) -> None:
                urls[name] = url
                if len(urls) == len(servers):
                    both_ready.set()

            serving = serve_http(server, "127.0.0.1", 0, ready_callback=ready, stop=stop)
            tasks.append(asyncio.ensure_future(serving))
        await asyncio.wait_for(both_ready.wait(), 60)
        overhead: list[OverheadRow] = []
        async with httpx.AsyncClient(base_url=urls["cold"], timeout=600) as http:
            await _stream(http, model, [{"role": "user", "content": "Hi"}], 4)  # warm-up
            for prompt in PROMPTS:
                direct_best = (0, float("inf"), 0.0)
                http_best = (0, float("inf"), 0.0)
                for _ in range(repeats):  # alternate, keep the fastest of each
                    result = await _direct(fleet, prompt, tokens)
                    direct_best = min(direct_best, result, key=lambda r: r[1] / max(1, r[0]))
                    _, usage, seconds, ttft = await _stream(
                        http, model, [{"role": "user", "content": prompt}], tokens
                    )
                    measured = (int(usage.get("completion_tokens", 0)), seconds, ttft)
                    http_best = min(http_best, measured, key=lambda r: r[1] / max(1, r[0]))
                overhead.append(
                    OverheadRow(
                        prompt,
                        direct_best[0],
                        direct_best[0] / direct_best[1],
                        http_best[0] / http_best[1],
                        direct_best[2] * 1000,
                        http_best[2] * 1000,
                    )
                )
        reuse = await _reuse_rows(urls["pooled"], urls["cold"], model)
    finally:
        stop.set()
        for task in tasks:
            await asyncio.gather(task, return_exceptions=True)
        await controller.stop()
    return {
        "overhead": [{**asdict(row), "ratio": round(row.ratio, 4)} for row in overhead],
        "reuse": [{**asdict(row), "gain": round(row.gain, 2)} for row in reuse],
    }


async def _reuse_rows(pooled_url: str, cold_url: str, model: str) -> list[ReuseRow]:
    """A 4-turn conversation on the pooled server, each turn replayed on the cold one (fresh
    session)."""
    import httpx

    rows = []
    messages: list[dict[str, str]] = []
    async with (
        httpx.AsyncClient(base_url=pooled_url, timeout=600) as pooled,
        httpx.AsyncClient(base_url=cold_url, timeout=600) as cold,
    ):
        for turn, question in enumerate(CONVERSATION, start=1):
            messages.append({"role": "user", "content": question})
            _, _, _, cold_ttft = await _stream(cold, model, messages, 32)
            text, usage, _, ttft = await _stream(pooled, model, messages, 32)
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
            rows.append(
                ReuseRow(
                    turn, int(usage.get("prompt_tokens", 0)), cached, ttft * 1000, cold_ttft * 1000
                )
            )
            messages.append({"role": "assistant", "content": text})
    return rows


def format_tables(result: dict[str, Any]) -> str:
    lines = [
        "HTTP streaming vs direct controller (same prompts, greedy, fresh session each)",
        f"{'prompt':<44} {'tokens':>6} {'direct tok/s':>12} {'http tok/s':>10} {'ratio':>6} "
        f"{'direct TTFT':>11} {'http TTFT':>9}",
    ]
    for row in result["overhead"]:
        lines.append(
            f"{row['prompt'][:44]:<44} {row['tokens']:>6} {row['direct_tok_s']:>12.1f} "
            f"{row['http_tok_s']:>10.1f} "
            f"{row['ratio']:>6.3f} {row['direct_ttft_ms']:>9.0f}ms {row['http_ttft_ms']:>7.0f}ms"
        )
    lines += [
        "",
        "prefix reuse across requests: 4-turn chat, TTFT of turn N with the pool vs a cold session",
        f"{'turn':>4} {'prompt tok':>10} {'cached':>6} {'reuse TTFT':>10} {'cold TTFT':>9} "
        f"{'gain':>6}",
    ]
    for row in result["reuse"]:
        lines.append(
            f"{row['turn']:>4} {row['prompt_tokens']:>10} {row['cached_tokens']:>6} "
            f"{row['reuse_ttft_ms']:>8.0f}ms "
            f"{row['cold_ttft_ms']:>7.0f}ms {row['gain']:>5.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from fleettui.config.fleet import load_fleet, resolve_fleet
    from fleettui.control.controller import with_overrides
    from fleettui.control.running import run as run_loop
    from fleettui.errors import Interrupted

    parser = argparse.ArgumentParser(
        prog="python -m fleettui.bench.serve_bench", description=__doc__
    )
    parser.add_argument(
        "fleet", nargs="?", help="fleet TOML file (default: the embedded fleets/local.toml)"
    )
    parser.add_argument(
        "--exact", action="store_true", help="fp32 weights, f32 inference and KV cache"
    )
    parser.add_argument("--draft", help="draft override: self-int4 | prompt-lookup | none | PATH")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per overhead prompt")
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs per prompt and path; the fastest is kept"
    )
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args(argv)
    fleet = with_overrides(
        load_fleet(resolve_fleet(args.fleet)), exact=args.exact, draft=args.draft
    )
    started = time.perf_counter()
    try:  # a signal stops the fleet and the server before the exit
        result = run_loop(lambda: run_serve_bench(fleet, args.max_tokens, args.repeats))
    except Interrupted as error:
        return error.code
    result["settings"] = {
        "fleet": str(fleet.path) if fleet.path else None,
        "exact": fleet.runtime.exact,
        "draft": fleet.speculation.draft,
        "max_tokens": args.max_tokens,
        "wall_seconds": round(time.perf_counter() - started, 1),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    print(format_tables(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
