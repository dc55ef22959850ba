"""The command line: subcommands, the old flag forms as aliases, refused flags, version,
completion, pipes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleettui.cli import build_parser, main, translate
from fleettui.config.fleet import DEFAULT_FLEET
from fleettui.errors import FleetError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ([], ["tui"]),
        (["f.toml"], ["tui", "f.toml"]),
        (["f.toml", "--exact"], ["tui", "f.toml", "--exact"]),
        (
            ["f.toml", "--ask", "Hi", "--max-tokens", "4"],
            ["ask", "f.toml", "Hi", "--max-tokens", "4"],
        ),
        (["--ask", "Hi"], ["ask", str(DEFAULT_FLEET), "Hi"]),
        (["f.toml", "--plan"], ["plan", "f.toml"]),
        (["--deploy", "f.toml"], ["deploy", "f.toml"]),
        (["f.toml", "--stop"], ["stop", "f.toml"]),
        (["f.toml", "--bench", "--quick", "--json"], ["bench", "f.toml", "--quick", "--json", "-"]),
        (["ask", "f.toml", "Hi"], ["ask", "f.toml", "Hi"]),
        (
            ["--ask", "-", "--system", "Be brief."],
            ["ask", str(DEFAULT_FLEET), "-", "--system", "Be brief."],
        ),
        (["f.toml", "--deploy", "--prune"], ["deploy", "f.toml", "--prune"]),
        (["init", "out.toml", "local"], ["init", "out.toml", "local"]),
        (["cache", "ls"], ["cache", "ls"]),
        (["f.toml", "--bench", "--only", "pcs"], ["bench", "f.toml", "--only", "pcs"]),
        (["f.toml", "--plan", "--profile"], ["plan", "f.toml", "--profile"]),
    ],
)
def test_old_flag_forms_become_subcommands(old: list[str], new: list[str]) -> None:
    assert translate(old) == new


def test_two_old_modes_are_refused() -> None:
    with pytest.raises(FleetError, match="cannot be combined"):
        translate(["f.toml", "--plan", "--stop"])


def test_flags_that_do_not_apply_to_a_subcommand_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv in (
        ["stop", "f.toml", "--max-tokens", "3"],
        ["plan", "f.toml", "--exact"],
        ["status", "--quick"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(argv)
        assert exit_info.value.code == 2
        assert "unrecognized arguments" in capsys.readouterr().err


def test_every_subcommand_is_registered_with_help() -> None:
    text = build_parser().format_help()
    for name in (
        "tui",
        "ask",
        "plan",
        "deploy",
        "status",
        "logs",
        "stop",
        "bench",
        "init",
        "cache",
        "completion",
    ):
        assert name in text
    parsed = build_parser().parse_args(translate(["--ask", "-", "--system", "Be brief."]))
    assert (parsed.command, parsed.prompt, parsed.system) == ("ask", "-", "Be brief.")
    assert build_parser().parse_args(["deploy", "f.toml", "--prune"]).prune
    assert build_parser().parse_args(["deploy", "f.toml", "--recheck"]).recheck
    assert build_parser().parse_args(["cache", "prune", "--keep", "3"]).keep == 3


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleettui", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def test_version_comes_from_the_package_metadata() -> None:
    from importlib.metadata import version

    result = run("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"fleettui {version('fleettui')}"


def test_completion_script_names_the_subcommands_and_their_flags() -> None:
    result = run("completion", "bash")
    assert result.returncode == 0
    assert "complete -o default -o filenames -F _fleettui fleettui" in result.stdout
    assert (
        "ask) " in result.stdout and "--max-tokens" in result.stdout and "deploy" in result.stdout
    )
    checked = subprocess.run(["bash", "-n"], input=result.stdout, text=True, capture_output=True)
    assert checked.returncode == 0, checked.stderr


def test_plan_json_and_a_closed_pipe_end_quietly() -> None:
    result = run("plan", "--json")
    assert result.returncode == 0
    plan = json.loads(result.stdout)
    assert plan["stages"] and plan["stages"][0]["layers"][0] == 0
    # the plan of the fleet as it runs: the default fleet's two local stages on their own CPUs
    from fleettui.config.fleet import load_fleet
    from fleettui.config.local_cores import share_local_cores

    hosts = share_local_cores(load_fleet(DEFAULT_FLEET)).hosts
    assert [stage["cores"] for stage in plan["stages"]] == [list(host.cores) for host in hosts]
    text = run("plan").stdout
    assert ("local stages on their own CPUs: stage-a on CPU" in text) == bool(hosts[0].cores), text
    piped = subprocess.run(
        f"{sys.executable} -m fleettui plan | head -c 10",
        shell=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert piped.returncode == 0 and piped.stderr == "" and len(piped.stdout) == 10


def test_status_stop_and_logs_of_a_fleet_never_deployed(tmp_path: Path) -> None:
    assert main(["status", str(DEFAULT_FLEET)]) == 3
    assert main(["stop", str(DEFAULT_FLEET)]) == 0
    assert main(["logs", str(DEFAULT_FLEET)]) == 3


def test_an_empty_prompt_and_a_bad_spec_k_are_one_line_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["ask", str(DEFAULT_FLEET), "  "]) == 2
    assert main(["ask", str(DEFAULT_FLEET), "Hi", "--spec-k", "40"]) == 2
    assert main(["ask", str(DEFAULT_FLEET), "Hi", "--max-tokens", "0"]) == 2
    # out-of-range sampling: the request's own check, refused before any worker starts (no
    # traceback)
    assert main(["ask", str(DEFAULT_FLEET), "Hi", "--top-p", "7"]) == 2
    assert main(["ask", str(DEFAULT_FLEET), "Hi", "--temperature", "9"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == [
        "fleettui: the prompt is empty",
        "fleettui: --spec-k: 40 is out of range 0..16",
        "fleettui: --max-tokens: 0 must be at least 1",
        "fleettui: top_p: 7.0 is outside (0, 1]",
        "fleettui: temperature: 9.0 is outside [0, 2]",
    ]


def test_bench_only_and_plan_profile_are_subcommand_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert build_parser().parse_args(["bench", "f.toml", "--only", "spec"]).only == "spec"
    assert build_parser().parse_args(["plan", "f.toml", "--profile"]).profile is True
    # refused before anything starts
    assert main(["bench", str(DEFAULT_FLEET), "--only", "nothing"]) == 2
    # quick has no scale rows
    assert main(["bench", str(DEFAULT_FLEET), "--quick", "--only", "scale"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and errors[0].startswith(
        "fleettui: --only: 'nothing' is not one of anchors"
    )
    assert "no such rows" in errors[1]


def test_bench_rebalance_refuses_a_bad_share_or_fleet_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert build_parser().parse_args(["bench", "f.toml", "--rebalance"]).rebalance == 0.4
    # refused before anything starts
    assert main(["bench", str(DEFAULT_FLEET), "--rebalance", "1.5"]) == 2
    one = tmp_path / "one.toml"
    one.write_text('[[hosts]]\nname = "a"\n')
    assert main(["bench", str(one), "--rebalance"]) == 2  # one stage: nothing to rebalance
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and errors[0].startswith("fleettui: --rebalance: share 1.5")
    assert "at least two hosts" in errors[1]


def test_a_start_on_held_ports_fails_at_once_naming_the_port_and_its_holder(tmp_path: Path) -> None:
    import os
    import socket

    from fleettui.control.deployment import free_port_block

    base = free_port_block()
    path = tmp_path / "fleet.toml"
    path.write_text(f'[[hosts]]\nname = "a"\nbase_port = {base}\n')
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base + 1))
        holder.listen()
        result = run("ask", str(path), "Hi")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"fleettui: port {base + 1} of a is held by pid {os.getpid()} "
        f"({' '.join(psutil_cmdline())})"
    )


def psutil_cmdline() -> list[str]:
    import psutil

    return psutil.Process().cmdline()[:6]


def test_a_bench_with_zero_tokens_is_refused_not_run_with_the_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--max-tokens 0` once meant "the default" (a full 20-minute bench); every bench mode
    refuses it now."""
    for extra in ([], ["--quick"], ["--soak", "5"], ["--rebalance", "0.5"]):
        assert main(["bench", str(DEFAULT_FLEET), "--max-tokens", "0", *extra]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == ["fleettui: --max-tokens: 0 must be at least 1"] * 4
