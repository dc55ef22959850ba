"""Provides the bench's results: rows, per-stage time split from traces, ratios, the table, the plot and JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from remote_worker.protocol import TRACE_FIELDS

JSON_FIELDS = (
    "name",
    "stages",
    "users",
    "spec_k",
    "hop_delay_ms",
    "precision",
    "tokens",
    "seconds",
    "aggregate_tok_s",
    "per_user_tok_s",
    "ttft_s",
    "acceptance_rate",
    "stage_breakdown",
)


@dataclass
class Row:
    """One measured (or skipped) configuration of the bench."""

    name: str
    kind: str  # mono | genai | fleet
    stages: int = 1
    users: int = 1
    spec_k: int | str = 0  # 0 = no speculation, "auto" = adaptive K, n = fixed K
    hop_delay_ms: float = 0.0
    pinned: bool = False  # emulated PCs: each stage (or the mono process) on its own core, 1 thread
    precision: dict[str, str] = field(default_factory=dict)  # weights, inference, kv_cache
    tokens: int = 0
    seconds: float = 0.0
    aggregate_tok_s: float = 0.0
    per_user_tok_s: float = 0.0
    ttft_s: float | None = None
    acceptance_rate: float | None = None
    mean_k: float | None = None
    stage_breakdown: list[dict[str, float]] | None = None
    layers: list[list[int]] | None = None
    vs_mono: float | None = None
    vs_genai: float | None = None
    status: str = "ok"  # ok | skipped: reason | failed: reason
    details: dict[str, Any] = field(default_factory=dict)
    model: str = ""  # "" = the fleet's model; else e.g. synthetic:llama-3.2-1b (the scale group)
    group: str = ""  # the bench group (--only)
    versus: str = ""  # the row this one is paired with: measured in the same rounds, adjacent windows

    @property
    def paired_ratio(self) -> float | None:
        """Median of the per-round ratios to `versus` (adjacent windows); None without pairs."""
        ratios = self.details.get("paired_ratios") or []
        return float(np.median(ratios)) if ratios else None

    @property
    def ratio_spread(self) -> float | None:
        """(max - min) / median of the per-round ratios: how far the ratio itself moved between rounds."""
        ratios = self.details.get("paired_ratios") or []
        if len(ratios) < 2:
            return None
        middle = float(np.median(ratios))
        return (max(ratios) - min(ratios)) / middle if middle > 0 else None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["paired_ratio"], data["ratio_spread"] = self.paired_ratio, self.ratio_spread
        for key, value in data.items():
            if isinstance(value, float):
                data[key] = round(value, 4) if math.isfinite(value) else None
        return data


# ---------------------------------------------------------------------------------------- breakdown
@dataclass(frozen=True)
class Trip:
    """One request through the chain as the coordinator saw it, with the stages' trace records."""

    sent: float  # time.time() just before the coordinator sent the request
    received: float  # time.time() just after the reply arrived
    trace: np.ndarray  # flat, TRACE_FIELDS per stage: stage, received, started, finished, sent


def stage_breakdown(trips: Iterable[Trip], tokens: int) -> list[dict[str, float]] | None:
    """Per stage, milliseconds per generated token of compute, queueing and wire.

    compute = finished - started, queue = started - received, and wire = the rest of the round trip: the
    hop into the stage plus the stage's own send time (serialisation); the last stage also carries the
    hop back to the coordinator (and the coordinator's receive path). The three sum to the round trips.
    """
    totals: dict[int, list[float]] = {}
    order: list[int] = []
    seen = False
    for trip in trips:
        records = np.asarray(trip.trace, np.float64).reshape(-1, TRACE_FIELDS)
        if not len(records):
            continue
        seen = True
        previous_sent = trip.sent
        for index, (stage, received, started, finished, sent) in enumerate(records):
            key = int(stage)
            if key not in totals:
                totals[key] = [0.0, 0.0, 0.0]
                order.append(key)
            bucket = totals[key]
            bucket[0] += finished - started
            bucket[1] += started - received
            bucket[2] += (received - previous_sent) + (sent - finished)
            if index == len(records) - 1:
                bucket[2] += trip.received - sent
            previous_sent = sent
    if not seen or tokens <= 0:
        return None
    scale = 1000.0 / tokens
    return [
        {
            "stage": key,
            "compute_ms": round(totals[key][0] * scale, 3),
            "queue_ms": round(totals[key][1] * scale, 3),
            "wire_ms": round(totals[key][2] * scale, 3),
        }
        for key in order
    ]


# ------------------------------------------------------------------------------------------- ratios
def baseline(rows: Sequence[Row], kind: str, pinned: bool, model: str = "") -> Row | None:
    """The CPU mono/GenAI row a configuration is compared with: pinned rows with the pinned baseline."""
    for row in rows:
        if (
            row.kind == kind
            and row.pinned == pinned
            and row.ok
            and row.details.get("device", "CPU") == "CPU"
            and row.model == model
        ):
            return row
    return None


def add_ratios(rows: Sequence[Row]) -> None:
    for row in rows:
        if not row.ok:
            continue
        mono = baseline(rows, "mono", row.pinned, row.model)
        genai = baseline(rows, "genai", row.pinned, row.model)
        row.vs_mono = row.aggregate_tok_s / mono.aggregate_tok_s if mono and mono.aggregate_tok_s else None
        row.vs_genai = (
            row.aggregate_tok_s / genai.aggregate_tok_s if genai and genai.aggregate_tok_s else None
        )


def _find(rows: Sequence[Row], **wanted: Any) -> Row | None:
    wanted.setdefault("model", "")
    for row in rows:
        if row.ok and all(getattr(row, key) == value for key, value in wanted.items()):
            return row
    return None


def targets(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured ratio (None when the rows to compare are missing)."""
    found: list[dict[str, Any]] = []

    def check(name: str, goal: float | None, over: Row | None, under: Row | None) -> None:
        spread_of_ratio = None
        ratio: float | None
        if over and under and over.versus == under.name and over.paired_ratio is not None:
            ratio, spread_of_ratio = over.paired_ratio, over.ratio_spread  # adjacent windows
        else:
            ratio = (
                over.aggregate_tok_s / under.aggregate_tok_s
                if over and under and under.aggregate_tok_s
                else None
            )
        met = None if ratio is None or goal is None else ratio >= goal
        found.append(
            {
                "target": name,
                "goal": goal,
                "ratio": ratio,
                "ratio_spread": spread_of_ratio,
                "met": met,
                "rows": [over.name if over else None, under.name if under else None],
            }
        )

    check(
        "1-stage fleet >= 0.95x GenAI",
        0.95,
        _find(rows, kind="fleet", stages=1, users=1, spec_k=0, hop_delay_ms=0.0, pinned=False),
        baseline(rows, "genai", False),
    )
    pcs = max((r.stages for r in rows if r.kind == "fleet" and r.pinned and r.ok), default=0)
    if pcs >= 2:
        check(
            f"{pcs} emulated PCs x 2 users >= 1.6x mono (1 core)",
            1.6,
            _find(rows, kind="fleet", stages=pcs, users=2, spec_k=0, pinned=True),
            baseline(rows, "mono", True),
        )
    for row in rows:  # the scale group (synthetic model): emulated PCs x users vs mono on one core
        if row.kind == "fleet" and row.ok and row.model and row.pinned and row.spec_k == 0:
            check(
                f"{row.stages} emulated PCs x {row.users} users, {row.model}, vs mono (1 core)",
                1.85 if row.users == 2 else None,
                row,
                baseline(rows, "mono", True, row.model),
            )
    balanced = _find(
        rows, kind="fleet", users=1, spec_k=0, hop_delay_ms=0.0, pinned=False, stages=_most(rows)
    )
    if balanced is not None and balanced.stage_breakdown and len(balanced.stage_breakdown) > 1:
        computes = [part["compute_ms"] for part in balanced.stage_breakdown]
        found.append(
            {
                "target": "stage compute per token within 10% (min/max >= 0.9)",
                "goal": 0.9,
                "ratio": min(computes) / max(computes) if max(computes) > 0 else None,
                "ratio_spread": None,
                "met": max(computes) > 0 and min(computes) / max(computes) >= 0.9,
                "rows": [balanced.name, None],
            }
        )
    for row in rows:
        if (
            row.kind == "fleet"
            and row.ok
            and row.spec_k == "auto"
            and row.hop_delay_ms == 0
            and not row.pinned
            and not row.model
        ):
            plain = _find(
                rows,
                kind="fleet",
                stages=row.stages,
                users=row.users,
                spec_k=0,
                hop_delay_ms=0.0,
                pinned=False,
            )
            draft = ", prompt lookup" if "lookup" in row.name else ""
            check(
                f"adaptive spec >= 0.98x no spec ({row.stages} st, {row.users} users, LAN{draft})",
                0.98,
                row,
                plain,
            )
    stages = max((r.stages for r in rows if r.kind == "fleet" and r.hop_delay_ms == 50 and r.ok), default=0)
    delays = sorted({r.hop_delay_ms for r in rows if r.kind == "fleet" and r.ok and not r.pinned})
    for delay in delays if stages else []:
        naive = _find(rows, kind="fleet", stages=stages, users=1, spec_k=0, hop_delay_ms=delay, pinned=False)
        for label, candidate in (
            (
                "fleet's draft",
                _find(
                    rows,
                    kind="fleet",
                    stages=stages,
                    users=1,
                    spec_k="auto",
                    hop_delay_ms=delay,
                    pinned=False,
                    name=_name(rows, stages, 1, delay),
                ),
            ),
            (
                "prompt lookup",
                _find(
                    rows,
                    kind="fleet",
                    stages=stages,
                    users=1,
                    spec_k="auto",
                    hop_delay_ms=delay,
                    name=_name(rows, stages, 1, delay, True),
                ),
            ),
        ):
            if candidate is not None:
                check(
                    f"adaptive spec ({label}) vs no spec at {delay:g} ms/hop, 1 user",
                    1.5 if delay == 50 else None,
                    candidate,
                    naive,
                )
        full = max(
            (
                r
                for r in rows
                if r.ok
                and r.kind == "fleet"
                and r.stages == stages
                and r.hop_delay_ms == delay
                and r.users > 1
                and r.spec_k != 0
                and not r.pinned
                and "lookup" not in r.name
            ),
            key=lambda r: r.users,
            default=None,
        )
        check(f"full stack vs naive at {delay:g} ms/hop", 4.0 if delay == 50 else None, full, naive)
    return found


def _most(rows: Sequence[Row]) -> int:
    """The largest stage count among the fleet's own (not scale-group) rows."""
    return max((r.stages for r in rows if r.kind == "fleet" and not r.model), default=0)


def _name(rows: Sequence[Row], stages: int, users: int, delay: float, lookup: bool = False) -> str | None:
    """The name of the adaptive-spec row with the fleet's draft (or prompt lookup) for these settings."""
    for row in rows:
        if (
            row.kind == "fleet"
            and row.stages == stages
            and row.users == users
            and row.hop_delay_ms == delay
            and row.spec_k == "auto"
            and not row.pinned
            and ("lookup" in row.name) == lookup
        ):
            return row.name
    return None


# -------------------------------------------------------------------------------------------- text
_PRECISION_NAMES = {
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float32": "f32",
    "f32": "f32",
    "float16": "f16",
    "f16": "f16",
    "uint8_t": "u8",
    "u8": "u8",
    "int8_t": "i8",
    "i8": "i8",
    "u4": "u4",
}


def short_precision(value: object) -> str:
    """'bf16' for OpenVINO's "<Type: 'bfloat16'>" (and the like); other text unchanged, lower case."""
    text = str(value).strip().lower()
    if text.startswith("<type:"):
        text = text[len("<type:") :].strip(" '>\"")
    return _PRECISION_NAMES.get(text, text)


def short_precisions(precision: dict[str, Any]) -> dict[str, str]:
    return {
        key: ",".join(short_precision(v) for v in str(value).split(",")) if key != "weights" else str(value)
        for key, value in precision.items()
    }


def precision_text(precision: dict[str, str]) -> str:
    if not precision:
        return "-"
    return "/".join(str(precision.get(key, "?")).lower() for key in ("weights", "inference", "kv_cache"))


def _number(value: float | None, digits: int = 1, scale: float = 1.0, suffix: str = "") -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value * scale:.{digits}f}{suffix}"


def breakdown_text(breakdown: list[dict[str, float]] | None) -> str:
    if not breakdown:
        return "-"
    return " | ".join(
        f"{part['compute_ms']:.1f}/{part['wire_ms']:.1f}/{part['queue_ms']:.1f}" for part in breakdown
    )


COLUMNS = (
    "row",
    "st",
    "users",
    "K",
    "hop ms",
    "precision w/inf/kv",
    "tokens",
    "tok/s",
    "tok/s/user",
    "TTFT ms",
    "accept",
    "x mono",
    "x GenAI",
    "spread",
    "others",
    "coord",
    "paired ratio",
    "per stage ms/token: compute/wire/queue",
)


def k_text(row: Row) -> str:
    """The K setting; an adaptive row also shows the mean K it chose."""
    if row.spec_k == "auto" and row.mean_k is not None and row.ok:
        return f"auto {row.mean_k:.1f}"
    return str(row.spec_k)


def spread(row: Row) -> float | None:
    """(fastest - slowest) / fastest over a row's repeated measurements; None for a single one."""
    runs = row.details.get("runs_tok_s") or []
    return (max(runs) - min(runs)) / max(runs) if len(runs) > 1 and max(runs) > 0 else None


def table_cells(row: Row) -> list[str]:
    if not row.ok:
        return [
            row.name,
            str(row.stages),
            str(row.users),
            k_text(row),
            _number(row.hop_delay_ms, 0),
            precision_text(row.precision),
            row.status,
            "",
            "",
            "",
            "",
            "",
            "",
            "",
            "",
            "",
            "",
            "",
        ]
    return [
        row.name,
        str(row.stages),
        str(row.users),
        k_text(row),
        _number(row.hop_delay_ms, 0),
        precision_text(row.precision),
        str(row.tokens),
        _number(row.aggregate_tok_s),
        _number(row.per_user_tok_s),
        _number(row.ttft_s, 0, 1000.0),
        _number(row.acceptance_rate, 0, 100.0, "%"),
        _number(row.vs_mono, 2, 1, "x"),
        _number(row.vs_genai, 2, 1, "x"),
        _number(spread(row), 0, 100.0, "%"),
        _number(row.details.get("others_cpu"), 0, 100.0, "%"),
        _number(row.details.get("coordinator_cpu"), 0, 100.0, "%"),
        paired_text(row),
        breakdown_text(row.stage_breakdown),
    ]


def paired_text(row: Row) -> str:
    """'1.23x ±4% vs genai': the median per-round ratio to the paired row and the ratio's own spread."""
    ratio = row.paired_ratio
    if ratio is None:
        return "-"
    spread_of_ratio = row.ratio_spread
    return (
        f"{ratio:.2f}x"
        + (f" ±{spread_of_ratio / 2:.0%}" if spread_of_ratio is not None else "")
        + f" vs {row.versus}"
    )


def format_table(rows: Sequence[Row]) -> str:
    """A fixed-width text table; skipped and failed rows keep their place and say why."""
    cells = [list(COLUMNS)] + [table_cells(row) for row in rows]
    widths = [0] * len(COLUMNS)
    for line in cells:
        for index, cell in enumerate(line):
            if index == 6 and not cell.isdigit() and line is not cells[0]:
                continue  # a skip reason spills over the columns to its right
            widths[index] = max(widths[index], len(cell))
    rendered = []
    numeric = [
        False,
        True,
        True,
        False,
        True,
        False,
        True,
        True,
        True,
        True,
        True,
        True,
        True,
        True,
        True,
        True,
        False,
        False,
    ]
    for number, line in enumerate(cells):
        parts = [
            c.rjust(w) if numeric[i] and number else c.ljust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        ]
        if number and not line[6].isdigit():
            parts = parts[:6] + [line[6]]  # a skip or failure reason: it runs to the end of the line
        rendered.append("  ".join(parts).rstrip())
        if number == 0:
            rendered.append("  ".join("-" * w for w in widths))
    return "\n".join(rendered)


def format_targets(found: Sequence[dict[str, Any]]) -> str:
    lines = []
    for item in found:
        ratio = "n/a (rows missing)" if item["ratio"] is None else f"{item['ratio']:.2f}x"
        verdict = {True: "met", False: "NOT met", None: "(no target)" if item["goal"] is None else "-"}[
            item["met"]
        ]
        spread_of_ratio = item.get("ratio_spread")
        moved = f" (ratio moved {spread_of_ratio:.0%} over rounds)" if spread_of_ratio is not None else ""
        lines.append(f"  {item['target']:<62} {ratio:>10}  {verdict}{moved}")
    return "\n".join(lines)


def plot(rows: Sequence[Row], width: int = 100) -> str:
    """A horizontal bar chart of aggregate tok/s per measured row (plotext; plain text if that fails)."""
    measured = [row for row in rows if row.ok]
    if not measured:
        return ""
    names = [row.name for row in measured][::-1]
    values = [round(row.aggregate_tok_s, 1) for row in measured][::-1]
    try:
        import plotext

        plotext.terminal.limit(
            False, False
        )  # the chart's own size, not the terminal's (stdout may be a file)
        figure = plotext.figure
        figure.clear()
        figure.draw(figure.bar(names, values, orientation="h", labeled=True, width=0.6))
        figure.plot_size(width, min(2 * len(measured) + 4, 120))
        figure.title("aggregate tok/s per configuration")
        figure.theme("clear")
        return str(plotext.uncolorize(str(figure.build())))
    except Exception:  # noqa: BLE001 - the plot is decoration; never lose the results over it
        top = max(values) or 1.0
        label = max(len(name) for name in names)
        return "\n".join(
            f"{name:>{label}} {'#' * int(round(value / top * (width - label - 10)))} {value}"
            for name, value in zip(names[::-1], values[::-1], strict=True)
        )


def document(rows: Sequence[Row], machine: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """The JSON document: settings, the machine and versions, every row, and the targets."""
    return {
        "settings": settings,
        "machine": machine,
        "rows": [row.to_dict() for row in rows],
        "targets": targets(rows),
    }


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, default=str)
