"""The package boundaries of the house rules, machine-checked, plus the linters on the whole tree."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(package: str) -> dict[str, set[str]]:
    """Top-level module names each file of `package` imports (static: lazy imports inside functions count)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


def offenders(package: str, forbidden: tuple[str, ...], skip: str | None = None) -> list[str]:
    return sorted(
        f"{path}: {name}"
        for path, names in imported_modules(package).items()
        if skip is None or not path.startswith(skip)
        for name in names
        if name.split(".")[0] in forbidden
    )


def test_remote_worker_needs_only_openvino_numpy_pyzmq_psutil() -> None:
    forbidden = (
        "textual",
        "torch",
        "transformers",
        "optimum",
        "nncf",
        "fleettui",
        "shard_compiler",
        "asyncssh",
    )
    assert offenders("remote_worker", forbidden) == []


def test_fleettui_never_imports_openvino_or_the_compile_side() -> None:
    forbidden = ("openvino", "openvino_genai", "torch", "transformers", "nncf", "shard_compiler")
    found = offenders("fleettui", forbidden)
    # remote_ops.py is not imported by fleettui: its text is the program each host's own Python runs
    # (the device probe there imports openvino on the host, after the worker is installed).
    assert [line for line in found if not line.startswith("fleettui/provision/remote_ops.py:")] == []


def test_the_domain_is_reachable_without_the_tui() -> None:
    assert offenders("fleettui", ("textual",), skip="fleettui/ui") == []


def test_shard_compiler_uses_only_the_manifest_contract_of_remote_worker() -> None:
    uses = {name for names in imported_modules("shard_compiler").values() for name in names}
    assert {name for name in uses if name.startswith("remote_worker")} <= {
        "remote_worker.manifest",
        "remote_worker",
    }
    assert not any(name.split(".")[0] in ("fleettui", "textual") for name in uses)


def test_fleettui_help_is_instant_no_heavy_import() -> None:
    probe = (
        "import sys, fleettui.cli, fleettui.control.controller, fleettui.runtime.coordinator, fleettui.config.fleet, fleettui.planning.planner;"
        "heavy = [m for m in ('openvino', 'torch', 'transformers', 'textual', 'asyncssh') if m in sys.modules];"
        "print(heavy)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", "fleettui", "remote_worker", "shard_compiler", "tests"],
        ["mypy", "fleettui", "remote_worker", "shard_compiler"],
    ],
    ids=["ruff", "mypy"],
)
def test_linters_pass(command: list[str]) -> None:
    result = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
