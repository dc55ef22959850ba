"""Property tests (hypothesis) of the command line and the fleet-file loader: every input is
accepted or refused with one line (exit 2; a fleet file's refusal names file, line and key); nothing
else escapes.

Example counts: CLI_EXAMPLES argument lists, FLEET_EXAMPLES generated TOML documents, BYTES_EXAMPLES
mutated fleet files (hypothesis' derandomized profile: the same examples each run)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleettui import cli
from fleettui.config.fleet import _HOST_KEYS, DEFAULT_FLEET, RUNTIME_KEYS, load_fleet
from fleettui.errors import FleetError

CLI_EXAMPLES = 400
FLEET_EXAMPLES = 400
BYTES_EXAMPLES = 300
PROPERTY = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def examples(count: int) -> settings:
    return settings(PROPERTY, max_examples=count)


LOCATED = re.compile(r"^\S.*?(:\d+)?: [^\s:]+.*: .+$")  # path[:line]: key: reason


class WouldStart(BaseException):  # noqa: N818 - not an error: the command got past every check
    """Raised where a command would start its event loop, its TUI or a measurement: it validated
    its input."""


def would_start(*_args: Any, **_kwargs: Any) -> Any:
    raise WouldStart


# -- the command line
# ---------------------------------------------------------------------------------------

COMMANDS = (
    "ask",
    "serve",
    "plan",
    "status",
    "stop",
    "deploy",
    "bench",
    "logs",
    "tui",
    "completion",
    "cache",
)
FLAGS = sorted(
    {
        flag
        for action in cli.build_parser()._subparsers._group_actions[0].choices.values()  # type: ignore[union-attr]
        for option in action._actions
        for flag in option.option_strings
        if flag
        not in ("-h", "--help", "--profile", "--install")  # --profile measures, --install installs
    }
    | set(cli.LEGACY)
)
NUMBERS = (
    "0",
    "-1",
    "1",
    "16",
    "17",
    "65536",
    "2.5",
    "-0.0",
    "nan",
    "inf",
    "1e309",
    "abc",
    "",
    "99999999999999999999",
)
WORDS = st.one_of(
    st.sampled_from(COMMANDS),
    st.sampled_from(FLAGS),
    st.sampled_from(NUMBERS),
    st.sampled_from(
        (str(DEFAULT_FLEET), "missing.toml", "-", "self-int4", "none", "prompt-lookup", "ls", "rm")
    ),
    st.text(max_size=12),
    # argv bytes as Python sees them
    st.binary(max_size=6).map(lambda raw: raw.decode("utf-8", "surrogateescape")),
)


def run_cli(argv: list[str]) -> tuple[int | str, str]:
    """Exit code of `fleettui ARGV` (or "started" when it got past its checks) and what it wrote
    to stderr."""
    stderr, stdout = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        try:
            code: int | str = cli.main(argv)
        except SystemExit as exit_:  # argparse: --help/--version (0) or a usage error (2)
            code = int(exit_.code or 0)
        except WouldStart:
            code = "started"
    return code, stderr.getvalue()


@pytest.fixture
def no_starts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every way a command starts something long-lived raises WouldStart; files go to an empty
    folder."""
    import fleettui.commands.bench
    import fleettui.control.running
    import fleettui.planning.plan_profile
    import fleettui.ui.app

    monkeypatch.setattr(fleettui.control.running, "run", would_start)
    # bound when the module loaded
    monkeypatch.setattr(fleettui.commands.bench, "run_loop", would_start)
    monkeypatch.setattr(fleettui.ui.app, "run_app", would_start)
    monkeypatch.setattr(fleettui.planning.plan_profile, "run_plan_profile", would_start)
    monkeypatch.chdir(tmp_path)


def test_the_argument_property_reaches_every_outcome(no_starts: None) -> None:
    """The vocabulary reaches acceptance, our own refusal and argparse's (else the property
    proves little)."""
    assert run_cli(["ask", str(DEFAULT_FLEET), "hi", "--seed", "3"])[0] == "started"
    assert run_cli(["ask", str(DEFAULT_FLEET), "hi", "--spec-k", "17"]) == (
        2,
        "fleettui: --spec-k: 17 is out of range 0..16\n",
    )
    assert run_cli(["ask", str(DEFAULT_FLEET), "hi", "--seed", "abc"])[0] == 2


# -- fleet files
# --------------------------------------------------------------------------------------------

SCALARS = st.one_of(
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(
        ("int4", "fp16", "local", "ssh", "auto", "self-int4", "127.0.0.1", "CPU", "", "\x00")
    ),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
TABLE_KEYS = {
    "model": ("name", "precision", "shards"),
    "runtime": RUNTIME_KEYS,
    "speculation": ("draft", "k", "max_k"),
    "sessions": ("max_sessions", "max_tokens", "temperature", "top_p", "seed"),
    "resilience": (
        "heartbeat_seconds",
        "detect_seconds",
        "grace_seconds",
        "rebalance",
        "calibrate",
    ),
}


def table(keys: tuple[str, ...]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(st.sampled_from(keys) | st.text(max_size=6), VALUES, max_size=4)


DOCUMENTS = st.fixed_dictionaries(
    {},
    optional={
        **{name: table(keys) for name, keys in TABLE_KEYS.items()},
        "hosts": st.lists(table(_HOST_KEYS), max_size=3) | VALUES,
        "stray": VALUES,
    },
)


def check_load(path: Path) -> None:
    """load_fleet(path) returns a fleet or raises a FleetError of one located line; nothing else."""
    try:
        load_fleet(path)
    except FleetError as error:
        message = str(error)
        assert "\n" not in message and message.startswith(str(path)), message
        assert LOCATED.match(message), message


@examples(FLEET_EXAMPLES)
@given(document=DOCUMENTS)
def test_any_toml_document_loads_or_is_refused_at_its_file_line_and_key(
    tmp_path: Path, document: dict[str, Any]
) -> None:
    path = tmp_path / "fleet.toml"
    try:
        path.write_text(tomli_w.dumps(document), encoding="utf-8", errors="surrogatepass")
    except (
        TypeError,
        ValueError,
    ):  # not representable in TOML (a None, a NaN key...): nothing to load
        return
    check_load(path)


ORIGINAL = Path(DEFAULT_FLEET).read_bytes()
EDITS = st.lists(
    st.tuples(st.integers(0, len(ORIGINAL)), st.integers(0, 4), st.binary(max_size=6)),
    min_size=1,
    max_size=4,
)


@examples(BYTES_EXAMPLES)
@given(edits=EDITS)
def test_a_fleet_file_with_random_bytes_loads_or_is_refused_at_its_line(
    tmp_path: Path, edits: list[tuple[int, int, bytes]]
) -> None:
    data = bytearray(ORIGINAL)
    for (
        at,
        cut,
        insert,
    ) in edits:  # replace `cut` bytes at `at` by `insert` (invalid UTF-8 included)
        data[at : at + cut] = insert
    path = tmp_path / "fleet.toml"
    path.write_bytes(bytes(data))
    check_load(path)


@examples(CLI_EXAMPLES)
@given(argv=st.lists(WORDS, max_size=7))
def test_any_argument_list_is_accepted_or_refused_in_one_line(
    no_starts: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, argv: list[str]
) -> None:
    """`fleettui ARGV` starts, answers (exit 0), or is refused with exit 2 and one line saying
    why."""
    # `cache rm` clears an empty folder
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    code, stderr = run_cli(argv)
    recorded = {"status", "logs"} & set(argv[:1])  # no deployment recorded for the fleet: exit 3
    assert code in (0, 2, "started", *((3,) if recorded else ())), (argv, code, stderr)
    if code == 2:
        reason = [line for line in stderr.splitlines() if not line.startswith(("usage:", " "))]
        assert len(reason) == 1 and reason[0].startswith("fleettui"), (argv, stderr)
