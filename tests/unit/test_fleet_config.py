"""Fleet file loading: defaults, typed values, ports, and one `file:line: key: reason` per error."""

from __future__ import annotations

import os
import textwrap
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from fleettui.config.fleet import DEFAULT_FLEET, FLEETS_DIR, Fleet, load_fleet, resolve_fleet
from fleettui.errors import FleetConfigError

HOST = '[[hosts]]\nname = "{name}"\n'


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


def line_of(path: Path, marker: str, occurrence: int = 1) -> int:
    found = 0
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if marker in line:
            found += 1
            if found == occurrence:
                return number
    raise AssertionError(f"{marker!r} not in {path}")


def config_error(path: Path) -> FleetConfigError:
    with pytest.raises(FleetConfigError) as caught:
        load_fleet(path)
    message = str(caught.value)
    assert "\n" not in message
    return caught.value


def test_embedded_default_is_two_local_stages() -> None:
    fleet = load_fleet(resolve_fleet(None))
    assert resolve_fleet(None) == DEFAULT_FLEET
    assert isinstance(fleet, Fleet)
    assert [host.transport for host in fleet.hosts] == ["local", "local"]
    assert {host.address for host in fleet.hosts} == {"127.0.0.1"}
    assert fleet.hosts[0].base_port != fleet.hosts[1].base_port
    assert not set(fleet.hosts[0].ports) & set(fleet.hosts[1].ports)
    assert fleet.model.name == "smollm2-135m-instruct"
    assert fleet.speculation.draft == "self-int4" and fleet.speculation.k == "auto"
    assert fleet.path == DEFAULT_FLEET


def test_office_example_loads_with_typed_values() -> None:
    fleet = load_fleet(FLEETS_DIR / "office.toml")
    assert resolve_fleet("office") == FLEETS_DIR / "office.toml"
    first = fleet.hosts[0]
    assert first.transport == "ssh" and first.user == "fleet" and first.ssh_port == 22
    assert first.identity_file == Path("~/.ssh/id_ed25519").expanduser()
    assert first.ports == (5550, 5551, 5552, 5553)
    assert isinstance(first.memory_gb, float) and isinstance(first.cores, tuple)
    assert fleet.hosts[1].device == "GPU" and fleet.hosts[1].speed == 1.5
    assert fleet.hosts[3].host_key_policy == "tofu"
    assert fleet.sessions.max_sessions == 4 and fleet.sessions.temperature is None
    assert (
        fleet.runtime.encryption == "curve"
        and not fleet.runtime.exact
        and fleet.runtime.compile_cache
    )
    assert not fleet.manual_layers


def test_defaults_and_automatic_ports(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        HOST.format(name="a")
        + HOST.format(name="b")
        + "base_port = 5560\n"
        + HOST.format(name="c"),
    )
    fleet = load_fleet(path)
    ports = [host.base_port for host in fleet.hosts]
    assert ports == [5550, 5560, 5570]
    assert fleet.model.precision == "int4" and fleet.speculation.max_k == 16
    assert fleet.hosts[0].memory_gb == 8.0 and fleet.hosts[0].threads == 0


def test_same_ports_on_different_addresses_are_fine(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        [[hosts]]
        name = "a"
        transport = "ssh"
        address = "10.0.0.1"
        [[hosts]]
        name = "b"
        transport = "ssh"
        address = "10.0.0.2"
        """,
    )
    assert [host.base_port for host in load_fleet(path).hosts] == [5550, 5550]


def test_exact_forces_f32_everywhere(tmp_path: Path) -> None:
    path = write(
        tmp_path, '[runtime]\nexact = true\nkv_cache_precision = "u8"\n' + HOST.format(name="a")
    )
    fleet = load_fleet(path)
    assert fleet.model.precision == "fp32"
    assert (
        fleet.runtime.inference_precision,
        fleet.runtime.kv_cache_precision,
        fleet.runtime.wire_dtype,
    ) == (
        "f32",
        "f32",
        "f32",
    )


def test_manual_layers_accepted(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        HOST.format(name="a")
        + "layers = [0, 10]\n"
        + HOST.format(name="b")
        + "layers = [10, 30]\n",
    )
    fleet = load_fleet(path)
    assert fleet.manual_layers and [h.layers for h in fleet.hosts] == [(0, 10), (10, 30)]


def test_manual_layers_may_cut_a_layer_between_its_attention_and_its_mlp(tmp_path: Path) -> None:
    from fleettui.planning.planner import plan_fleet

    path = write(
        tmp_path,
        HOST.format(name="a")
        + "layers = [0, 18.5]\n"
        + HOST.format(name="b")
        + "layers = [18.5, 30]\n",
    )
    fleet = load_fleet(path)
    assert [h.layers for h in fleet.hosts] == [(0, 18.5), (18.5, 30)]
    plan = plan_fleet(fleet)
    assert plan.manual and plan.ranges == ((0, 19), (19, 30)) and plan.mid_cuts == (19,)
    assert [stage.span for stage in plan.stages] == ["[0, 18.5)", "[18.5, 30)"]


def test_draft_path_and_model_folder_resolved_relative_to_file(tmp_path: Path) -> None:
    (tmp_path / "draft").mkdir()
    (tmp_path / "model").mkdir()
    path = write(
        tmp_path,
        '[model]\nname = "model"\n[speculation]\ndraft = "draft"\nk = 3\n' + HOST.format(name="a"),
    )
    fleet = load_fleet(path)
    assert fleet.model.name == str(tmp_path / "model")
    assert fleet.speculation.draft_path == tmp_path / "draft" and fleet.speculation.k == 3


# --- every error names file:line: key
# --------------------------------------------------------------

ERRORS = [
    # (fleet text, marker of the offending line, occurrence, key in the message, words in the
    # reason)
    ("[model]\nnmae = 'x'\n" + HOST.format(name="a"), "nmae", 1, "model.nmae", "unknown key"),
    (
        "[model]\nprecision = 'int3'\n" + HOST.format(name="a"),
        "precision",
        1,
        "model.precision",
        "int4",
    ),
    (
        "[model]\nname = './nothing.gguf'\n" + HOST.format(name="a"),
        "name =",
        1,
        "model.name",
        "no such file",
    ),
    (
        "[runtime]\nexact = 'yes'\n" + HOST.format(name="a"),
        "exact",
        1,
        "runtime.exact",
        "true or false",
    ),
    (
        "[runtime]\ncompile_cache = 1\n" + HOST.format(name="a"),
        "compile_cache",
        1,
        "runtime.compile_cache",
        "true or false",
    ),
    (
        "[runtime]\nresult_batch_ms = -5\n" + HOST.format(name="a"),
        "result_batch_ms",
        1,
        "runtime.result_batch_ms",
        "0..1000",
    ),
    (
        "[runtime]\nwire_dtype = 'bf16'\n" + HOST.format(name="a"),
        "wire_dtype",
        1,
        "runtime.wire_dtype",
        "f16 | f32",
    ),
    (
        "[runtime]\nencryption = 'tls'\n" + HOST.format(name="a"),
        "encryption",
        1,
        "runtime.encryption",
        "curve",
    ),
    ("[speculation]\nk = 'many'\n" + HOST.format(name="a"), "k =", 1, "speculation.k", '"auto"'),
    (
        "[speculation]\nmax_k = 8\nk = 12\n" + HOST.format(name="a"),
        "k =",
        2,
        "speculation.k",
        "max_k",
    ),
    (
        "[speculation]\ndraft = 'nope'\n" + HOST.format(name="a"),
        "draft",
        1,
        "speculation.draft",
        "existing path",
    ),
    (
        "[sessions]\nmax_sessions = 0\n" + HOST.format(name="a"),
        "max_sessions",
        1,
        "sessions.max_sessions",
        "1..64",
    ),
    (
        "[sessions]\ntop_p = 1.5\n" + HOST.format(name="a"),
        "top_p",
        1,
        "sessions.top_p",
        "out of range",
    ),
    (
        "[session]\nseed = 1\n" + HOST.format(name="a"),
        "[session]",
        1,
        "fleet.session",
        "unknown key",
    ),
    ("[model]\n", "[model]", 1, "hosts", "at least one"),
    (HOST.format(name="a") + "memory_gb = '8'\n", "memory_gb", 1, "hosts[a].memory_gb", "a number"),
    (HOST.format(name="a") + "threads = 1.5\n", "threads", 1, "hosts[a].threads", "an integer"),
    (HOST.format(name="a") + "ssh_port = true\n", "ssh_port", 1, "hosts[a].ssh_port", "an integer"),
    (
        HOST.format(name="a") + HOST.format(name="b") + "colour = 1\n",
        "colour",
        1,
        "hosts[b].colour",
        "unknown key",
    ),
    (
        HOST.format(name="a") + HOST.format(name="a"),
        'name = "a"',
        2,
        "hosts[a].name",
        "duplicate host name",
    ),
    (
        HOST.format(name="a") + "device = 'TPU'\n",
        "device",
        1,
        "hosts[a].device",
        "CPU | GPU | NPU | AUTO",
    ),
    (
        HOST.format(name="a") + "transport = 'telnet'\n",
        "transport",
        1,
        "hosts[a].transport",
        "local | ssh",
    ),
    (
        HOST.format(name="a") + "host_key_policy = 'any'\n",
        "host_key_policy",
        1,
        "hosts[a].host_key_policy",
        "tofu",
    ),
    (
        HOST.format(name="a") + "address = '10.1.1.1'\n",
        "address",
        1,
        "hosts[a].address",
        'transport = "ssh"',
    ),
    (
        HOST.format(name="a") + "base_port = 80\n",
        "base_port",
        1,
        "hosts[a].base_port",
        "1024..65532",
    ),
    (HOST.format(name="a") + "cores = [0, 0]\n", "cores", 1, "hosts[a].cores", "repeats"),
    (
        HOST.format(name="a") + "cores = [\n  0,\n  'x',\n]\n",
        "cores",
        1,
        "hosts[a].cores",
        "CPU numbers",
    ),
    ('[[hosts]]\nname = "bad name"\n', "bad name", 1, "hosts[bad name].name", "letters"),
    ("[[hosts]]\naddress = '127.0.0.1'\n", "[[hosts]]", 1, "hosts[#1]", "missing key name"),
    (
        HOST.format(name="a") + "base_port = 6000\n" + HOST.format(name="b") + "base_port = 6002\n",
        "base_port = 6002",
        1,
        "hosts[b].base_port",
        "overlap host a",
    ),
    (
        HOST.format(name="a")
        + "base_port = 6000\n"
        + HOST.format(name="b")
        + "address = 'localhost'\nbase_port = 6003\n",
        "base_port = 6003",
        1,
        "hosts[b].base_port",
        "same address",
    ),
    (
        HOST.format(name="a") + "layers = [0, 10]\n" + HOST.format(name="b"),
        "[[hosts]]",
        2,
        "hosts[b].layers",
        "all hosts or on none",
    ),
    (HOST.format(name="a") + "layers = [5, 5]\n", "layers", 1, "hosts[a].layers", "start < end"),
    (
        HOST.format(name="a") + "layers = [0, 1, 2]\n",
        "layers",
        1,
        "hosts[a].layers",
        "two layer numbers",
    ),
    (
        HOST.format(name="a") + "layers = [0, 12.25]\n",
        "layers",
        1,
        "hosts[a].layers",
        "N.5 cuts layer N",
    ),
    (
        HOST.format(name="a")
        + "layers = [0, 12.5]\n"
        + HOST.format(name="b")
        + "layers = [12.5, 13]\n",
        "[12.5, 13]",
        1,
        "hosts[b].layers",
        "holds no layer's attention",
    ),
    (
        HOST.format(name="a")
        + "layers = [0, 12.5]\n"
        + HOST.format(name="b")
        + "layers = [12.5, 29.5]\n",
        "[12.5, 29.5]",
        1,
        "hosts[b].layers",
        "has 30 layers",
    ),
    (
        HOST.format(name="a")
        + "layers = [0, 10]\n"
        + HOST.format(name="b")
        + "layers = [11, 30]\n",
        "[11, 30]",
        1,
        "hosts[b].layers",
        "contiguous",
    ),
    (
        HOST.format(name="a")
        + "layers = [0, 10]\n"
        + HOST.format(name="b")
        + "layers = [10, 29]\n",
        "[10, 29]",
        1,
        "hosts[b].layers",
        "has 30 layers",
    ),
    (
        "[model]\nprecision = int4\n" + HOST.format(name="a"),
        "precision",
        1,
        "toml",
        "Invalid value",
    ),
    ("[model]\nname = 'x", "name = 'x", 1, "toml", "Expected"),
    (
        "[model]\nprecision = 'int4'\n[model]\n" + HOST.format(name="a"),
        "[model]",
        2,
        "toml",
        "Cannot",
    ),
]


@pytest.mark.parametrize(("text", "marker", "occurrence", "key", "reason"), ERRORS)
def test_config_error_names_file_line_and_key(
    tmp_path: Path, text: str, marker: str, occurrence: int, key: str, reason: str
) -> None:
    path = write(tmp_path, text)
    error = config_error(path)
    expected_line = line_of(path, marker, occurrence)
    assert (error.path, error.line, error.key) == (path, expected_line, key), str(error)
    assert str(error).startswith(f"{path}:{expected_line}: {key}: ")
    assert reason.lower() in error.reason.lower(), str(error)


def test_missing_file_is_one_line(tmp_path: Path) -> None:
    error = config_error(tmp_path / "absent.toml")
    assert str(error) == f"{tmp_path / 'absent.toml'}: fleet: no such fleet file"
    with pytest.raises(FleetConfigError, match="no such fleet file"):
        resolve_fleet(str(tmp_path / "absent.toml"))


def test_the_embedded_default_is_the_published_local_fleet() -> None:
    """The wheel ships fleettui/config/local.toml; the repository shows it as fleets/local.toml."""
    assert DEFAULT_FLEET.read_text() == (FLEETS_DIR / "local.toml").read_text()


def test_a_folder_instead_of_a_fleet_file_gets_a_hint(tmp_path: Path) -> None:
    (tmp_path / "office.toml").write_text(HOST.format(name="a"))
    with pytest.raises(FleetConfigError, match=r"is a folder, not a fleet file: .*office\.toml"):
        resolve_fleet(str(tmp_path))
    with pytest.raises(FleetConfigError, match="is a folder"):
        load_fleet(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FleetConfigError, match="fleettui init"):
        resolve_fleet(str(empty))


def test_an_unquoted_string_gets_a_hint(tmp_path: Path) -> None:
    path = write(
        tmp_path, "[model]\nname = smollm2-135m-instruct   # the model\n" + HOST.format(name="a")
    )
    error = config_error(path)
    assert error.line == 2 and error.key == "toml"
    assert error.reason == 'Invalid value: strings need quotes, e.g. name = "smollm2-135m-instruct"'
    path = write(tmp_path, "[runtime]\nexact = yes\n" + HOST.format(name="a"))
    assert 'exact = "yes"' in config_error(path).reason
    path = write(tmp_path, "[model]\nprecision = [\n" + HOST.format(name="a"))
    assert "quotes" not in config_error(path).reason  # not a bare word: no misleading hint


@pytest.mark.parametrize("setting", ["", "[runtime]\ncompile_cache = false\n"])
def test_compile_cache_reaches_every_worker_config(tmp_path: Path, setting: str) -> None:
    from fleettui.control.deployment import build_deployment

    fleet = load_fleet(write(tmp_path, setting + HOST.format(name="a") + HOST.format(name="b")))
    deployment = build_deployment(
        fleet, [(0, 20), (20, 30)], lambda host: str(tmp_path), str(tmp_path)
    )
    configs = [placement.config for placement in deployment.placements]
    assert deployment.draft is not None
    assert {config.compile_cache for config in [*configs, deployment.draft.config]} == {not setting}


@pytest.mark.parametrize(
    ("setting", "batch"), [("", 40.0), ("[runtime]\nresult_batch_ms = 0\n", 0.0)]
)
def test_result_batch_reaches_only_the_last_stage(
    tmp_path: Path, setting: str, batch: float
) -> None:
    """A run's Results are coalesced at the last stage (the one that sends them to the
    coordinator)."""
    from fleettui.control.deployment import build_deployment

    fleet = load_fleet(write(tmp_path, setting + HOST.format(name="a") + HOST.format(name="b")))
    assert fleet.runtime.result_batch_ms == batch
    deployment = build_deployment(
        fleet, [(0, 20), (20, 30)], lambda host: str(tmp_path), str(tmp_path)
    )
    configs = [placement.config for placement in deployment.placements]
    *others, last = [config for config in configs if config.role == "stage"]
    assert last.result_port is not None and last.result_batch_ms == batch
    # its Proposals are never held
    drafts = [config for config in configs if config.role == "draft"]
    assert {config.result_batch_ms for config in [*others, *drafts]} == {0.0}


def test_port_blocks_handed_out_never_overlap_each_other_nor_the_fleets_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block is free only until its worker binds: a fleet's hosts and its draft are all chosen
    before any binds, so a later block must not overlap an earlier one (a stage once failed with
    "Address already in use" because its draft had drawn a block over its own)."""
    from fleettui.control import deployment as module

    blocks = [range(base, base + 4) for base in (module.free_port_block() for _ in range(200))]
    ports = [port for block in blocks for port in block]
    assert len(ports) == len(set(ports))
    first = blocks[0].start
    module._HANDED_OUT.clear()  # forgotten: only the fleet's own ports keep the draft off them now
    fleet = load_fleet(write(tmp_path, HOST.format(name="a") + HOST.format(name="b")))
    fleet = replace(fleet, hosts=(replace(fleet.hosts[0], base_port=first), fleet.hosts[1]))
    # the first three overlap
    draws = [first, first + 2, first - 3] + [first + 4 * n for n in range(4, 400)]
    monkeypatch.setattr(module, "random", SimpleNamespace(Random=lambda: _Draws(draws)))
    deployment = module.build_deployment(
        fleet, [(0, 20), (20, 30)], lambda host: str(tmp_path), str(tmp_path)
    )
    assert deployment.draft is not None
    assert deployment.draft.host.base_port >= first + 16


class _Draws:
    def __init__(self, values: list[int]) -> None:
        self.values = iter(values)

    def randrange(self, start: int, stop: int) -> int:
        return next(self.values)


def test_two_processes_draw_port_blocks_from_different_stripes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two commands (or test workers) choosing blocks at once cannot remember each other's: each
    draws from its own stripe of the range, so their blocks never overlap unless their process ids
    share a stripe."""
    from fleettui.control import deployment as module

    drawn = {}
    for pid in (3, 4):
        monkeypatch.setattr(module.os, "getpid", lambda pid=pid: pid)
        drawn[pid] = {module.free_port_block() for _ in range(30)}
    monkeypatch.undo()
    low, high = module._ephemeral_range()
    width = (low - 1024) // module.PORT_STRIPES
    for pid, bases in drawn.items():
        assert all(
            1024 + (pid % module.PORT_STRIPES) * width
            <= base
            < 1024 + (pid % module.PORT_STRIPES + 1) * width
            for base in bases
        ), pid


def test_local_stages_share_this_machines_cores_disjointly_unless_a_host_says_otherwise() -> None:
    """Several local stages each get a contiguous slice of the usable CPUs, threads = slice size
    (the first stages take the remainder); SSH hosts, a lone local stage, too few CPUs, or any local
    host that sets `cores` or `threads` leave the fleet as written."""
    from fleettui.config.fleet import Host
    from fleettui.config.local_cores import share_local_cores
    from fleettui.control.settings import apply
    from fleettui.control.store import Settings

    fleet = load_fleet(DEFAULT_FLEET)
    split = share_local_cores(fleet, [1, 0])
    assert [(h.cores, h.threads) for h in split.hosts] == [((0,), 1), ((1,), 1)]
    three = replace(fleet, hosts=(*fleet.hosts, replace(fleet.hosts[0], name="c", base_port=5570)))
    assert [(h.cores, h.threads) for h in share_local_cores(three, range(8)).hosts] == [
        ((0, 1, 2), 3),
        ((3, 4, 5), 3),
        ((6, 7), 2),
    ]
    ssh = Host(name="pc", transport="ssh", address="10.0.0.9")
    mixed = replace(fleet, hosts=(fleet.hosts[0], ssh, fleet.hosts[1]))
    assert [h.cores for h in share_local_cores(mixed, [0, 1, 2, 3]).hosts] == [(0, 1), (), (2, 3)]
    assert (
        share_local_cores(replace(fleet, hosts=(fleet.hosts[0], ssh)), [0, 1]).hosts[0].cores == ()
    )
    assert share_local_cores(three, [0, 1]) == three  # three stages, two CPUs: shared as before
    for written in ({"cores": (0, 1)}, {"threads": 2}):
        chosen = replace(fleet, hosts=(replace(fleet.hosts[0], **written), fleet.hosts[1]))
        assert share_local_cores(chosen, [0, 1]) == chosen
    assert share_local_cores(split, [0, 1]) == split  # applying it again changes nothing
    # the fleet as it runs (the controller, the TUI) is split with this process's own CPUs
    usable = sorted(os.sched_getaffinity(0))
    assert apply(fleet, Settings()) == share_local_cores(fleet, usable)
