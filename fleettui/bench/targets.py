"""Provides the bench's ratios: each row against its baseline, and the goals of `targets.toml`
met or not."""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from fleettui.bench.results import Row

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

GOALS_FILE = Path(__file__).with_name("targets.toml")


@dataclass(frozen=True)
class Goals:
    """The bench's goals, one ratio each (`targets.toml` says what each measures)."""

    single_stage_vs_genai: float
    emulated_pcs_two_users_vs_mono: float
    scale_model_two_users_vs_mono: float
    stage_compute_balance: float
    adaptive_speculation_lan_vs_none: float
    adaptive_speculation_slow_hops_vs_none: float
    full_stack_slow_hops_vs_naive: float
    slow_hop_delay_ms: float


@functools.cache
def load_goals(path: Path = GOALS_FILE) -> Goals:
    """The goals of a targets file; a missing or unknown key is a ValueError naming it."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    values: dict[str, Any] = dict(data.get("goals", {}))
    values["slow_hop_delay_ms"] = data.get("slow_hops", {}).get("hop_delay_ms")
    names = {field.name for field in fields(Goals)}
    unknown = sorted(set(values) - names)
    missing = sorted(name for name in names if not isinstance(values.get(name), (int, float)))
    if unknown or missing:
        raise ValueError(f"{path}: unknown goals {unknown}, missing or not numbers {missing}")
    return Goals(**{name: float(values[name]) for name in names})


# ------------------------------------------------------------------------------------------- ratios
def baseline(rows: Sequence[Row], kind: str, pinned: bool, model: str = "") -> Row | None:
    """The CPU mono/GenAI row a configuration is compared with: pinned rows with the pinned
    baseline."""
    for row in rows:
        if (
            row.kind == kind
            and row.pinned == pinned
            and row.ok
            and row.details.get("device", "CPU") == "CPU"
            and row.model == model
            and row.copies == 1
        ):
            return row
    return None


def ratio_of(over: Row | None, under: Row | None) -> tuple[float | None, float | None]:
    """`over` against `under` and the spread of that ratio: per round in adjacent windows when
    `over` was measured against `under`, else best over best (spread unknown)."""
    if over and under and over.versus == under.name and over.paired_ratio is not None:
        return over.paired_ratio, over.ratio_spread
    return (
        over.aggregate_tok_s / under.aggregate_tok_s
        if over and under and under.aggregate_tok_s
        else None
    ), None


def ceiling_ratio(rows: Sequence[Row], copies: int, model: str = "") -> float | None:
    """What COPIES monos at once (one per core) gave against one: the most that many PCs can give
    here."""
    return ratio_of(
        _find(rows, kind="mono", copies=copies, model=model), baseline(rows, "mono", True, model)
    )[0]


def add_ratios(rows: Sequence[Row]) -> None:
    for row in rows:
        if not row.ok:
            continue
        mono = baseline(rows, "mono", row.pinned, row.model)
        genai = baseline(rows, "genai", row.pinned, row.model)
        row.vs_mono = (
            row.aggregate_tok_s / mono.aggregate_tok_s if mono and mono.aggregate_tok_s else None
        )
        row.vs_genai = (
            row.aggregate_tok_s / genai.aggregate_tok_s if genai and genai.aggregate_tok_s else None
        )


def _find(rows: Sequence[Row], **wanted: Any) -> Row | None:
    wanted.setdefault("model", "")
    for row in rows:
        if row.ok and all(getattr(row, key) == value for key, value in wanted.items()):
            return row
    return None


def targets(rows: Sequence[Row], goals: Goals | None = None) -> list[dict[str, Any]]:
    """The bench's targets, each with the measured ratio (None when the rows to compare are
    missing); the goals are `targets.toml`'s unless given."""
    goals = goals or load_goals()
    slow = goals.slow_hop_delay_ms
    found: list[dict[str, Any]] = []

    def check(
        name: str,
        goal: float | None,
        over: Row | None,
        under: Row | None,
        ceiling: float | None = None,
    ) -> None:
        ratio, spread_of_ratio = ratio_of(over, under)
        met = None if ratio is None or goal is None else ratio >= goal
        found.append(
            {
                "target": name,
                "goal": goal,
                "ratio": ratio,
                "ratio_spread": spread_of_ratio,
                "met": met,
                "rows": [over.name if over else None, under.name if under else None],
                # the same ratio for independent monos, one per PC (upper bound here)
                "ceiling": ceiling,
            }
        )

    check(
        f"1-stage fleet >= {goals.single_stage_vs_genai:g}x GenAI",
        goals.single_stage_vs_genai,
        _find(rows, kind="fleet", stages=1, users=1, spec_k=0, hop_delay_ms=0.0, pinned=False),
        baseline(rows, "genai", False),
    )
    pcs = max((r.stages for r in rows if r.kind == "fleet" and r.pinned and r.ok), default=0)
    if pcs >= 2:
        check(
            f"{pcs} emulated PCs x 2 users >= {goals.emulated_pcs_two_users_vs_mono:g}x mono (1 "
            "core)",
            goals.emulated_pcs_two_users_vs_mono,
            _find(rows, kind="fleet", stages=pcs, users=2, spec_k=0, pinned=True),
            baseline(rows, "mono", True),
            ceiling_ratio(rows, pcs),
        )
    for row in rows:  # the scale group (synthetic model): emulated PCs x users vs mono on one core
        if row.kind == "fleet" and row.ok and row.model and row.pinned and row.spec_k == 0:
            check(
                f"{row.stages} emulated PCs x {row.users} users, {row.model}, vs mono (1 core)",
                goals.scale_model_two_users_vs_mono if row.users == 2 else None,
                row,
                baseline(rows, "mono", True, row.model),
                ceiling_ratio(rows, row.stages, row.model),
            )
    balanced = _find(
        rows, kind="fleet", users=1, spec_k=0, hop_delay_ms=0.0, pinned=False, stages=_most(rows)
    )
    if balanced is not None and balanced.stage_breakdown and len(balanced.stage_breakdown) > 1:
        computes = [part["compute_ms"] for part in balanced.stage_breakdown]
        even = goals.stage_compute_balance
        found.append(
            {
                "target": f"stage compute per token within {1 - even:.0%} (min/max >= {even:g})",
                "goal": even,
                "ratio": min(computes) / max(computes) if max(computes) > 0 else None,
                "ratio_spread": None,
                "met": max(computes) > 0 and min(computes) / max(computes) >= even,
                "rows": [balanced.name, None],
            }
        )
    for row in rows:
        if (
            row.kind == "fleet"
            and row.ok
            and row.spec_k == "auto"
            and row.hop_delay_ms == 0
            and not row.model
        ):
            plain = _find(
                rows,
                kind="fleet",
                stages=row.stages,
                users=row.users,
                spec_k=0,
                hop_delay_ms=0.0,
                pinned=row.pinned,
            )
            draft = ", prompt lookup" if "lookup" in row.name else ""
            where = ", emulated PCs" if row.pinned else ""
            lan = goals.adaptive_speculation_lan_vs_none
            check(
                f"adaptive spec >= {lan:g}x no spec ({row.stages} st, {row.users} users, "
                f"LAN{where}{draft})",
                lan,
                row,
                plain,
            )
    stages = max(
        (r.stages for r in rows if r.kind == "fleet" and r.hop_delay_ms == slow and r.ok), default=0
    )
    delays = sorted({r.hop_delay_ms for r in rows if r.kind == "fleet" and r.ok and not r.pinned})
    for delay in delays if stages else []:
        naive = _find(
            rows, kind="fleet", stages=stages, users=1, spec_k=0, hop_delay_ms=delay, pinned=False
        )
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
                check(  # the goal is the fleet's draft's; prompt lookup is reported beside it
                    f"adaptive spec ({label}) vs no spec at {delay:g} ms/hop, 1 user",
                    goals.adaptive_speculation_slow_hops_vs_none
                    if delay == slow and label == "fleet's draft"
                    else None,
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
        check(
            f"full stack vs naive at {delay:g} ms/hop",
            goals.full_stack_slow_hops_vs_naive if delay == slow else None,
            full,
            naive,
        )
    return found


def _most(rows: Sequence[Row]) -> int:
    """The largest stage count among the fleet's own (not scale-group) rows."""
    return max((r.stages for r in rows if r.kind == "fleet" and not r.model), default=0)


def _name(
    rows: Sequence[Row], stages: int, users: int, delay: float, lookup: bool = False
) -> str | None:
    """The name of the adaptive-spec row with the fleet's draft (or prompt lookup) for these
    settings."""
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
