"""Provides `fleettui --bench`: one PC (mono, GenAI) and the fleet's configurations measured side by
side.

One run, one model, one weight precision, the same compiled IR (the 1-stage shard for mono, GenAI
and the 1-stage fleet; the planner's split for N stages), fixed chat prompts (one per user), EOS
ignored so every row generates exactly its token budget. Rows: mono and the GenAI `LLMPipeline`
anchor; the fleet with 1..N stages x users x speculation off/on; a one-way delay per hop (user-space
proxies, `hop_delay`, on each of the N + 1 data links of the ring coordinator -> stage 0 -> ... ->
last stage -> coordinator; the draft stays local to the coordinator); and emulated PCs (each stage
pinned to its own core with 1 inference thread, against mono pinned to one core with 1 thread).
OpenVINO runs only in child processes (`remote_worker.mono`, `shard_compiler.anchors`, the stage
workers)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from fleettui.bench.baseline import run_baseline
from fleettui.bench.calibration import calibrate_hosts
from fleettui.bench.grammar_bench import bench_constraint
from fleettui.bench.machine import CpuWitness, machine_info
from fleettui.bench.report import (
    Row,
    Trip,
    add_ratios,
    short_precision,
    short_precisions,
    stage_breakdown,
)
from fleettui.bench.results import paired_rates
from fleettui.bench.rows import GROUPS, RowSpec, group_repeats, new_row, plan_rows, schedule
from fleettui.config.fleet import Fleet, Host
from remote_worker.manifest import boundary_value

log = logging.getLogger(__name__)

PROMPTS = (
    "What is the capital of France? Answer, then tell me one fact about its history.",
    "Write a short poem about the sea at night.",
    "Explain in a few sentences why the sky is blue.",
    "Give me three tips for learning to play the guitar.",
    "What is a prime number? List the first ten.",
    "Describe how a bicycle works to a child.",
    "Summarise the water cycle in simple steps.",
    "Suggest a name for a friendly robot and explain why.",
)
QUICK_TOKENS = 32
FULL_TOKENS = 128
WARMUP_TOKENS = 8
ROW_TIMEOUT = 900.0
# full profile: 3 interleaved rounds per group, the fastest kept (all rates in the JSON)
FULL_REPEATS = 3
# share of the CPUs busy outside the bench above which a baseline is measured again
BUSY_MACHINE = 0.15
SYNTHETIC_PROMPT = 40  # prompt length (random ids) for a synthetic model, which has no tokenizer
# a batch row's last user starts once the first has this many tokens (its TTFT: join_ttft_s)
JOIN_AFTER = 8
__all__ = ["GROUPS", "RowSpec", "plan_rows", "run_bench"]


# --------------------------------------------------------------------------------------- fleet rows
def bench_fleet(fleet: Fleet, stages: int, pinned: bool) -> Fleet:
    """The fleet's first STAGES hosts, all local on fresh ports; pinned = one core and 1 thread
    each."""
    from fleettui.control.deployment import free_port_block

    cores = sorted(os.sched_getaffinity(0))
    hosts: list[Host] = []
    for index in range(stages):
        template = fleet.hosts[index % len(fleet.hosts)] if fleet.hosts else Host(name="stage")
        base = free_port_block()
        host = Host(
            name=f"{'pc' if pinned else 'stage'}-{index}",
            base_port=base,
            device=template.device,
            memory_gb=template.memory_gb,
            speed=template.speed,
            threads=1 if pinned else template.threads,
            cores=(cores[index % len(cores)],) if pinned else (),
            layers=template.layers if fleet.manual_layers and stages == len(fleet.hosts) else None,
        )
        hosts.append(host)
    return replace(fleet, hosts=tuple(hosts))


class TraceRecorder:
    """A Link that passes requests through and keeps each Result's per-stage trace (for the time
    split)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.trips: list[Trip] = []

    async def request(self, message: Any, timeout: float | None = None) -> Any:
        from remote_worker import protocol

        sent = time.time()
        reply = await self.inner.request(message, timeout)
        if isinstance(reply, protocol.Result) and reply.trace.size:
            self.trips.append(Trip(sent, time.time(), reply.trace.copy()))
        return reply

    async def stream(self, step: Any) -> Any:
        """A run's stream whose Results are recorded as they are read (each since the one
        before)."""
        return _RecordedStream(await self.inner.stream(step), self.trips)

    async def close(self) -> None:
        await self.inner.close()


class _RecordedStream:
    """A run's ReplyStream that records a Trip per Result read: sent = when the run was sent, then
    when the last stage finished the previous token (its next step left for stage 0 right then)."""

    def __init__(self, inner: Any, trips: list[Trip]) -> None:
        self.inner = inner
        self.trips = trips
        self.last = float(inner.sent_at)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def next(self) -> Any:
        result, arrived = await self.inner.next()
        from remote_worker import protocol

        records = protocol.trace_records(result.trace)
        if records:
            self.trips.append(Trip(self.last, arrived, result.trace.copy()))
            self.last = records[-1][3]
        return result, arrived


def _precision_from(properties: list[dict[str, Any]], weights: str, runtime: Any) -> dict[str, str]:
    def find(key: str, fallback: str) -> str:
        values = sorted({short_precision(p[key]) for p in properties if key in p})
        return ",".join(values) if values else fallback

    return short_precisions(
        {
            "weights": weights,
            "inference": find("INFERENCE_PRECISION_HINT", runtime.inference_precision),
            "kv_cache": find("KV_CACHE_PRECISION", runtime.kv_cache_precision),
        }
    )


async def _measure(
    coordinator: Any,
    spec: RowSpec,
    prompts: list[list[int]],
    tokens: int,
    recorder: TraceRecorder,
    policies: dict[str, Any],
    round_index: int = 0,
) -> dict[str, Any]:
    """One row's answers. An adaptive row keeps its policy across the group's rounds (learned costs,
    realized rates, probe schedule), as a serving fleet keeps it across requests: not a cold start
    each time. Each row has its own, so one row does not learn from another's load."""
    from fleettui.runtime.generation import GenerationParams
    from fleettui.runtime.speculation import KPolicy, PromptLookupDrafter

    if (
        spec.draft == "prompt-lookup"
    ):  # the free drafter, on the same running fleet, for this row only
        coordinator.drafter = PromptLookupDrafter()
    if spec.spec_k == "auto":
        fresh = KPolicy(None if coordinator.drafter is not None else 0, coordinator.max_k)
        coordinator.policy = policies.setdefault(spec.name, fresh)
    params = GenerationParams(
        max_tokens=tokens,
        ignore_eos=True,
        spec_k=None if spec.spec_k == "auto" else int(spec.spec_k),
        constraint=bench_constraint() if spec.grammar else None,
    )
    sessions = [await coordinator.open_session() for _ in range(spec.users)]
    recorder.trips.clear()
    joins = bool(spec.batching) and spec.users > 1
    first_tokens = asyncio.Event()
    seen = [0]

    def count(ids: list[int], _text: str) -> None:
        seen[0] += len(ids)
        if seen[0] >= JOIN_AFTER:
            first_tokens.set()

    async def answer(index: int, session: Any, prompt: list[int]) -> Any:
        if joins and index == spec.users - 1:
            await first_tokens.wait()
        return await coordinator.generate(
            session, prompt, params, count if joins and index == 0 else None
        )

    try:
        witness = CpuWitness()
        own = _own_cpu_seconds()
        started = time.perf_counter()
        async with asyncio.timeout(
            ROW_TIMEOUT
        ):  # awaited here, so a cancelled gather is never left unread
            generations = await asyncio.gather(
                *(
                    answer(index, session, prompt)
                    for index, (session, prompt) in enumerate(
                        zip(sessions, round_prompts(prompts, spec.users, round_index), strict=True)
                    )
                )
            )
        wall = time.perf_counter() - started
        own = _own_cpu_seconds() - own
    finally:
        for session in sessions:
            await coordinator.close_session(session)
    stats = [generation.stats for generation in generations]
    total = sum(s.tokens for s in stats)
    drafted, accepted = sum(s.drafted for s in stats), sum(s.accepted for s in stats)
    k_values = [k for s in stats for k in s.k_values]
    return {
        "tokens": total,
        "seconds": wall,
        "aggregate_tok_s": total / wall if wall > 0 else 0.0,
        "per_user_tok_s": sum(s.tokens_per_second for s in stats) / len(stats),
        "ttft_s": sum(s.ttft for s in stats[: len(stats) - joins]) / (len(stats) - joins),
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_k": sum(k_values) / len(k_values) if k_values else 0.0,
        "stage_breakdown": stage_breakdown(recorder.trips, total),
        "details": {
            "at": time.time()
            - wall / 2,  # the middle of its window (pairs are taken at the same time)
            "others_cpu": witness.others(),
            # the coordinator (this process: asyncio loop, ZeroMQ I/O threads, tokenizer) as a share
            # of all CPUs; on emulated PCs it runs on the PCs' cores, so it is taken from their
            # compute
            "coordinator_cpu": own / (wall * len(os.sched_getaffinity(0))) if wall > 0 else 0.0,
            "drafted": drafted,
            "accepted": accepted,
            "draft_ms_per_token": 1000 * sum(s.draft_seconds for s in stats) / max(total, 1),
            "finish": sorted({s.finish_reason for s in stats}),
            # each user's own rate and drafts: the aggregate counts up to the last user's finish, so
            # one user's lead (an easier prompt drafts better) leaves the others a tail with the
            # stages half idle
            "users_tok_s": [round(s.tokens_per_second, 2) for s in stats],
            "users_drafted": [s.drafted for s in stats],
            "users_accepted": [s.accepted for s in stats],
            **(
                {"join_ttft_s": round(stats[-1].ttft, 4), "batching": spec.batching}
                if joins
                else {}
            ),
            **(
                {
                    "drafts_cut": sum(s.drafts_cut for s in stats),
                    "forced": sum(s.forced for s in stats),
                    "constraint_complete": [s.constraint_complete for s in stats],
                }
                if spec.grammar
                else {}
            ),
        },
    }


def round_prompts(prompts: list[list[int]], users: int, round_index: int) -> list[list[int]]:
    """The prompts of one round: user u of round r asks prompt r + u (the untimed round -1 the last
    one).

    Every row of a round asks the same ones, so a pair compares like with like, and a row's median
    spans several prompts: a draft's acceptance differs a lot between prompts."""
    return [prompts[(round_index + user) % len(prompts)] for user in range(users)]


def _own_cpu_seconds() -> float:
    """CPU seconds of this process alone (all its threads, no children)."""
    times = os.times()
    return times.user + times.system


def synthetic_prompts(
    vocab: int, count: int = 8, length: int = SYNTHETIC_PROMPT
) -> list[list[int]]:
    """Seeded random prompt ids for a synthetic model (no tokenizer; ids 0..2 left out as
    specials)."""
    import numpy as np

    generator = np.random.default_rng(12)
    return [[int(t) for t in generator.integers(3, vocab, length)] for _ in range(count)]


def best_of(attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest of repeated measurements (other programs only ever slow a run down), with all
    their rates."""
    best = max(attempts, key=lambda attempt: attempt["aggregate_tok_s"])
    best["details"]["runs_tok_s"] = [round(attempt["aggregate_tok_s"], 2) for attempt in attempts]
    best["details"]["runs_at"] = [attempt["details"].get("at") for attempt in attempts]
    return best


def model_fleet(fleet: Fleet, model: str) -> Fleet:
    """The fleet on another model (the scale group); no draft there (its rows measure plain
    decoding)."""
    if not model or model == fleet.model.name:
        return fleet
    return replace(
        fleet,
        model=replace(fleet.model, name=model),
        speculation=replace(fleet.speculation, draft="none"),
    )


# async (RowSpec) -> Row: one measurement of a mono/GenAI row in a child process
BaselineRunner = Any


async def run_fleet_group(
    fleet: Fleet,
    specs: list[RowSpec],
    tokens: int,
    devices: list[str],
    progress: Any,
    repeats: int = 1,
    partners: list[RowSpec] | None = None,
    baseline_runner: BaselineRunner = None,
    calibrated: set[Path] | None = None,
) -> tuple[list[Row], dict[str, list[Row]]]:
    """Start one fleet for rows sharing model/stages/pinning/delay and measure them in interleaved
    rounds.

    Each round measures every row once, then every partner baseline (mono/GenAI rows some row is
    paired with) once, so each pair is measured in adjacent windows. Returns the rows and the
    partners' runs."""
    from fleettui.bench.hop_delay import HopDelay
    from fleettui.control.controller import ControllerError, FleetController
    from fleettui.runtime.generation import GenerationParams

    first = specs[0]
    partners = partners or []
    partner_runs: dict[str, list[Row]] = {p.name: [] for p in partners}
    rows = [new_row(s) for s in specs]
    variant = bench_fleet(model_fleet(fleet, first.model), first.stages, first.pinned)
    rows_wanted = max(spec.users for spec in specs)
    if rows_wanted > variant.sessions.max_sessions:  # the batch group's 8 users: as many KV rows
        variant = replace(variant, sessions=replace(variant.sessions, max_sessions=rows_wanted))
    missing = sorted(
        {h.device for h in variant.hosts} - {d.split(".")[0] for d in devices} - {"AUTO"}
    )
    if missing:
        for row in rows:
            row.status = (
                f"skipped: device {', '.join(missing)} is not available here (devices: "
                f"{', '.join(devices)})"
            )
        return rows, partner_runs
    if (
        first.stages > 1 and repeats > 1
    ):  # the full profile; --quick (a smoke test) plans by byte counts
        await calibrate_hosts(variant, progress, calibrated if calibrated is not None else set())
    hops = HopDelay(first.hop_delay_ms) if first.hop_delay_ms > 0 else None
    # compile and worker start progress of the first use of these shards (commands.bench's reporter)
    controller = FleetController(variant, on_event=getattr(progress, "reporter", None))
    try:
        progress(
            f"starting {first.stages} stage(s){' pinned' if first.pinned else ''}"
            f"{f', {first.hop_delay_ms:g} ms per hop' if hops else ''}"
            f"{f' on {first.model}' if first.model else ''}"
            " (compiles shards on first use)"
        )
        coordinator = await controller.start(endpoint_map=hops, attach=False, record=False)
        properties: list[dict[str, Any]] = [
            dict(reply.properties)
            for name, reply in controller.ready_replies.items()
            if name != "draft"
        ]
        assert controller.target is not None
        recorder = TraceRecorder(coordinator.target)
        coordinator.target = recorder
        manifest = controller.target.manifest
        chat = coordinator.chat_format
        if chat is None:  # synthetic: random ids stand in for prompts
            prompts = synthetic_prompts(manifest.vocab_size)
        else:
            prompts = [chat.encode_question(text) for text in PROMPTS]
        precision = _precision_from(properties, manifest.precision, variant.runtime)
        layers = [  # 12.5: the boundary cuts layer 12 between its attention and its MLP
            [boundary_value(r.start, r.starts_mid), boundary_value(r.end, r.ends_mid)]
            for r in (stage.layers for stage in manifest.stages)
        ]
        warm = [0] + ([2] if coordinator.drafter is not None else [])
        for k in warm:  # first inferences allocate; keep them out of the rows
            session = await coordinator.open_session()
            await coordinator.generate(
                session, prompts[0], GenerationParams(WARMUP_TOKENS, ignore_eos=True, spec_k=k)
            )
            await coordinator.close_session(session)
        attempts: list[list[dict[str, Any]]] = [[] for _ in specs]
        policies: dict[str, Any] = {}  # per row, kept across its rounds
        # Round -1: each adaptive row's policy answers one untimed reply first. A serving fleet's
        # first request explores (the draft's costs, its acceptance), every later one starts from
        # what it learnt: the rounds measure the latter, `cold_tok_s` keeps the former.
        for round_index in range(-1, repeats):
            cold = round_index < 0
            order = list(enumerate(zip(specs, rows, strict=True)))
            for index, (spec, row) in order[
                :: -1 if round_index % 2 else 1
            ]:  # ABBA: drift evens out
                if not row.ok or (cold and spec.spec_k != "auto"):
                    continue
                if not cold:  # (a cold reply says its rate in one line when it is done)
                    progress(
                        spec.name
                        + (f" (round {round_index + 1}/{repeats})" if repeats > 1 else ""),
                        row=True,
                    )
                row.precision, row.layers = precision, layers
                row.details["model_name"] = manifest.model_name
                row.details["synthetic"] = manifest.synthetic
                if spec.spec_k != 0 and coordinator.drafter is None:
                    row.status = "skipped: the fleet has no draft (speculation.draft = none)"
                    progress(row.status, result=True)
                    continue
                drafter = coordinator.drafter
                try:
                    if spec.batching:
                        await controller.set_batching(spec.batching == "on")
                    measured = await _measure(
                        coordinator, spec, prompts, tokens, recorder, policies, round_index
                    )
                    rate = f"{measured['aggregate_tok_s']:.1f} tok/s"
                    if cold:
                        row.details["cold_tok_s"] = round(measured["aggregate_tok_s"], 2)
                    else:
                        attempts[index].append(measured)
                    progress(
                        f"{spec.name}: its policy's untimed first reply, {rate}" if cold else rate,
                        result=not cold,
                    )
                except Exception as error:  # noqa: BLE001 - one broken row must not lose the others
                    row.status = f"failed: {type(error).__name__}: {error}"
                    progress(f"{spec.name}: {row.status}" if cold else row.status, result=not cold)
                finally:
                    coordinator.drafter = drafter
            if cold:
                continue
            for (
                partner
            ) in partners:  # the baselines, in the same window (the fleet idles meanwhile)
                progress(f"{partner.name} (paired with this group)", row=False)
                partner_runs[partner.name].append(await baseline_runner(partner))
        for spec, row, tried in zip(specs, rows, attempts, strict=True):
            if not row.ok or not tried:
                continue
            measured = best_of(tried)
            measured["details"]["runs_coordinator_cpu"] = [
                round(a["details"]["coordinator_cpu"], 4) for a in tried
            ]
            for key, value in measured.items():
                if key == "details":
                    row.details.update(value)
                else:
                    setattr(row, key, value)
            row.details.update(
                {
                    "encryption": variant.runtime.encryption,
                    "wire": variant.runtime.wire_dtype,
                    "draft": "none"
                    if spec.spec_k == 0
                    else spec.draft or variant.speculation.draft,
                }
            )
        _pair(rows, partner_runs)
    except Exception as error:  # noqa: BLE001 - the fleet did not come up: each of its rows says why
        reason = (
            str(error) if isinstance(error, ControllerError) else f"{type(error).__name__}: {error}"
        )
        for row in rows:
            if row.ok and not row.tokens:
                row.status = f"failed: {reason}"
        progress(f"failed: {reason}")
    finally:
        await controller.stop()
        if hops is not None:
            hops.close()
    return rows, partner_runs


def _pair(rows: list[Row], partner_runs: dict[str, list[Row]]) -> None:
    """Per-round ratios of each row to its `versus` (a row of this group or a partner baseline)."""
    runs = {
        row.name: (row.details.get("runs_tok_s", []), row.details.get("runs_at", []))
        for row in rows
        if row.ok
    }
    for name, measured in partner_runs.items():
        runs[name] = (
            [m.aggregate_tok_s if m.ok else 0.0 for m in measured],
            [m.details.get("at") for m in measured],
        )
    for row in rows:
        if row.ok and row.versus in runs:
            pairs = paired_rates(*runs[row.name], *runs[row.versus])
            row.details["paired_ratios"] = [round(a / b, 4) for a, b in pairs]
            if (
                row.users == 1 and pairs
            ):  # time per token this row adds over its pair (the fleet's overhead)
                extra = sorted(1000.0 / a - 1000.0 / b for a, b in pairs)
                row.details["paired_extra_ms_per_token"] = round(extra[len(extra) // 2], 3)


# ------------------------------------------------------------------------------------------------
# run
async def run_bench(
    fleet: Fleet, specs: list[RowSpec], tokens: int, progress: Any, repeats: int = 1
) -> tuple[list[Row], dict[str, Any]]:
    """Every row of SPECS: fleet rows grouped per running fleet, each group in interleaved rounds
    with the baselines its rows are paired with; baselines nobody is paired with are measured on
    their own."""
    from fleettui.control.controller import FleetController, compile_model
    from fleettui.runtime.chat_format import ChatFormat

    machine = await asyncio.to_thread(machine_info)
    results: dict[RowSpec, Row] = {}
    calibrated: set[Path] = set()  # cost profiles measured in this run
    singles: dict[str, tuple[Path, list[int]]] = {}

    async def single(model: str) -> tuple[Path, list[int]]:
        """The unsplit 1-stage shard of MODEL and the first prompt's ids (compiled once per
        model)."""
        if model not in singles:
            progress(f"compiling (or finding) the unsplit 1-stage shard of {model}")
            variant = bench_fleet(model_fleet(fleet, model), 1, False)
            ranges = list(FleetController(variant).layer_plan().ranges)
            reporter = getattr(progress, "reporter", None)
            compiled = await compile_model(
                model,
                ranges,
                fleet.model.precision,
                fleet.model.shards,
                reporter.compiler_line if reporter else None,
            )
            if compiled.manifest.synthetic:
                prompt = synthetic_prompts(compiled.manifest.vocab_size)[0]
            else:
                prompt = ChatFormat(compiled.directory, compiled.manifest).encode_question(
                    PROMPTS[0]
                )
            singles[model] = (compiled.directory, prompt)
        return singles[model]

    async def baseline_once(spec: RowSpec) -> Row:
        directory, prompt = await single(spec.model or fleet.model.name)
        return await run_baseline(spec, directory, prompt, tokens, fleet)

    planned = schedule(specs)
    groups, partners_of, baselines, alone = (
        planned.groups,
        planned.partners,
        planned.baselines,
        planned.alone,
    )
    measured: dict[str, list[Row]] = {spec.name: [] for spec in baselines}
    ratios: dict[
        str, list[float]
    ] = {}  # a baseline paired with another, both measured in one group's rounds
    for round_index in range(repeats):  # unpaired baselines: interleaved rounds among themselves
        for spec in alone:
            progress(
                spec.name + (f" (round {round_index + 1}/{repeats})" if repeats > 1 else ""),
                row=True,
            )
            outcome = await baseline_once(spec)
            measured[spec.name].append(outcome)
            progress(
                f"{outcome.aggregate_tok_s:.1f} tok/s" if outcome.ok else outcome.status,
                result=True,
            )
    for key, members in groups.items():
        partners = partners_of[key]
        rounds = group_repeats(members, repeats)
        rows, partner_runs = await run_fleet_group(
            fleet,
            members,
            tokens,
            machine["openvino_devices"],
            progress,
            rounds,
            partners,
            baseline_once,
            calibrated,
        )
        results.update(zip(members, rows, strict=True))
        for partner in partners:
            if (
                partner.versus in partner_runs
            ):  # e.g. the ceiling against mono 1core, round by round
                probe = new_row(partner)
                _pair([probe], partner_runs)
                ratios.setdefault(partner.name, []).extend(probe.details.get("paired_ratios", []))
        for name, runs in partner_runs.items():
            measured[name].extend(runs)
            rates = ", ".join(f"{r.aggregate_tok_s:.1f}" if r.ok else r.status for r in runs)
            progress(f"{name} in this group's rounds: {rates} tok/s")
    for spec in baselines:
        runs = measured[spec.name]
        ok = [r for r in runs if r.ok]
        if (
            ok
            and repeats == 1
            and len(ok) == 1
            and ok[0].details.get("others_cpu", 0.0) > BUSY_MACHINE
        ):
            again = await baseline_once(spec)  # measured while the machine was busy: once more
            runs.append(again)
            ok += [again] if again.ok else []
        row = (
            max(ok, key=lambda r: r.aggregate_tok_s) if ok else (runs[0] if runs else new_row(spec))
        )
        row.details["runs_tok_s"] = [round(r.aggregate_tok_s, 2) for r in ok]
        row.details["runs_at"] = [r.details.get("at") for r in ok]
        if spec.name in ratios:
            row.details["paired_ratios"] = ratios[spec.name]
        results[spec] = row
    ordered = [results[spec] for spec in specs]
    # baselines paired among themselves in their own rounds (genai 1core vs mono 1core)
    _pair([r for r in ordered if r.kind != "fleet" and r.name not in ratios], {})
    add_ratios(ordered)
    return ordered, machine
