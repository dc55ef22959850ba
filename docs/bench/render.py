"""Renders a bench JSON (`fleettui bench --json`) as a Markdown table and two SVG plots.

Run from the repository root: `python3 docs/bench/render.py docs/bench/<date>-<commit>.json`.
It prints the table (what docs/performance.md shows) and writes `<json stem>-users.svg` (tok/s against
users on a LAN) and `<json stem>-delay.svg` (tok/s against the delay added to each hop) beside the JSON.
Standard library only, so it runs without the project's environment.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

Row = dict[str, Any]
Series = tuple[str, list[tuple[float, float]]]

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")


# ------------------------------------------------------------------------------------------- table
def _cell(value: object, digits: int = 1, scale: float = 1.0, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, (int, float)):
        return f"{value * scale:.{digits}f}{suffix}"
    return str(value)


def _k(row: Row) -> str:
    if row.get("spec_k") == "auto" and row.get("mean_k") is not None:
        return f"auto ({row['mean_k']:.1f})"
    return str(row.get("spec_k", 0))


def _paired(row: Row) -> str:
    if row.get("paired_ratio") is None:
        return "-"
    spread = row.get("ratio_spread")
    plus = f" ±{spread / 2:.0%}" if spread is not None else ""
    return f"{row['paired_ratio']:.2f}x{plus} vs `{row['versus']}`"


def _stages(row: Row) -> str:
    parts = row.get("stage_breakdown") or []
    return " \\| ".join(f"{p['compute_ms']:.1f}/{p['wire_ms']:.1f}/{p['queue_ms']:.1f}" for p in parts) or "-"


def table(doc: dict[str, Any]) -> str:
    """One Markdown line per row: the bench's own table, minus the columns that only help a live run."""
    head = (
        "| row | stages | users | K (mean) | hop ms | tok/s | tok/s/user | TTFT ms | accept | x mono "
        "| paired ratio | per stage ms/token compute/wire/queue |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for row in doc["rows"]:
        if row.get("status", "ok") != "ok":
            lines.append(f"| {row['name']} | {row['stages']} | {row['users']} | {row['status']} |" + " |" * 8)
            continue
        cells = (
            row["name"],
            row["stages"],
            row["users"],
            _k(row),
            _cell(row["hop_delay_ms"], 0),
            _cell(row["aggregate_tok_s"]),
            _cell(row["per_user_tok_s"]),
            _cell(row["ttft_s"], 0, 1000.0),
            _cell(row["acceptance_rate"], 0, 100.0, "%"),
            _cell(row["vs_mono"], 2, 1.0, "x"),
            _paired(row),
            _stages(row),
        )
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- plots
def _ok(rows: Iterable[Row]) -> list[Row]:
    return [row for row in rows if row.get("status", "ok") == "ok" and row.get("kind") == "fleet"]


def users_series(rows: Sequence[Row]) -> list[Series]:
    """tok/s against users on a LAN, one line per stage count and speculation setting."""
    found: dict[str, list[tuple[float, float]]] = {}
    for row in _ok(rows):
        if (
            row["hop_delay_ms"]
            or row.get("model")
            or row["spec_k"] not in (0, "auto")
            or "lookup" in row["name"]
            or " batch " in row["name"]
        ):
            continue
        where = "emulated PCs" if row.get("pinned") else "stages share the CPUs"
        spec = "adaptive speculation" if row["spec_k"] == "auto" else "no speculation"
        label = f"{row['stages']} stage{'s' if row['stages'] > 1 else ''}, {where}, {spec}"
        found.setdefault(label, []).append((row["users"], row["aggregate_tok_s"]))
    return [(label, sorted(points)) for label, points in found.items() if len(points) > 1]


def delay_series(rows: Sequence[Row]) -> list[Series]:
    """tok/s against the delay added to each hop, for the rows measured at more than one delay."""
    found: dict[str, list[tuple[float, float]]] = {}
    for row in _ok(rows):
        if row.get("pinned") or row.get("model") or row["spec_k"] not in (0, "auto"):
            continue
        drafter = "prompt lookup" if "lookup" in row["name"] else "self-int4 draft"
        spec = f"adaptive, {drafter}" if row["spec_k"] == "auto" else "no speculation"
        label = f"{row['stages']} stages, {row['users']} user{'s' if row['users'] > 1 else ''}, {spec}"
        found.setdefault(label, []).append((row["hop_delay_ms"], row["aggregate_tok_s"]))
    return [(label, sorted(points)) for label, points in found.items() if len(points) > 1]


def svg_plot(title: str, x_label: str, series: Sequence[Series], width: int = 720, height: int = 420) -> str:
    """A line plot with markers, linear axes from 0, and a legend under the plot area."""
    left, right, top, bottom = 64, 20, 40, 60 + 18 * len(series)
    plot_w, plot_h = width - left - right, height - top - 60
    total_h = top + plot_h + bottom
    xs = [x for _, points in series for x, _ in points]
    ys = [y for _, points in series for _, y in points]
    x_max = _nice(max(xs, default=1.0))
    y_max = _nice(max(ys, default=1.0))

    def px(x: float) -> float:
        return left + plot_w * x / x_max

    def py(y: float) -> float:
        return top + plot_h * (1 - y / y_max)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{total_h}" '
        f'viewBox="0 0 {width} {total_h}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{total_h}" fill="white"/>',
        f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>',
    ]
    for i in range(6):
        y = y_max * i / 5
        out.append(
            f'<line x1="{left}" x2="{left + plot_w}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="#ddd"/>'
        )
        out.append(f'<text x="{left - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    for x in sorted(set(xs)):
        out.append(f'<text x="{px(x):.1f}" y="{top + plot_h + 16}" text-anchor="middle">{x:g}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#444"/>')
    out.append(
        f'<text x="{left + plot_w / 2}" y="{top + plot_h + 34}" text-anchor="middle">{escape(x_label)}</text>'
    )
    out.append(
        f'<text transform="translate(16 {top + plot_h / 2}) rotate(-90)" text-anchor="middle">'
        "aggregate tok/s</text>"
    )
    for index, (label, points) in enumerate(series):
        colour = COLOURS[index % len(COLOURS)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for x, y in points:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3.5" fill="{colour}"/>')
        legend_y = top + plot_h + 54 + 18 * index
        out.append(
            f'<line x1="{left}" x2="{left + 24}" y1="{legend_y - 4}" y2="{legend_y - 4}" '
            f'stroke="{colour}" stroke-width="2"/>'
        )
        out.append(f'<text x="{left + 30}" y="{legend_y}">{escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _nice(value: float) -> float:
    """The smallest 1, 2 or 5 times a power of ten at or above value."""
    step = 1.0
    while step * 10 <= value:
        step *= 10
    for factor in (1, 2, 5, 10):
        if step * factor >= value:
            return step * factor
    return step * 10


def _batched(rows: Iterable[Row]) -> list[Row]:
    return [row for row in _ok(rows) if " batch " in row["name"]]


def batch_series(rows: Sequence[Row]) -> list[Series]:
    """tok/s against users of the batch group, one line per stage count with batching on and off."""
    found: dict[str, list[tuple[float, float]]] = {}
    for row in _batched(rows):
        mode = "batched" if row["name"].endswith("batch on") else "one inference per session"
        label = f"{row['stages']} emulated PC{'s' if row['stages'] > 1 else ''}, {mode}"
        found.setdefault(label, []).append((row["users"], row["aggregate_tok_s"]))
    return [(label, sorted(points)) for label, points in sorted(found.items()) if len(points) > 1]


def batch_table(doc: dict[str, Any]) -> str:
    """Batched vs not per PCs and users: tok/s, the ratio, and a late-joining user's time to first token."""
    cells: dict[tuple[int, int], dict[str, Row]] = {}
    for row in _batched(doc["rows"]):
        cells.setdefault((row["stages"], row["users"]), {})[row["name"].rsplit(" ", 1)[1]] = row
    if not cells:
        return ""
    lines = [
        "| PCs | users | tok/s unbatched | tok/s batched | batched / unbatched | joiner's TTFT unbatched | batched |",
        "|---|---|---|---|---|---|---|",
    ]
    for (stages, users), pair in sorted(cells.items()):
        off, on = pair.get("off", {}), pair.get("on", {})
        rate_off, rate_on = off.get("aggregate_tok_s"), on.get("aggregate_tok_s")
        ratio = rate_on / rate_off if rate_on and rate_off else None
        join = [row.get("details", {}).get("join_ttft_s") for row in (off, on)]
        lines.append(
            f"| {stages} | {users} | {_cell(rate_off)} | {_cell(rate_on)} | {_cell(ratio, 2, 1, 'x')} | "
            f"{_cell(join[0], 0, 1000.0, ' ms')} | {_cell(join[1], 0, 1000.0, ' ms')} |"
        )
    return "\n".join(lines)


def plots(rows: Sequence[Row]) -> dict[str, str]:
    """The SVG text of each plot, by the suffix of its file name (a plot with no rows is left out)."""
    found = {
        "users": svg_plot("tok/s against users, LAN (no added hop delay)", "users", users_series(rows)),
        "delay": svg_plot("tok/s against the delay added to each hop", "ms per hop", delay_series(rows)),
    }
    if _batched(rows):
        found["batch"] = svg_plot("tok/s against users, batched vs not", "users", batch_series(rows))
    return found


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print("usage: render.py BENCH.json", file=sys.stderr)
        return 2
    source = Path(argv[0])
    doc = json.loads(source.read_text(encoding="utf-8"))
    stem = source.with_suffix("")
    for suffix, svg in plots(doc["rows"]).items():
        stem.with_name(f"{stem.name}-{suffix}.svg").write_text(svg, encoding="utf-8")
    print(table(doc))
    batched = batch_table(doc)
    if batched:
        print("\n" + batched)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
