"""Provides the bench's report: the table, the targets' lines, the plot and the JSON document.

Rows and the time split live in `bench.results`, ratios and targets in `bench.targets` (re-exported
here)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from fleettui.bench.results import JSON_FIELDS, Row, Trip, stage_breakdown
from fleettui.bench.targets import add_ratios, baseline, targets

__all__ = [
    "JSON_FIELDS",
    "Row",
    "Trip",
    "add_ratios",
    "baseline",
    "document",
    "dumps",
    "format_table",
    "format_targets",
    "plot",
    "short_precision",
    "short_precisions",
    "stage_breakdown",
    "targets",
]


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
    """'bf16' for OpenVINO's "<Type: 'bfloat16'>" (and the like); other text unchanged, lower
    case."""
    text = str(value).strip().lower()
    if text.startswith("<type:"):
        text = text[len("<type:") :].strip(" '>\"")
    return _PRECISION_NAMES.get(text, text)


def short_precisions(precision: dict[str, Any]) -> dict[str, str]:
    return {
        key: ",".join(short_precision(v) for v in str(value).split(","))
        if key != "weights"
        else str(value)
        for key, value in precision.items()
    }


def precision_text(precision: dict[str, str]) -> str:
    if not precision:
        return "-"
    return "/".join(
        str(precision.get(key, "?")).lower() for key in ("weights", "inference", "kv_cache")
    )


def _number(value: float | None, digits: int = 1, scale: float = 1.0, suffix: str = "") -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value * scale:.{digits}f}{suffix}"


def breakdown_text(breakdown: list[dict[str, float]] | None) -> str:
    if not breakdown:
        return "-"
    return " | ".join(
        f"{part['compute_ms']:.1f}/{part['wire_ms']:.1f}/{part['queue_ms']:.1f}"
        for part in breakdown
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
    """'1.23x ±4% vs genai': the median per-round ratio to the paired row and the ratio's own
    spread."""
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
            # a skip or failure reason: it runs to the end of the line
            parts = parts[:6] + [line[6]]
        rendered.append("  ".join(parts).rstrip())
        if number == 0:
            rendered.append("  ".join("-" * w for w in widths))
    return "\n".join(rendered)


def format_targets(found: Sequence[dict[str, Any]]) -> str:
    lines = []
    for item in found:
        ratio = "n/a (rows missing)" if item["ratio"] is None else f"{item['ratio']:.2f}x"
        verdict = {
            True: "met",
            False: "NOT met",
            None: "(no target)" if item["goal"] is None else "-",
        }[item["met"]]
        spread_of_ratio = item.get("ratio_spread")
        moved = (
            f" (ratio moved {spread_of_ratio:.0%} over rounds)"
            if spread_of_ratio is not None
            else ""
        )
        top = item.get("ceiling")
        if top and item["ratio"] is not None:
            share = item["ratio"] / top
            moved += f"; ceiling here {top:.2f}x (independent monos, one per PC): {share:.0%} of it"
        lines.append(f"  {item['target']:<62} {ratio:>10}  {verdict}{moved}")
    return "\n".join(lines)


def plot(rows: Sequence[Row], width: int = 100) -> str:
    """A horizontal bar chart of aggregate tok/s per measured row (plotext; plain text if that
    fails)."""
    measured = [row for row in rows if row.ok]
    if not measured:
        return ""
    names = [row.name for row in measured][::-1]
    values = [round(row.aggregate_tok_s, 1) for row in measured][::-1]
    try:
        import plotext

        # the chart's own size, not the terminal's (stdout may be a file)
        plotext.terminal.limit(False, False)
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


def document(
    rows: Sequence[Row], machine: dict[str, Any], settings: dict[str, Any]
) -> dict[str, Any]:
    """The JSON document: settings, the machine and versions, every row, and the targets."""
    return {
        "settings": settings,
        "machine": machine,
        "rows": [row.to_dict() for row in rows],
        "targets": targets(rows),
    }


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, default=str)
