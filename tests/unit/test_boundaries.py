"""The package boundaries of the house rules, machine-checked, plus the linters on the whole
tree."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(package: str) -> dict[str, set[str]]:
    """Top-level module names each file of `package` imports (static: lazy imports inside
    functions count)."""
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
    assert [
        line for line in found if not line.startswith("fleettui/provision/remote_ops.py:")
    ] == []


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
        "import sys, fleettui.cli, fleettui.control.controller, fleettui.runtime.coordinator, "
        "fleettui.config.fleet, fleettui.planning.planner;"
        "heavy = [m for m in ('openvino', 'torch', 'transformers', 'textual', 'asyncssh') if m in "
        "sys.modules];"
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
    result = subprocess.run(
        [sys.executable, "-m", *command], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


# -- layers inside fleettui: each package imports only the packages below it
# ---------------------------

LAYERS: dict[str, set[str]] = {
    "errors": set(),
    "text_input": {"errors"},  # the one rule by which text enters (decoding, surrogates, NUL)
    # the top-level guard's one-line report of an unexpected exception
    "crash": {
        "errors",
        "config",
    },
    "model": {"errors"},  # the model description: shape, builtin models, GGUF header
    "config": {"errors", "text_input", "model"},
    "planning": {"errors", "model", "config"},
    "runtime": {"errors"},
    "provision": {"errors", "config"},
    "control": {"errors", "model", "config", "planning", "runtime", "provision"},
    # the HTTP API over a running fleet
    "serve": {
        "errors",
        "text_input",
        "config",
        "runtime",
        "control",
    },
    "bench": {"errors", "model", "config", "planning", "runtime", "control", "serve"},
    "ui": {"errors", "text_input", "config", "runtime", "control", "serve"},
    "commands": {
        "errors",
        "text_input",
        "model",
        "config",
        "planning",
        "runtime",
        "control",
        "serve",
        "bench",
        "ui",
    },
    "cli": {"errors", "config", "commands", "crash"},
    "__main__": {"cli"},
}
# The wire and shard contract: the only parts of remote_worker that fleettui may use.
CONTRACT = {
    "remote_worker",
    "remote_worker.protocol",
    "remote_worker.config",
    "remote_worker.manifest",
    "remote_worker.replies",
}


def _package(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    return parts[1]


def test_fleettui_packages_import_only_the_layers_below_them() -> None:
    wrong = []
    for path, names in imported_modules("fleettui").items():
        package = _package(path)
        for name in names:
            parts = name.split(".")
            if parts[0] != "fleettui" or len(parts) < 2 or parts[1] == package:
                continue
            if parts[1] not in LAYERS.get(package, set()):
                wrong.append(f"{path}: {name}")
    assert wrong == []


def test_fleettui_uses_only_the_contract_of_remote_worker() -> None:
    used = {
        f"{path}: {name}"
        for path, names in imported_modules("fleettui").items()
        for name in names
        if name.split(".")[0] == "remote_worker" and name not in CONTRACT
    }
    assert used == set()


def test_no_import_cycle_between_modules() -> None:
    """The same analysis as /work/shared/tools/import_cycles.py: every import statement counts."""
    for package in ("fleettui", "remote_worker", "shard_compiler"):
        modules = {}
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
        graph: dict[str, set[str]] = {name: set() for name in modules}
        for name, path in modules.items():
            base = name if path.name == "__init__.py" else name.rpartition(".")[0]
            for node in ast.walk(ast.parse(path.read_text())):
                targets: list[str] = []
                if isinstance(node, ast.ImportFrom):
                    module = node.module or ""
                    if node.level:
                        prefix = base.split(".")[: len(base.split(".")) - (node.level - 1)]
                        module = ".".join(prefix + ([node.module] if node.module else []))
                    for alias in node.names:
                        sub = f"{module}.{alias.name}"
                        targets.append(sub if sub in modules else module)
                elif isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                graph[name].update(t for t in targets if t in modules and t != name)
        assert _cycles(graph) == [], package


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for following in graph[node]:
            if following not in index:
                visit(following)
                low[node] = min(low[node], low[following])
            elif following in stack:
                low[node] = min(low[node], index[following])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_module_size_report_runs() -> None:
    """Module size is a soft report (.ci/module-sizes, printed by the test command), not a
    failing limit."""
    result = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "module-sizes"), "3"], capture_output=True, text=True
    )
    assert result.returncode == 0 and result.stdout.count("\n") == 4, result.stdout + result.stderr


def test_format_check_passes() -> None:
    command = ["ruff", "format", "--check", "fleettui", "remote_worker", "shard_compiler", "tests"]
    result = subprocess.run(
        [sys.executable, "-m", *command], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


STRICT_FLAGS = (
    "disallow_untyped_defs",
    "disallow_incomplete_defs",
    "disallow_any_generics",
    "warn_return_any",
)


def test_mypy_holds_fleettui_and_the_worker_to_the_strict_rules() -> None:
    """The one mypy run of `test_linters_pass` is strict for both packages (pyproject's override),
    not only for the modules someone remembered to list: no untyped or half-typed def, no bare
    generic, no Any returned."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    strict = [
        override
        for override in config.get("overrides", [])
        if all(override.get(flag) for flag in STRICT_FLAGS)
    ]
    covered = {module for override in strict for module in override["module"]}
    assert {"fleettui.*", "remote_worker.*"} <= covered


@pytest.mark.parametrize(
    "entry",
    [
        # the worker, profile, mono
        "import remote_worker.__main__, remote_worker.profile, remote_worker.mono",
        "import shard_compiler.__main__",  # the compiler (NNCF reports through the same module)
        "import fleettui.cli, fleettui.bench.baseline",  # the operator, the GenAI baseline
        # a host's probe
        "import runpy; runpy.run_path('fleettui/provision/remote_ops.py')['devices']({})",
    ],
)
def test_no_process_of_ours_reports_to_openvinos_telemetry(entry: str) -> None:
    """`import openvino` sends a usage event to Google Analytics unless `openvino_telemetry` is
    missing, and waits for it at exit (3 s on a PC without internet): none of our processes loads
    that module."""
    code = f"{entry}\nimport sys, openvino, nncf\nprint(sys.modules.get('openvino_telemetry'))"
    # CI=true silences it too
    environment = {key: value for key, value in os.environ.items() if key != "CI"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=environment,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "None"
