"""Provides the bench's row plan: what each row measures, its group (`--only GROUP`) and its paired
baseline.

A row names the row it is compared with (`versus`); the runner measures both in the same rounds, one
right after the other (interleaved A/B windows), so a ratio is taken between adjacent measurements
and its own spread over the rounds is reported, instead of dividing two bests taken minutes apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from fleettui.bench.results import Row
from fleettui.config.fleet import Fleet

K_SWEEP = (2, 4, 8)
GROUPS = ("anchors", "fleet", "spec", "delay", "pcs", "scale", "batch", "grammar")
# the scale group: a 1B shape where compute, not overhead, dominates
SCALE_MODEL = "synthetic:llama-3.2-1b"
SCALE_USERS = (1, 2, 4)
BATCH_USERS = (1, 2, 4, 8)
BATCH_STAGES = (1, 2, 3)
# Rounds of a LAN fleet group whose rows are paired with one another (speculation against none):
# more than the other groups' 3, since a single pair is noisy next to a 0.98x bar
# (docs/performance.md#method).
PAIRED_REPEATS = 5


@dataclass(frozen=True)
class RowSpec:
    """What to measure in one row."""

    kind: str  # mono | genai | fleet
    stages: int = 1
    users: int = 1
    spec_k: int | str = 0  # 0 = off, "auto" = adaptive, n = fixed
    hop_delay_ms: float = 0.0
    pinned: bool = False
    device: str = "CPU"
    # "" = the fleet's draft; "prompt-lookup" = swap in the free prompt-lookup drafter
    draft: str = ""
    model: str = ""  # "" = the fleet's model; else e.g. synthetic:llama-3.2-1b (the scale group)
    # pinned mono only: n copies at once, one per core (what n PCs could do at best here)
    copies: int = 1
    batching: str = ""  # "" = the workers' default (on); "on" / "off": switched so for this row
    # answers constrained by the bench's JSON schema (`fleettui.bench.grammar_bench`)
    grammar: bool = False
    group: str = field(default="fleet", compare=False)  # the --only group this row belongs to
    # the row it is paired with (measured in the same rounds)
    versus: str = field(default="", compare=False)

    @property
    def name(self) -> str:
        suffix = (
            " synth-1b" if self.model == SCALE_MODEL else (f" {self.model}" if self.model else "")
        )
        if self.kind != "fleet":
            return (
                self.kind
                + (" 1core" if self.pinned else "")
                + (f" x{self.copies}" if self.copies > 1 else "")
                + (f" {self.device}" if self.device != "CPU" else "")
                + suffix
            )
        spec = (
            "nospec"
            if self.spec_k == 0
            else f"spec {self.spec_k}" + (" lookup" if self.draft else "")
        )
        delay = f" @{self.hop_delay_ms:g}ms" if self.hop_delay_ms else ""
        batching = f" batch {self.batching}" if self.batching else ""
        grammar = " json" if self.grammar else ""
        return (
            f"{'pcs' if self.pinned else 'fleet'} {self.stages}st {self.users}u "
            f"{spec}{delay}{batching}{grammar}"
            f"{suffix}"
        )

    @property
    def fleet_key(self) -> tuple[str, int, bool, float]:
        """Rows that share one running fleet: same model, stages, pinning and hop delay."""
        return (self.model, self.stages, self.pinned, self.hop_delay_ms)


def _fleet_rows(
    fleet: Fleet, quick: bool, k: int | str, speculate: bool, users: int
) -> list[RowSpec]:
    stages = max(1, len(fleet.hosts))
    on = [k] if speculate and k != 0 else []
    genai, mono_1core = "genai", "mono 1core"
    if quick:
        return [
            RowSpec("fleet", 1, group="fleet", versus=genai),
            RowSpec("fleet", stages, group="fleet", versus=genai),
            RowSpec("fleet", stages, users, on[0] if on else 0, group="spec"),
            RowSpec("fleet", stages, hop_delay_ms=10.0, group="delay"),
        ]
    rows: list[RowSpec] = []
    user_counts = sorted({1, min(2, users), users})
    for count in range(1, stages + 1):
        for users_now in user_counts:
            plain = RowSpec(
                "fleet", count, users_now, 0, group="fleet", versus=genai if users_now == 1 else ""
            )
            rows.append(plain)
            rows += [
                RowSpec("fleet", count, users_now, spec, group="spec", versus=plain.name)
                for spec in on
            ]
            if speculate and count == stages and users_now == 1:
                # prompt lookup: a free drafter, the honest contrast to a self-draft as large as the
                # target; beside its pair, so the two are measured seconds apart (this machine
                # drifts by the minute)
                rows.append(
                    RowSpec(
                        "fleet",
                        stages,
                        1,
                        "auto",
                        draft="prompt-lookup",
                        group="spec",
                        versus=plain.name,
                    )
                )
    plain_1u = RowSpec("fleet", stages, 1, 0).name
    if speculate:
        rows += [
            RowSpec("fleet", stages, 1, fixed, group="spec", versus=plain_1u)
            for fixed in K_SWEEP
            if fixed <= fleet.speculation.max_k and fixed != k
        ]
    for delay in (10.0, 50.0):
        naive = RowSpec("fleet", stages, 1, 0, delay, group="delay")
        rows.append(naive)
        rows += [
            RowSpec("fleet", stages, 1, spec, delay, group="delay", versus=naive.name)
            for spec in on
        ]
        rows += [
            RowSpec("fleet", stages, users, spec, delay, group="delay", versus=naive.name)
            for spec in on
        ] or [RowSpec("fleet", stages, users, 0, delay, group="delay", versus=naive.name)]
        if speculate and delay == 50.0:
            rows += [
                RowSpec(
                    "fleet",
                    stages,
                    count,
                    "auto",
                    delay,
                    draft="prompt-lookup",
                    group="delay",
                    versus=naive.name,
                )
                for count in (1, users)
            ]
    pcs_plain = RowSpec("fleet", stages, 2, 0, pinned=True, group="pcs", versus=mono_1core)
    rows += [
        RowSpec("fleet", 1, 1, 0, pinned=True, group="pcs", versus=mono_1core),
        RowSpec("fleet", stages, 1, 0, pinned=True, group="pcs", versus=mono_1core),
        pcs_plain,
    ]
    # speculation on emulated PCs is a LAN row too (its draft computes on the PCs' cores): paired
    # with no speculation on the same PCs, so the LAN speculation target covers it
    rows += [
        RowSpec("fleet", stages, 2, spec, pinned=True, group="pcs", versus=pcs_plain.name)
        for spec in on
    ]
    return rows + ([ceiling(stages, "", "pcs")] if stages > 1 else [])


def ceiling(stages: int, model: str, group: str) -> RowSpec:
    """STAGES independent monos at once, one per core, against one: the most STAGES emulated PCs can
    give on this machine (shared memory, caches and the host's other load), measured in the PCs'
    rounds."""
    mono = RowSpec("mono", pinned=True, model=model)
    return RowSpec("mono", pinned=True, model=model, copies=stages, group=group, versus=mono.name)


def scale_rows(stages: int = 2) -> list[RowSpec]:
    """Mono on one core vs emulated PCs (one core each) with 1/2/4 users, on the synthetic 1B
    shape."""
    mono = RowSpec("mono", pinned=True, model=SCALE_MODEL, group="scale")
    return (
        [mono]
        + [
            RowSpec(
                "fleet",
                stages,
                users,
                0,
                pinned=True,
                model=SCALE_MODEL,
                group="scale",
                versus=mono.name,
            )
            for users in SCALE_USERS
        ]
        + [ceiling(stages, SCALE_MODEL, "scale")]
    )


def batch_rows(quick: bool) -> list[RowSpec]:
    """Emulated PCs (one core each) with 1..8 users, batched inference on and off side by side; the
    batched row of each size is paired with the unbatched one, and the last user of a multi-user row
    joins late."""
    users = (1, 4) if quick else BATCH_USERS
    stages = (1, 2) if quick else BATCH_STAGES
    rows: list[RowSpec] = []
    for count in stages:
        for users_now in users:
            off = RowSpec("fleet", count, users_now, 0, pinned=True, batching="off", group="batch")
            rows += [off, replace(off, batching="on", versus=off.name)]
    return rows


def grammar_rows(fleet: Fleet, k: int | str, speculate: bool) -> list[RowSpec]:
    """A schema-constrained answer against free text on the same fleet, with speculation off and
    (when the fleet speculates) on: tok/s, and the acceptance of drafts with the grammar on (drafts
    cut at the first token it rejects) against off."""
    stages = max(1, len(fleet.hosts))
    rows: list[RowSpec] = []
    for spec_k in [0] + ([k] if speculate and k != 0 else []):
        free = RowSpec("fleet", stages, 1, spec_k, group="grammar")
        rows += [free, replace(free, grammar=True, versus=free.name)]
    return rows


def plan_rows(
    fleet: Fleet,
    quick: bool,
    spec_k: int | None = None,
    no_spec: bool = False,
    only: str | None = None,
) -> list[RowSpec]:
    """The rows of a profile for this fleet: N = its hosts, M = its sessions (at most 4 here).

    `only` keeps one group and the rows it is paired with (so `--only pcs` also measures mono on one
    core)."""
    users = max(1, min(fleet.sessions.max_sessions, 2 if quick else 4))
    speculate = not no_spec and fleet.speculation.draft != "none"
    k: int | str = spec_k if spec_k is not None else fleet.speculation.k
    anchors = [RowSpec("mono", group="anchors"), RowSpec("genai", group="anchors")]
    if not quick:
        anchors += [
            RowSpec("mono", pinned=True, group="anchors"),
            RowSpec("genai", pinned=True, group="anchors"),
            RowSpec("mono", device="GPU", group="anchors"),
        ]
    rows = anchors + _fleet_rows(fleet, quick, k, speculate, users)
    if not quick:
        rows += scale_rows(max(2, min(len(fleet.hosts), 2)))
    if only == "batch" or not quick:
        rows += batch_rows(quick)
    if only == "grammar" or not quick:
        # a free row another group measures already is the pair's
        named = {row.name for row in rows}
        rows += [row for row in grammar_rows(fleet, k, speculate) if row.name not in named]
    if only is None:
        return rows
    chosen = {row.name for row in rows if row.group == only}
    wanted = {row.versus for row in rows if row.group == only}
    return [row for row in rows if row.name in chosen or row.name in wanted]


def group_repeats(members: list[RowSpec], repeats: int) -> int:
    """Rounds for one fleet group: `PAIRED_REPEATS` in a full run (repeats > 1) when the group is on
    a LAN (no hop delay, where speculation's margins are a few %) and one of its rows is paired with
    another of its rows; else `repeats` (behind slow hops the ratios are several x, and each round
    takes long)."""
    names = {member.name for member in members}
    lan = members[0].hop_delay_ms == 0
    if repeats > 1 and lan and any(member.versus in names for member in members):
        return max(repeats, PAIRED_REPEATS)
    return repeats


@dataclass(frozen=True)
class Schedule:
    """How the bench measures its rows: fleet rows in groups sharing one fleet
    (`RowSpec.fleet_key`), each with the baselines its rows are paired with measured in its rounds;
    the other baselines alone."""

    groups: dict[tuple[str, int, bool, float], list[RowSpec]]
    partners: dict[tuple[str, int, bool, float], list[RowSpec]]  # per group
    baselines: list[RowSpec]  # every row that is not a fleet row (mono, GenAI), paired or not
    alone: list[RowSpec]  # baselines no fleet row is paired with


def schedule(specs: list[RowSpec]) -> Schedule:
    """The groups, their partners and the lone baselines of SPECS (in their order)."""
    groups: dict[tuple[str, int, bool, float], list[RowSpec]] = {}
    for spec in specs:
        if spec.kind == "fleet":
            groups.setdefault(spec.fleet_key, []).append(spec)
    baselines = [spec for spec in specs if spec.kind != "fleet"]
    partners = {key: group_partners(members, baselines) for key, members in groups.items()}
    paired = {spec.name for each in partners.values() for spec in each}
    return Schedule(
        groups, partners, baselines, [spec for spec in baselines if spec.name not in paired]
    )


def measurement_count(specs: list[RowSpec], repeats: int) -> int:
    """How many measurements the bench announces as rows: each fleet row once per round of its
    group, each baseline that no fleet row is paired with once per round (paired ones run inside
    their groups' rounds)."""
    planned = schedule(specs)
    return len(planned.alone) * repeats + sum(
        len(members) * group_repeats(members, repeats) for members in planned.groups.values()
    )


def group_partners(members: list[RowSpec], baselines: list[RowSpec]) -> list[RowSpec]:
    """The baselines measured in a fleet group's rounds: those its rows are paired with, and the
    ceiling of its PCs (as many monos at once as the group has stages) paired with one of those."""
    named = {member.versus for member in members}
    first = members[0]
    return sorted(
        (
            spec
            for spec in baselines
            if spec.name in named
            or (
                spec.copies == first.stages > 1
                and spec.versus in named
                and spec.model == first.model
                and first.pinned
            )
        ),
        key=lambda spec: spec.name,
    )


def new_row(spec: RowSpec) -> Row:
    """The (not yet measured) result row of SPEC."""
    return Row(
        spec.name,
        spec.kind,
        spec.stages,
        spec.users,
        spec.spec_k,
        spec.hop_delay_ms,
        spec.pinned,
        model=spec.model,
        group=spec.group,
        versus=spec.versus,
        copies=spec.copies,
    )
